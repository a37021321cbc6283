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
#include <float.h>
#include <stdint.h>
#include <string.h>

#define LS_ABI 7
#define CHUNK 256

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef double v8d __attribute__((vector_size(64)));

/* Variants per CPU (AVX-512, AVX2, SSE2), picked at load time; LS_NO_V4 for compilers without
 * x86-64-v4 (GCC < 11), LS_NO_CLONES without ifunc support (musl) */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(LS_NO_CLONES) && !defined(LS_NO_V4)
#define LS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(LS_NO_CLONES)
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
/* (lane loops: compilers make them one min or max instruction; a blend of masks is two) */
static inline __attribute__((always_inline)) v8i imax(v8i a, v8i b) {
    v8i r;
    for (int j = 0; j < 8; j++) r[j] = a[j] > b[j] ? a[j] : b[j];
    return r;
}

static inline __attribute__((always_inline)) v8i imin(v8i a, v8i b) {
    v8i r;
    for (int j = 0; j < 8; j++) r[j] = a[j] < b[j] ? a[j] : b[j];
    return r;
}

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (v8i){__VA_ARGS__})
#endif

/* every lane: the largest lane of v (three swaps and maxima) */
static inline __attribute__((always_inline)) v8i bmax(v8i v) {
    v = imax(v, SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = imax(v, SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5));
    return imax(v, SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6));
}

static inline __attribute__((always_inline)) uint32_t hmax(v8i v) { return (uint32_t)bmax(v)[0]; }

/* the least of a and b as unsigned numbers, per lane; the least lane of v */
static inline __attribute__((always_inline)) v8i umin(v8i a, v8i b) {
    v8i r;
    for (int j = 0; j < 8; j++) r[j] = (uint32_t)a[j] < (uint32_t)b[j] ? a[j] : b[j];
    return r;
}

static inline __attribute__((always_inline)) uint32_t uhmin(v8i v) {
    v = umin(v, SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = umin(v, SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5));
    return (uint32_t)umin(v, SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
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

/* float16 to float32, exact: the magnitude's bits moved to float32's places are 2^-112 times
 * the value (subnormals too), exponent 31 (inf, NaN) becomes 255 */
static inline v8f load_f16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u);
    v8f mag;
    v8u bits = (u & 0x7fffu) << 13;
    memcpy(&mag, &bits, sizeof mag);
    mag *= 0x1p112f;
    memcpy(&bits, &mag, sizeof bits);
    bits |= ((u & 0x7c00u) == 0x7c00u) & 0x7f800000u;
    bits |= (u & 0x8000u) << 16;
    memcpy(&mag, &bits, sizeof mag);
    return mag;
}

