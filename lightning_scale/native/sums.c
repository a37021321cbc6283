/* One pass over a float32 or bfloat16 host tensor: its sum, sum of squares and largest
 * magnitude (lightning_scale.native). Loaded with ctypes; no Python or torch headers.
 *
 * The tensor is `rows` rows of `cols` contiguous elements, row r at x + r * stride.
 * Elements are added in float32 vector lanes, 32 lanes, 8 elements a lane at a time
 * (chunks of 256 elements), and the chunks' totals in float64: a positive sum of 8
 * float32 values is within 8 * 2**-24 relative, whatever the tensor's size.
 * out[0] = sum, out[1] = sum of squares (of the float32 squares), out[2] = max |x| for the
 * ls_sums_max_* kernels, -1 for the others; max |x| is meaningful only where both sums
 * are finite (every element finite, no square overflowing).
 */
#include <stdint.h>
#include <string.h>

#define LS_ABI 1
#define CHUNK 256

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(LS_NO_CLONES)
#define LS_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LS_CLONES
#endif

int ls_abi(void) { return LS_ABI; }

static inline v8f load_f32(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8f load_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline double hsum(v8f v) {
    return (((double)v[0] + v[1]) + ((double)v[2] + v[3])) + (((double)v[4] + v[5]) + ((double)v[6] + v[7]));
}

static inline v8i abs_bits(v8f v) {
    v8i u;
    memcpy(&u, &v, sizeof u);
    return u & 0x7fffffff;
}

/* max of bit patterns of non-negative floats: the same order as their values */
static inline v8i imax(v8i a, v8i b) {
    v8i m = a > b;
    return (a & m) | (b & ~m);
}

static inline uint32_t hmax(v8i v) {
    int32_t m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* WITH_MAX: also max |x| (four more vector ops per 32 elements) */
#define LS_KERNEL(NAME, T, LOAD, SCALAR, WITH_MAX)                                         \
    LS_CLONES void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, double *out) { \
        double total = 0.0, squares = 0.0;                                                 \
        uint32_t top = 0;                                                                  \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            int64_t i = 0;                                                                 \
            while (cols - i >= 32) {                                                       \
                v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                \
                v8f q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};                                \
                v8i m = {0};                                                               \
                int64_t end = cols - i >= CHUNK ? i + CHUNK : cols - (cols - i) % 32;       \
                for (; i < end; i += 32) {                                                 \
                    v8f a = LOAD(p + i), b = LOAD(p + i + 8);                              \
                    v8f c = LOAD(p + i + 16), d = LOAD(p + i + 24);                        \
                    s0 += a; s1 += b; s2 += c; s3 += d;                                    \
                    q0 += a * a; q1 += b * b; q2 += c * c; q3 += d * d;                    \
                    if (WITH_MAX)                                                          \
                        m = imax(m, imax(imax(abs_bits(a), abs_bits(b)), imax(abs_bits(c), abs_bits(d)))); \
                }                                                                          \
                total += hsum((s0 + s1) + (s2 + s3));                                      \
                squares += hsum((q0 + q1) + (q2 + q3));                                    \
                if (WITH_MAX) {                                                            \
                    uint32_t t = hmax(m);                                                  \
                    top = t > top ? t : top;                                               \
                }                                                                          \
            }                                                                              \
            for (; i < cols; i++) {                                                        \
                float v = SCALAR(p[i]);                                                    \
                total += v;                                                                \
                squares += (double)(v * v);                                                \
                uint32_t t = to_bits(v) & 0x7fffffffu;                                     \
                top = t > top ? t : top;                                                   \
            }                                                                              \
        }                                                                                  \
        out[0] = total;                                                                    \
        out[1] = squares;                                                                  \
        out[2] = WITH_MAX ? from_bits(top) : -1.0;                                         \
    }

static inline float scalar_f32(float v) { return v; }
static inline float scalar_bf16(uint16_t h) { return from_bits((uint32_t)h << 16); }

LS_KERNEL(ls_sums_f32, float, load_f32, scalar_f32, 0)
LS_KERNEL(ls_sums_bf16, uint16_t, load_bf16, scalar_bf16, 0)
LS_KERNEL(ls_sums_max_f32, float, load_f32, scalar_f32, 1)
LS_KERNEL(ls_sums_max_bf16, uint16_t, load_bf16, scalar_bf16, 1)
