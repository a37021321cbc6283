/* One pass over a float32 or bfloat16 host tensor: its sum, sum of squares and largest
 * magnitude (lightning_scale.native). Loaded with ctypes; no Python or torch headers.
 *
 * The tensor is `rows` rows of `cols` contiguous elements, row r at x + r * stride.
 * Elements are added in float32 vector lanes, 32 lanes, 8 elements a lane at a time
 * (chunks of 256 elements), and the chunks' totals in float64: a positive sum of 8
 * float32 values is within 8 * 2**-24 relative, whatever the tensor's size. (Rows whose
 * length is not a multiple of 32 add their last elements in float64 one by one.)
 * out[0] = sum, out[1] = sum of squares (of the float32 squares), out[2] = max |x| for the
 * ls_sums_max_* kernels, -1 for the others; max |x| is meaningful only where both sums
 * are finite (every element finite, no square overflowing).
 */
#include <stdint.h>
#include <string.h>

#define LS_ABI 2
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

static inline v8i imin(v8i a, v8i b) {
    v8i m = a < b;
    return (a & m) | (b & ~m);
}

static inline uint32_t hmax(v8i v) {
    int32_t m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* one element of a row's tail (its length past the last full vector), in float64 */
static inline void add_scalar(float v, double *total, double *squares) {
    *total += v;
    *squares += (double)(v * v);
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

/* WITH_MAX: also max |x| (four more vector ops per 32 elements). The vector lanes carry
 * on from row to row (strided rows of a wider tensor, such as q of a fused qkv projection,
 * are as fast as contiguous ones) and are added in float64 every CHUNK elements. */
#define LS_KERNEL(NAME, T, LOAD, SCALAR, WITH_MAX)                                         \
    LS_CLONES void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, double *out) { \
        double total = 0.0, squares = 0.0;                                                 \
        uint32_t top = 0;                                                                  \
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                        \
        v8f q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};                                        \
        v8i m = {0};                                                                       \
        int64_t pending = 0; /* elements in the lanes since they were last added up */    \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            int64_t i = 0;                                                                 \
            for (; cols - i >= 32; i += 32) {                                              \
                v8f a = LOAD(p + i), b = LOAD(p + i + 8);                                  \
                v8f c = LOAD(p + i + 16), d = LOAD(p + i + 24);                            \
                s0 += a; s1 += b; s2 += c; s3 += d;                                        \
                q0 += a * a; q1 += b * b; q2 += c * c; q3 += d * d;                        \
                if (WITH_MAX)                                                              \
                    m = imax(m, imax(imax(abs_bits(a), abs_bits(b)), imax(abs_bits(c), abs_bits(d)))); \
                pending += 32;                                                             \
                if (pending >= CHUNK) {                                                    \
                    total += hsum((s0 + s1) + (s2 + s3));                                  \
                    squares += hsum((q0 + q1) + (q2 + q3));                                \
                    s0 = s1 = s2 = s3 = q0 = q1 = q2 = q3 = (v8f){0};                      \
                    pending = 0;                                                           \
                }                                                                          \
            }                                                                              \
            for (; i < cols; i++) {                                                        \
                float v = SCALAR(p[i]);                                                    \
                add_scalar(v, &total, &squares);                                           \
                uint32_t t = to_bits(v) & 0x7fffffffu;                                     \
                top = t > top ? t : top;                                                   \
            }                                                                              \
        }                                                                                  \
        total += hsum((s0 + s1) + (s2 + s3));                                              \
        squares += hsum((q0 + q1) + (q2 + q3));                                            \
        if (WITH_MAX) {                                                                    \
            uint32_t t = hmax(m);                                                          \
            top = t > top ? t : top;                                                       \
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

/* Every statistic group in one read (moments, range, formats): out[0] = sum, out[1] = sum
 * of squares (as above), out[2] = max |x| as a float (NaN where any element is NaN),
 * out[3] = the smallest nonzero |x| (+inf where there is none; NaN elements left out),
 * out[4] = the NaN count; counts[k] = #{|x| < bound[k]} over the non-NaN elements, for
 * the `nbounds` (at most 16) positive float32 bit patterns `bounds` (a non-negative float
 * compares as its bits). Per chunk of 256 elements, a first pass takes the moments, the
 * extremes and the NaN and zero counts; a bound at or below the chunk's least nonzero |x|
 * has exactly its zeros below it, one above its largest every element: only the bounds in
 * between are counted, by a second pass over the chunk (in cache). On activations and
 * gradients that is one or two of the 13 format bounds a chunk.
 */
#define LS_ALL(NAME, T, LOAD, SCALAR)                                                        \
    LS_CLONES void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, const int32_t *bounds, \
                        int32_t nbounds, int64_t *counts, double *out) {                    \
        double total = 0.0, squares = 0.0;                                                 \
        int64_t nan = 0;                                                                   \
        int32_t top = 0, least = 0x7f800000; /* +inf */                                    \
        for (int k = 0; k < nbounds; k++) counts[k] = 0;                                   \
        const v8i inf = (v8i){0} + 0x7f800000;                                             \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            int64_t i = 0;                                                                 \
            while (cols - i >= 8) {                                                        \
                v8i m = {0}, lo = inf, nans = {0}, zeros = {0};                            \
                int64_t start = i;                                                         \
                int64_t end = cols - i >= CHUNK ? i + CHUNK : cols - (cols - i) % 8;        \
                while (i < end) { /* moments: 8 elements a lane, then float64 */          \
                    v8f s = {0}, q = {0};                                                  \
                    int64_t part = end - i >= 64 ? i + 64 : end;                            \
                    for (; i < part; i += 8) {                                             \
                        v8f a = LOAD(p + i);                                               \
                        s += a;                                                            \
                        q += a * a;                                                        \
                        v8i b = abs_bits(a);                                               \
                        v8i isnan = b > inf;                                               \
                        v8i iszero = b == 0;                                               \
                        nans -= isnan;                                                     \
                        zeros -= iszero;                                                   \
                        m = imax(m, b);                                                    \
                        v8i out_ = iszero | isnan; /* out of the least nonzero */          \
                        lo = imin(lo, (b & ~out_) | (inf & out_));                         \
                    }                                                                      \
                    total += hsum(s);                                                      \
                    squares += hsum(q);                                                    \
                }                                                                          \
                int64_t chunk_nan = 0, chunk_zeros = 0;                                    \
                int32_t chunk_top = 0, chunk_least = 0x7f800000;                           \
                for (int j = 0; j < 8; j++) {                                              \
                    chunk_nan += nans[j];                                                  \
                    chunk_zeros += zeros[j];                                               \
                    chunk_top = m[j] > chunk_top ? m[j] : chunk_top;                       \
                    chunk_least = lo[j] < chunk_least ? lo[j] : chunk_least;               \
                }                                                                          \
                nan += chunk_nan;                                                          \
                top = chunk_top > top ? chunk_top : top;                                   \
                least = chunk_least < least ? chunk_least : least;                         \
                for (int k = 0; k < nbounds; k++) {                                        \
                    int32_t bk = bounds[k];                                                \
                    if (bk <= chunk_least) {                                               \
                        counts[k] += chunk_zeros;                                          \
                    } else if (bk > chunk_top) { /* (NaN bits are above every bound) */    \
                        counts[k] += (end - start) - chunk_nan;                            \
                    } else {                                                               \
                        v8i below = {0}, bound = (v8i){0} + bk;                            \
                        for (int64_t t = start; t < end; t += 8)                           \
                            below -= abs_bits(LOAD(p + t)) < bound;                        \
                        for (int j = 0; j < 8; j++) counts[k] += below[j];                 \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
            for (; i < cols; i++) {                                                        \
                float v = SCALAR(p[i]);                                                    \
                add_scalar(v, &total, &squares);                                           \
                int32_t b = (int32_t)(to_bits(v) & 0x7fffffffu);                           \
                top = b > top ? b : top;                                                   \
                if (b > 0x7f800000) {                                                      \
                    nan++;                                                                 \
                    continue;                                                              \
                }                                                                          \
                if (b != 0 && b < least) least = b;                                        \
                for (int k = 0; k < nbounds; k++) counts[k] += b < bounds[k];              \
            }                                                                              \
        }                                                                                  \
        out[0] = total;                                                                    \
        out[1] = squares;                                                                  \
        out[2] = from_bits((uint32_t)top);                                                 \
        out[3] = from_bits((uint32_t)least);                                               \
        out[4] = (double)nan;                                                              \
    }

LS_ALL(ls_all_f32, float, load_f32, scalar_f32)
LS_ALL(ls_all_bf16, uint16_t, load_bf16, scalar_bf16)