static inline float scalar_f16(uint16_t h) {
    uint16_t lanes[8] = {h};
    return load_f16(lanes)[0];
}

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
        v8d total8 = {0}, squares8 = {0};                                                  \
        int64_t nan = 0;                                                                   \
        int32_t top = 0, least = 0x7f800000; /* +inf */                                    \
        for (int k = 0; k < nbounds; k++) counts[k] = 0;                                   \
        const v8i inf = (v8i){0} + 0x7f800000;                                             \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            int64_t i = 0;                                                                 \
            while (cols - i >= 8) {                                                        \
                v8i m = {0}, lo = (v8i){0} - 1, zeros = {0};                               \
                int64_t start = i;                                                         \
                int64_t end = cols - i >= CHUNK ? i + CHUNK : cols - (cols - i) % 8;        \
                while (i < end) { /* moments: 8 elements a lane, then float64 lanes */     \
                    v8f s = {0}, q = {0};                                                  \
                    int64_t part = end - i >= 64 ? i + 64 : end;                            \
                    for (; i < part; i += 8) {                                             \
                        v8f a = LOAD(p + i);                                               \
                        s += a;                                                            \
                        q += a * a;                                                        \
                        v8i b = abs_bits(a);                                               \
                        zeros -= b == 0;                                                   \
                        m = imax(m, b);                                                    \
                        lo = umin(lo, b - 1); /* (0 wraps to the largest: not a nonzero) */ \
                    }                                                                      \
                    total8 += __builtin_convertvector(s, v8d);                             \
                    squares8 += __builtin_convertvector(q, v8d);                           \
                }                                                                          \
                int64_t chunk_nan = 0, chunk_zeros = 0;                                    \
                int32_t chunk_top = (int32_t)hmax(m);                                      \
                uint32_t below = uhmin(lo); /* least nonzero less 1; NaN's: above inf's */ \
                int32_t chunk_least = below >= 0x7f800000u ? 0x7f800000 : (int32_t)below + 1; \
                for (int j = 0; j < 8; j++) chunk_zeros += zeros[j];                       \
                if (chunk_top > 0x7f800000) { /* NaNs (rare): counted apart */            \
                    v8i nans = {0};                                                        \
                    for (int64_t t = start; t < end; t += 8) nans -= abs_bits(LOAD(p + t)) > inf; \
                    for (int j = 0; j < 8; j++) chunk_nan += nans[j];                      \
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
        for (int j = 0; j < 8; j++) total += total8[j], squares += squares8[j];             \
        out[0] = total;                                                                    \
        out[1] = squares;                                                                  \
        out[2] = from_bits((uint32_t)top);                                                 \
        out[3] = from_bits((uint32_t)least);                                               \
        out[4] = (double)nan;                                                              \
    }

LS_ALL(ls_all_f32, float, load_f32, scalar_f32)
LS_ALL(ls_all_bf16, uint16_t, load_bf16, scalar_bf16)

/* ---------------------------------------------------------------------------------------
 * The block what-ifs (lightning_scale.record.stats.blocks, which defines them and is the
 * reference): per row of `cols` elements, blocks of 32 from its start (the last zero-padded),
 * non-finite elements taken as 0. For MXFP8 E4M3, MXFP8 E5M2, MXFP4 (E8M0 scale from the
 * block's max |x|, torchao's FLOOR) and NVFP4 (16-element halves, E4M3 scale from max |x| / 6):
 * out[3 f] = sum of (q(x) - x)^2, out[3 f + 1] = sum of x^2, out[3 f + 2] = #{x != 0, q(x) = 0},
 * f in that order. Every float32 operation of the reference's casts is done here in the same
 * order (none of them a product followed by a sum: no contraction can change them; the build
 * flags turn it off elsewhere), so q(x) is the reference's, bit for bit; its errors are exact
 * in float32, squared and added in float32 over 4 blocks (16 a lane, fused where the CPU has
 * FMA) and in float64 across them (the reference adds float32 squares: ~1e-7 relative apart).
 */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif


static inline v8i bits_of(v8f v) {
    v8i u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static inline v8f float_of(v8i u) {
    v8f v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* a (finite, >= 0, at most the format's largest value) rounded to nearest-even on the grid of
 * a format with `m` mantissa bits whose least normal exponent is `lo` - 127: the grid step is
 * 2^(E - 127 - m), E = max(a's exponent, lo); adding c = 2^(E - 127 + 23 - m) (above a) leaves
 * exactly the bits of that grid, rounded to nearest, ties to even, and taking c away again is exact. */
static inline v8f round_grid(v8f a, int m, int lo) {
    v8i e = imax(bits_of(a) & 0x7f800000, (v8i){0} + (lo << 23));
    v8f c = float_of(e + ((23 - m) << 23));
    return (a + c) - c;
}

/* (From here to the end of the moments kernels GCC may fuse a product and a sum into one
 * rounding where the CPU has FMA: the block errors q rp - |x| unit are exact either way, the
 * sums of squares and powers take one rounding less; no cast has a product followed by a sum.) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif

/* Blocks are taken GROUP at a time (4 blocks of 32, 128 elements): a first look at each block
 * keeps its magnitudes (bits of |x|, non-finite as 0) and the lane maxima of its two halves; the
 * 8 halves' maxima are then reduced together (lanes = halves) and every block's scales worked
 * out in vector lanes (two divisions per group, none per element); last, each format casts the
 * group's elements. The squares of the errors (d - |x|) unit, unit the power of two that brings
 * the group's max |x| near 1 (exact), are added in float32 over the group (16 a lane) and in
 * float64 once per group, times unit^-2 (the reference adds float32 squares of a whole chunk
 * scaled by its max: squares below 2^-126 of the max's are lost by both). */
#define GROUP 4

typedef struct {
    v8i a[GROUP][4];     /* |x| bits, non-finite elements as 0 */
    v8i sign[GROUP][4];  /* x's sign bits (for `dst`) */
    v8i half[2 * GROUP]; /* lane maxima of each block's two halves of 16, block b's at 2b, 2b + 1 */
    int n;
} block_group;

typedef struct {
    v8d sq, err[4];
    v8i nonzero, kept[4];
} block_acc;

/* a block's 4 vectors into the group (the values loaded, as float32) */
static inline __attribute__((always_inline)) void take_block(block_group *g, const v8f *v) {
    for (int j = 0; j < 4; j++) {
        v8i b = abs_bits(v[j]), finite = b < 0x7f800000;
        g->a[g->n][j] = b & finite;
        g->sign[g->n][j] = bits_of(v[j]) & finite & (int32_t)0x80000000; /* (non-finite: +0, as the reference) */
    }
    g->half[2 * g->n] = imax(g->a[g->n][0], g->a[g->n][1]);
    g->half[2 * g->n + 1] = imax(g->a[g->n][2], g->a[g->n][3]);
    g->n++;
}

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* two vectors' 4-lane halves' maxima: x's at 0-3, y's at 4-7 */
static inline __attribute__((always_inline)) v8i pair_maxima(v8i x, v8i y) {
    return imax(SHUFFLE2(x, y, 0, 1, 2, 3, 8, 9, 10, 11), SHUFFLE2(x, y, 4, 5, 6, 7, 12, 13, 14, 15));
}

/* of two such, each 4 lanes' pairs' maxima: x's halves at 0-1 and 4-5, y's at 2-3 and 6-7 */
static inline __attribute__((always_inline)) v8i quad_maxima(v8i x, v8i y) {
    return imax(SHUFFLE2(x, y, 0, 1, 8, 9, 4, 5, 12, 13), SHUFFLE2(x, y, 2, 3, 10, 11, 6, 7, 14, 15));
}

/* the max of each of 8 vectors, lane i holding h[i]'s (the three steps leave the lanes in the
 * order 0 4 2 6 1 5 3 7 of their inputs: the vectors are taken in that order) */
static inline __attribute__((always_inline)) v8i lane_maxima(const v8i *h) {
    v8i w0 = quad_maxima(pair_maxima(h[0], h[4]), pair_maxima(h[2], h[6]));
    v8i w1 = quad_maxima(pair_maxima(h[1], h[5]), pair_maxima(h[3], h[7]));
    return imax(SHUFFLE2(w0, w1, 0, 8, 2, 10, 4, 12, 6, 14), SHUFFLE2(w0, w1, 1, 9, 3, 11, 5, 13, 7, 15));
}

/* MX, E8M0 scale: emax, element mantissa bits, least normal exponent + 127, largest value */
static const struct { int emax, m, lo; float top; } MX[3] = {{8, 3, 121, 448.0f}, {15, 2, 113, 57344.0f}, {2, 1, 127, 6.0f}};

/* Per format (MXFP8 E4M3, E5M2, MXFP4, NVFP4) and lane (MX: block b at 2b and 2b + 1, NVFP4: the
 * halves), what its elements are multiplied by (inv), their dequantizing scale, and scale * unit. */
typedef struct {
    float inv[4][8], scale[4][8], rp[4][8];
} group_scales;

static inline __attribute__((always_inline)) void put(float *to, v8f v) { memcpy(to, &v, sizeof v); }

/* the scales from the lane maxima of the halves `h`: MX's E8M0 scale 2^(floor(log2 amax) - emax),
 * clamped to [2^-127, 2^127] (2^-127: torchao divides by 2^-126 and multiplies by 2^-127), its
 * inverse exact; NVFP4's e4m3(clamp(amax / 6, 2^-6, 448)) and its float32 reciprocal, as torchao */
static inline __attribute__((always_inline)) void work_out_scales(v8i h, v8f unit, group_scales *s) {
    v8i amax = imax(h, SHUFFLE2(h, h, 1, 0, 3, 2, 5, 4, 7, 6));
    for (int f = 0; f < 3; f++) {
        v8i t = (amax >> 23) - (127 + MX[f].emax);
        v8i biased = imin(imax(t, (v8i){0} - 127), (v8i){0} + 128) + 127;
        v8i divisor = imax(biased, (v8i){0} + 1);
        v8f scale = float_of((biased << 23) | ((biased == 0) & 0x00400000));
        put(s->inv[f], float_of((254 - divisor) << 23));
        put(s->scale[f], scale);
        put(s->rp[f], scale * unit);
    }
    v8f nv = float_of(h) / 6.0f;
    nv = float_of(imin(imax(bits_of(nv), bits_of((v8f){0} + 0.015625f)), bits_of((v8f){0} + 448.0f)));
    nv = round_grid(nv, 3, 121); /* the E4M3 scale */
    put(s->inv[3], 1.0f / nv);
    put(s->scale[3], nv);
    put(s->rp[3], nv * unit);
}

static inline __attribute__((always_inline)) v8f lane(const float *v, int i) { return (v8f){0} + v[i]; }

/* one format on a vector of magnitudes `af` whose (unit-scaled) magnitudes are `au`: |q| =
 * round(min(|x| inv, top)), e = |q| rp - |x| unit (exact); `dst`, unless NULL, gets |q| scale
 * with x's sign */
static inline __attribute__((always_inline)) void cast_vector(v8f af, v8f au, v8i sign, v8f inv, v8f scale, v8f rp, v8i cap, int m, int lo,
                               v8f *es, v8i *kept, float *dst) {
    v8f q = round_grid(float_of(imin(bits_of(af * inv), cap)), m, lo);
    v8f e = q * rp - au;
    *es += e * e;
    *kept += imin(bits_of(q), (v8i){0} + 1);
    if (dst) {
        v8f d = float_of(bits_of(q * scale) | sign);
        memcpy(dst, &d, sizeof d);
    }
}

/* the group's blocks cast; `dst`, unless NULL: their 4 dequantized blocks each ((4, 32) floats) */
static inline __attribute__((always_inline)) void cast_group(block_group *g, block_acc *acc, float *dst) {
    for (int b = g->n; b < GROUP; b++) g->half[2 * b] = g->half[2 * b + 1] = (v8i){0};
    v8i h = lane_maxima(g->half);
    int32_t ex = (int32_t)(hmax(h) >> 23);
    ex = ex < 1 ? 1 : ex > 253 ? 253 : ex;
    const v8f unit = float_of((v8i){0} + ((254 - ex) << 23));
    const double u2 = (double)from_bits((uint32_t)ex << 23) * (double)from_bits((uint32_t)ex << 23);
    group_scales s;
    work_out_scales(h, unit, &s);
    v8i caps[4];
    for (int f = 0; f < 3; f++) caps[f] = bits_of((v8f){0} + MX[f].top);
    caps[3] = bits_of((v8f){0} + 6.0f);
    v8f sq = {0}, es[4] = {{0}, {0}, {0}, {0}};
    v8i kept[4] = {{0}, {0}, {0}, {0}}, nonzero = {0};
    const v8i one = (v8i){0} + 1;
    for (int b = 0; b < g->n; b++) {
        v8f inv[4], scale[4], rp[4];
        for (int f = 0; f < 3; f++) inv[f] = lane(s.inv[f], 2 * b), scale[f] = lane(s.scale[f], 2 * b), rp[f] = lane(s.rp[f], 2 * b);
        for (int j = 0; j < 4; j++) {
            if (j % 2 == 0) /* NVFP4: each half its own scale */
                inv[3] = lane(s.inv[3], 2 * b + j / 2), scale[3] = lane(s.scale[3], 2 * b + j / 2), rp[3] = lane(s.rp[3], 2 * b + j / 2);
            v8i a = g->a[b][j];
            v8f af = float_of(a), au = af * unit;
            sq += au * au;
            nonzero += imin(a, one);
            float *to = dst ? dst + 128 * b + 8 * j : NULL; /* (NVFP4's halves side by side) */
            v8i sign = g->sign[b][j];
            /* (written out: a loop over the formats kept its sums in memory) */
            cast_vector(af, au, sign, inv[0], scale[0], rp[0], caps[0], MX[0].m, MX[0].lo, &es[0], &kept[0], to);
            cast_vector(af, au, sign, inv[1], scale[1], rp[1], caps[1], MX[1].m, MX[1].lo, &es[1], &kept[1], to ? to + 32 : NULL);
            cast_vector(af, au, sign, inv[2], scale[2], rp[2], caps[2], MX[2].m, MX[2].lo, &es[2], &kept[2], to ? to + 64 : NULL);
            cast_vector(af, au, sign, inv[3], scale[3], rp[3], caps[3], 1, 127, &es[3], &kept[3], to ? to + 96 : NULL);
        }
    }
    acc->sq += __builtin_convertvector(sq, v8d) * u2;
    for (int f = 0; f < 4; f++) acc->err[f] += __builtin_convertvector(es[f], v8d) * u2, acc->kept[f] += kept[f];
    acc->nonzero += nonzero;
    g->n = 0;
}

static inline __attribute__((always_inline)) void fold_counts(block_acc *acc, int64_t *flushed) {
    for (int j = 0; j < 8; j++)
        for (int f = 0; f < 4; f++) flushed[f] += acc->nonzero[j] - acc->kept[f][j];
    acc->nonzero = (v8i){0};
    for (int f = 0; f < 4; f++) acc->kept[f] = (v8i){0};
}

/* `dst`, unless NULL: every block's 4 dequantized blocks, (rows, ceil(cols / 32), 4, 32) floats
 * (NVFP4's two halves side by side; for the tests). The body is inlined twice, with and
 * without `dst` (without: no test on it, no stores that might alias the sums). */
#define LS_BLOCKS(NAME, T, LOAD, SCALAR)                                                     \
    static inline __attribute__((always_inline)) void NAME##_body(const T *x, int64_t rows, int64_t cols, \
                                                                  int64_t stride, double *out, float *dst) { \
        block_acc acc;                                                                     \
        block_group g;                                                                     \
        memset(&acc, 0, sizeof acc);                                                       \
        g.n = 0;                                                                           \
        int64_t flushed[4] = {0, 0, 0, 0}, since = 0;                                      \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            v8f v[4];                                                                      \
            for (int64_t i = 0; i < cols; i += 32) {                                       \
                if (cols - i >= 32) {                                                      \
                    for (int j = 0; j < 4; j++) v[j] = LOAD(p + i + 8 * j);                \
                } else { /* the last block, zero-padded */                                 \
                    float pad[32] = {0};                                                   \
                    for (int64_t t = i; t < cols; t++) pad[t - i] = SCALAR(p[t]);          \
                    for (int j = 0; j < 4; j++) v[j] = load_f32(pad + 8 * j);              \
                }                                                                          \
                take_block(&g, v);                                                         \
                if (g.n == GROUP) {                                                        \
                    cast_group(&g, &acc, dst);                                             \
                    dst = dst ? dst + 128 * GROUP : NULL;                                  \
                    if (++since == (1 << 24)) { /* (16 a lane a group: before an int32 could wrap) */ \
                        fold_counts(&acc, flushed);                                        \
                        since = 0;                                                         \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        if (g.n) cast_group(&g, &acc, dst);                                                \
        fold_counts(&acc, flushed);                                                        \
        double sq = 0.0;                                                                   \
        for (int j = 0; j < 8; j++) sq += acc.sq[j];                                       \
        for (int f = 0; f < 4; f++) {                                                     \
            double e = 0.0;                                                                \
            for (int j = 0; j < 8; j++) e += acc.err[f][j];                                \
            out[3 * f] = e;                                                                \
            out[3 * f + 1] = sq;                                                           \
            out[3 * f + 2] = (double)flushed[f];                                           \
        }                                                                                  \
    }                                                                                      \
    LS_CLONES void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, double *out, float *dst) { \
        if (dst)                                                                           \
            NAME##_body(x, rows, cols, stride, out, dst);                                  \
        else                                                                               \
            NAME##_body(x, rows, cols, stride, out, NULL);                                 \
    }

LS_BLOCKS(ls_blocks_f32, float, load_f32, scalar_f32)
LS_BLOCKS(ls_blocks_bf16, uint16_t, load_bf16, scalar_bf16)

/* ---------------------------------------------------------------------------------------
 * Central moments of the finite elements (the kurtosis group; lightning_scale.record.stats
 * .outliers.moments_row is the reference): out = [count, mean, M2, M3, M4], Mk the sum of
 * (x - mean)^k. Per chunk of MCHUNK elements (in cache after a first pass): a centre c (the
 * chunk's mean, rounded), then in float64 the sums of (x - c)^k, moved to the chunk's exact
 * mean; chunks merged by the pairwise update of central moments (Pebay 2008). float64 holds
 * any float32's fourth power: no scaling.
 */
#define MCHUNK 1024

typedef struct {
    double n, mean, m2, m3, m4;
} moments;

static inline void merge_moments(moments *a, const moments *b) {
    if (b->n == 0) return;
    if (a->n == 0) {
        *a = *b;
        return;
    }
    double na = a->n, nb = b->n, n = na + nb, d = b->mean - a->mean;
    double dn = d / n, dn2 = dn * dn;
    a->m4 += b->m4 + d * dn2 * dn * na * nb * (na * na - na * nb + nb * nb) + 6.0 * dn2 * (na * na * b->m2 + nb * nb * a->m2) +
             4.0 * dn * (na * b->m3 - nb * a->m3);
    a->m3 += b->m3 + d * dn2 * na * nb * (na - nb) + 3.0 * dn * (na * b->m2 - nb * a->m2);
    a->m2 += b->m2 + d * dn * na * nb;
    a->mean += dn * nb;
    a->n = n;
}

/* one chunk of `len` elements at p (len a multiple of 8 unless it is a row's tail) */
#define LS_MOMENT_CHUNK(T, LOAD, SCALAR)                                                     \
    static inline __attribute__((always_inline)) moments chunk_moments_##T(const T *p, int64_t len, double centre) { \
        double c = centre;                                                                 \
        moments m = {0, 0, 0, 0, 0};                                                       \
        int64_t i = 0;                                                                     \
        if (c != c) { /* no centre given: the chunk's mean, from a first pass */          \
            v8d s = {0};                                                                   \
            v8i c8 = {0};                                                                  \
            for (; len - i >= 8; i += 8) {                                                 \
                v8f a = LOAD(p + i);                                                       \
                v8i fin = abs_bits(a) < 0x7f800000;                                        \
                s += __builtin_convertvector(float_of(bits_of(a) & fin), v8d);             \
                c8 -= fin;                                                                 \
            }                                                                              \
            double total = 0, count = 0;                                                   \
            for (int j = 0; j < 8; j++) total += s[j], count += c8[j];                     \
            for (int64_t t = i; t < len; t++) {                                            \
                float v = SCALAR(p[t]);                                                    \
                if ((to_bits(v) & 0x7fffffffu) < 0x7f800000u) total += v, count += 1;      \
            }                                                                              \
            if (count == 0) return m;                                                      \
            c = total / count; /* (rounded: the sums about it are moved to the exact mean) */ \
        }                                                                                  \
        v8d s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0};                                        \
        v8i c8 = {0}, top = {0};                                                           \
        for (i = 0; len - i >= 8; i += 8) { /* every element finite (checked after) */    \
            v8f a = LOAD(p + i);                                                           \
            top = imax(top, abs_bits(a));                                                  \
            v8d d = __builtin_convertvector(a, v8d) - c;                                   \
            v8d d2 = d * d;                                                                \
            s1 += d;                                                                       \
            s2 += d2;                                                                      \
            s3 += d2 * d;                                                                  \
            s4 += d2 * d2;                                                                 \
        }                                                                                  \
        c8 += (int32_t)(i / 8);                                                            \
        if (hmax(top) >= 0x7f800000u) { /* a NaN or an Inf: again, leaving them out */     \
            s1 = s2 = s3 = s4 = (v8d){0};                                                  \
            c8 = (v8i){0};                                                                 \
            for (i = 0; len - i >= 8; i += 8) {                                            \
                v8f a = LOAD(p + i);                                                       \
                v8i fin = abs_bits(a) < 0x7f800000;                                        \
                v8d d = __builtin_convertvector(float_of(bits_of(a) & fin), v8d) - c;      \
                d = d * __builtin_convertvector(fin & 1, v8d); /* (non-finite: 0, not -c) */ \
                v8d d2 = d * d;                                                            \
                s1 += d;                                                                   \
                s2 += d2;                                                                  \
                s3 += d2 * d;                                                              \
                s4 += d2 * d2;                                                             \
                c8 -= fin;                                                                 \
            }                                                                              \
        }                                                                                  \
        double r1 = 0, r2 = 0, r3 = 0, r4 = 0, count = 0;                                  \
        for (int j = 0; j < 8; j++) r1 += s1[j], r2 += s2[j], r3 += s3[j], r4 += s4[j], count += c8[j]; \
        for (int64_t t = i; t < len; t++) {                                                \
            float v = SCALAR(p[t]);                                                        \
            if ((to_bits(v) & 0x7fffffffu) >= 0x7f800000u) continue;                       \
            double d = (double)v - c, d2 = d * d;                                          \
            r1 += d, r2 += d2, r3 += d2 * d, r4 += d2 * d2, count += 1;                    \
        }                                                                                  \
        if (count == 0) return m;                                                          \
        double e = r1 / count; /* the exact mean is c + e: move the sums there */          \
        m.n = count;                                                                       \
        m.mean = c + e;                                                                    \
        m.m2 = r2 - r1 * e;                                                                \
        m.m3 = r3 - 3.0 * e * r2 + 2.0 * count * e * e * e;                                \
        m.m4 = r4 - 4.0 * e * r3 + 6.0 * e * e * r2 - 3.0 * count * e * e * e * e;         \
        return m;                                                                          \
    }

LS_MOMENT_CHUNK(float, load_f32, scalar_f32)
LS_MOMENT_CHUNK(uint16_t, load_bf16, scalar_bf16)

/* `centre`: a value near the mean (the first read's), or NaN: each chunk's own mean, from a
 * first pass over it. Either way the sums about it are moved to each chunk's exact mean; a
 * centre given saves that pass and costs float64 cancellation of about (|chunk mean - centre|
 * / the spread)^2 ulp. */
#define LS_MOMENTS(NAME, T)                                                                  \
    LS_CLONES void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, double centre, double *out) { \
        moments all = {0, 0, 0, 0, 0};                                                     \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            for (int64_t i = 0; i < cols; i += MCHUNK) {                                   \
                moments m = chunk_moments_##T(p + i, cols - i < MCHUNK ? cols - i : MCHUNK, centre); \
                merge_moments(&all, &m);                                                   \
            }                                                                              \
        }                                                                                  \
        out[0] = all.n, out[1] = all.mean, out[2] = all.m2, out[3] = all.m3, out[4] = all.m4; \
    }

LS_MOMENTS(ls_moments_f32, float)
LS_MOMENTS(ls_moments_bf16, uint16_t)

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* ---------------------------------------------------------------------------------------
 * The per-tensor FP8 what-if (lightning_scale.record.stats.fp8 defines it and is the
 * reference): with `amax`, the largest finite |x| (its float32 bits; negative: found here by a
 * first read), per format f (E4M3, then E5M2) scale = max / amax in float32 (the largest
 * float32 where that is inf), q = fp8(|x| scale) rounded to nearest, ties to even, on the
 * format's grid (|x| scale is at most max within a float32 rounding, which rounds to max as
 * torch's cast does: saturation and NaN never arise), and
 * out[3 f] = sum of ((q - |x| scale) / scale)^2, out[3 f + 1] = sum of x^2, out[3 f + 2] =
 * #{x != 0, q = 0}. Non-finite elements count as 0. |x| scale is exact in float64 and q - |x|
 * scale is rounded once, as the reference's; the squares are added in float64 (4 lanes of 8)
 * and divided by scale^2 at the end (the reference divides each error: a few float64 roundings
 * apart). A row's last (cols mod 8) elements are zero-padded: a zero adds nothing.
 */
static const struct { float max; int m, lo; } FP8[2] = {{448.0f, 3, 121}, {57344.0f, 2, 113}};

typedef struct {
    v8d sq, err[2];
    v8i nonzero, kept[2];
} fp8_acc;

static inline void fp8_vector(v8f v, const v8f *scale, const v8d *scale64, fp8_acc *acc) {
    const v8i one = (v8i){0} + 1;
    v8i b = abs_bits(v);
    b &= b < 0x7f800000;
    v8f a = float_of(b);
    v8d w = __builtin_convertvector(a, v8d);
    acc->sq += w * w;
    acc->nonzero += imin(b, one);
    for (int f = 0; f < 2; f++) {
        v8i cap = (v8i){0} + (int32_t)to_bits(FP8[f].max);
        v8f q = round_grid(float_of(imin(bits_of(a * scale[f]), cap)), FP8[f].m, FP8[f].lo);
        v8d e = __builtin_convertvector(q, v8d) - w * scale64[f];
        acc->err[f] += e * e;
        acc->kept[f] += imin(bits_of(q), one);
    }
}

static inline void fold_fp8(fp8_acc *acc, int64_t *counts) {
    for (int j = 0; j < 8; j++) {
        counts[0] += acc->nonzero[j];
        counts[1] += acc->kept[0][j];
        counts[2] += acc->kept[1][j];
    }
    acc->nonzero = acc->kept[0] = acc->kept[1] = (v8i){0};
}

#define LS_FP8(NAME, T, LOAD, SCALAR)                                                        \
    LS_CLONES void NAME(const T *x, int64_t rows, int64_t cols, int64_t stride, int32_t amax, double *out) { \
        if (amax < 0) { /* the largest finite |x| */                                        \
            v8i m = {0};                                                                   \
            uint32_t top = 0;                                                              \
            for (int64_t r = 0; r < rows; r++) {                                           \
                const T *p = x + r * stride;                                               \
                int64_t i = 0;                                                             \
                for (; cols - i >= 8; i += 8) {                                            \
                    v8i b = abs_bits(LOAD(p + i));                                         \
                    m = imax(m, b & (b < 0x7f800000));                                     \
                }                                                                          \
                for (; i < cols; i++) {                                                    \
                    uint32_t b = to_bits(SCALAR(p[i])) & 0x7fffffffu;                      \
                    top = b < 0x7f800000u && b > top ? b : top;                            \
                }                                                                          \
            }                                                                              \
            uint32_t t = hmax(m);                                                          \
            amax = (int32_t)(t > top ? t : top);                                           \
        }                                                                                  \
        v8f scale[2];                                                                      \
        v8d scale64[2];                                                                    \
        for (int f = 0; f < 2; f++) {                                                      \
            float s = FP8[f].max / from_bits((uint32_t)amax);                              \
            s = s > FLT_MAX ? FLT_MAX : s; /* (inf: amax 0 or tiny) */ \
            scale[f] = (v8f){0} + s;                                                       \
            scale64[f] = (v8d){0} + (double)s;                                             \
        }                                                                                  \
        fp8_acc acc[4];                                                                    \
        memset(acc, 0, sizeof acc);                                                        \
        int64_t counts[3] = {0, 0, 0}, since = 0;                                          \
        for (int64_t r = 0; r < rows; r++) {                                               \
            const T *p = x + r * stride;                                                   \
            int64_t i = 0;                                                                 \
            for (; cols - i >= 32; i += 32)                                                \
                for (int j = 0; j < 4; j++) fp8_vector(LOAD(p + i + 8 * j), scale, scale64, &acc[j]); \
            for (; cols - i >= 8; i += 8) fp8_vector(LOAD(p + i), scale, scale64, &acc[0]); \
            if (i < cols) {                                                                \
                float pad[8] = {0};                                                        \
                for (int64_t t = i; t < cols; t++) pad[t - i] = SCALAR(p[t]);              \
                fp8_vector(load_f32(pad), scale, scale64, &acc[0]);                        \
            }                                                                              \
            since += cols / 8 + 1;                                                         \
            if (since >= (1 << 28)) { /* (a lane's int32 counts: below 2^31 while a row is < 2^36) */ \
                for (int j = 0; j < 4; j++) fold_fp8(&acc[j], counts);                     \
                since = 0;                                                                 \
            }                                                                              \
        }                                                                                  \
        for (int j = 0; j < 4; j++) fold_fp8(&acc[j], counts);                             \
        double sq = 0.0, err[2] = {0.0, 0.0};                                              \
        for (int j = 0; j < 4; j++)                                                        \
            for (int l = 0; l < 8; l++) {                                                  \
                sq += acc[j].sq[l];                                                        \
                err[0] += acc[j].err[0][l];                                                \
                err[1] += acc[j].err[1][l];                                                \
            }                                                                              \
        for (int f = 0; f < 2; f++) {                                                      \
            double s64 = scale64[f][0];                                                    \
            out[3 * f] = err[f] / (s64 * s64);                                             \
            out[3 * f + 1] = sq;                                                           \
            out[3 * f + 2] = (double)(counts[0] - counts[1 + f]);                          \
        }                                                                                  \
    }

LS_FP8(ls_fp8_f32, float, load_f32, scalar_f32)
LS_FP8(ls_fp8_bf16, uint16_t, load_bf16, scalar_bf16)
LS_FP8(ls_fp8_f16, uint16_t, load_f16, scalar_f16)

/* ---------------------------------------------------------------------------------------
 * Channel maxima (the channels group; lightning_scale.record.stats.channels.channel_maxima is
 * the reference): out[c] = max(out[c], max over the rows of the finite |x[r, c]|) as float32
 * bits (a non-negative float compares as its bits), for `outer` groups (at `outer_stride`) of
 * `rows` rows (at `stride`) of `cols` channels (heads of a fused projection: two levels); the
 * caller zeroes `out`. NaN and Inf count as 0. Rows of a few hundred channels keep `out` in cache.
 */
#define LS_CHANNELS(NAME, T, LOAD, SCALAR)                                                   \
    LS_CLONES void NAME(const T *x, int64_t outer, int64_t outer_stride, int64_t rows, int64_t cols, int64_t stride, \
                        int32_t *out) {                                                    \
        for (int64_t r = 0; r < outer * rows; r++) {                                       \
            const T *p = x + (r / rows) * outer_stride + (r % rows) * stride;              \
            int64_t i = 0;                                                                 \
            for (; cols - i >= 8; i += 8) {                                                \
                v8i b = abs_bits(LOAD(p + i)), m;                                          \
                memcpy(&m, out + i, sizeof m);                                             \
                m = imax(m, b & (b < 0x7f800000));                                         \
                memcpy(out + i, &m, sizeof m);                                             \
            }                                                                              \
            for (; i < cols; i++) {                                                        \
                int32_t b = (int32_t)(to_bits(SCALAR(p[i])) & 0x7fffffffu);                \
                b = b < 0x7f800000 ? b : 0;                                                \
                out[i] = b > out[i] ? b : out[i];                                          \
            }                                                                              \
        }                                                                                  \
    }

LS_CHANNELS(ls_channels_f32, float, load_f32, scalar_f32)
LS_CHANNELS(ls_channels_bf16, uint16_t, load_bf16, scalar_bf16)
LS_CHANNELS(ls_channels_f16, uint16_t, load_f16, scalar_f16)
