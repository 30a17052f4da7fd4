/* One decoding query's capped attention in one call: the lean path's ops (hf_qknorm/attention/lean.py) fused.

   softmax(mask(c * tanh(scale * q.k / c))) v for every (batch, head) row of a single query, float32, on the CPU.
   Decoding a small model spends its time per op, not per element: the lean path's six ATen calls (matmul, scale,
   tanh, cap, softmax, matmul) cost about six times one call's overhead, where the unpatched model's sdpa costs one.
   This is one call, with the same semantics as lean_attention: the cap before the mask, a row with no allowed key
   gives zeros, float32 sums. The tanh, exp and exp2 are evaluated here so that the loops vectorise: a rational tanh
   (tanh_f), Cephes' float32 exp and exp2 polynomials, each within 2 ulp of the float64 values
   (tests/attention/test_native.py measures them; scripts/check_native_tanh.py checks the tanh on every float32).
   The same file holds the tiled path's capped elementwise passes (tile_forward, tile_backward_p, tile_backward_ds).

   Built at install time as an optional extension (setup.py) by GCC or Clang (the loops use their vector
   extensions; another compiler gets a one-line refusal and no op); where it is not built, or HF_QKNORM_NATIVE=0 is
   set, every path runs its ATen ops instead. On x86-64 Linux with GCC an AVX2/FMA clone is chosen at load time.

   Memory: every entry point takes the tensors themselves (plain torch.Tensor objects, no subclass), reads each one's
   pointer, dtype, shape, strides and storage through the tensor's own methods, and checks them all here before a
   loop runs (the wrappers at the end of this file), so a wrong call from Python is a ValueError, never a read or
   write outside a tensor. */

#if !defined(__GNUC__)
#error "hf_qknorm's native op needs GCC or Clang (vector extensions); the package runs its ATen ops without it"
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* an AVX2/FMA clone beside the default, picked at load time (an ifunc: ELF only), with GCC; Clang (14 tested) has
   the attribute but refuses clones that pass the eight-float vectors between inlined functions, so it builds the
   default only */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HFQ_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HFQ_CLONES
#endif

#define LANES 8
#define MAX_DIM 512
#define BLOCK 256 /* keys per partial sum of the values */
#define FEW_CHUNKS 4 /* up to this many eights of a head dim (32 values), the values' sums run over the keys */

/* eight floats as one value (GCC and Clang vector extensions): one AVX register in the x86-64-v3 clone, two SSE
   registers in the default one */
typedef float vec8 __attribute__((vector_size(LANES * sizeof(float))));

static inline vec8 load8(const float *p) {
    vec8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store8(float *p, vec8 x) { memcpy(p, &x, sizeof x); }

/* the sum of eight lanes, in one fixed order (pairs four apart, then their pairs) */
static inline float lanes_sum(vec8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* two vectors' lanes picked by eight indices (0-7 the first's, 8-15 the second's) */
#if defined(__clang__)
#define PICK8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int ivec8 __attribute__((vector_size(LANES * sizeof(int))));
#define PICK8(a, b, ...) __builtin_shuffle(a, b, (ivec8){__VA_ARGS__})
#endif

/* each of eight vectors' lane sums, as one vector (lane u: the sum of v[u]'s lanes, ((0+1)+(2+3))+((4+5)+(6+7))):
   three rounds of adjacent pairs */
static inline vec8 lanes_sums(const vec8 v[LANES]) {
    vec8 w[4], x[2];
    for (int u = 0; u < 4; u++)
        w[u] = PICK8(v[2 * u], v[2 * u + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               PICK8(v[2 * u], v[2 * u + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int u = 0; u < 2; u++)
        x[u] = PICK8(w[2 * u], w[2 * u + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               PICK8(w[2 * u], w[2 * u + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return PICK8(x[0], x[1], 0, 1, 2, 3, 8, 9, 10, 11) + PICK8(x[0], x[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* 2^n * p for exp: Cephes expf's polynomial on r = x - n ln2, |r| <= ln2 / 2 */
static inline float exp_poly(float x) {
    /* n = round(x / ln2) by adding and subtracting 1.5 * 2^23 (|x / ln2| < 2^22 here): no libm call, so it vectorises
       on any x86-64 */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    n = (n == n) ? n : 0.0f; /* NaN: any exponent, the polynomial carries the NaN */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* exp(x) for x <= 0 (a softmax exponent after its row shift): 0 below -87.3 (and for -inf), NaN for NaN */
static inline float exp_nonpositive(float x) {
    float e = exp_poly(x < -87.3f ? -87.3f : x);
    return x < -87.3f ? 0.0f : e;
}

/* tanh(x), branch-free: a rational function for 2 tanh(a/2) (a = x clamped to +-X), then tanh(a) = 4T / (4 + T^2)
   written as T + T (-T^2 / (4 + T^2)). Coefficients a minimax (Remez) fit of (2 tanh(a/2) / a - 1) / a^2 = S/Q,
   S of degree 2 and Q of degree 3 in a^2, rounded to float32 and tuned in their last bits; X the least float32 whose
   tanh rounds to 1, and |x| >= X gives exactly +-1. Checked over every positive float32 against double tanh: at most
   1.81 ulp with the products and sums fused (FMA: the x86-64-v3 clone), 1.98 without; odd to the bit, x itself
   below 2^-12, never past 1, NaN for NaN. Cheaper than Cephes' tanhf computed branch-free (benchmarks/results/tuning.md). */
static inline float tanh_f(float x) {
    const float X = 9.01091385f;
    float a = x > X ? X : x; /* NaN passes */
    a = a < -X ? -X : a;
    float z = a * a;
    float s = (-2.807676765e-06f * z - 1.252262387e-03f) * z - 8.333333582e-02f;
    float q = ((2.902577535e-06f * z + 1.417362597e-03f) * z + 1.150271520e-01f) * z + 1.0f;
    float t = a * (s * z / q) + a; /* 2 tanh(a / 2) */
    float nq = -(t * t);
    float y = t * (nq / (4.0f - nq)) + t;
    return fabsf(x) >= X ? copysignf(1.0f, x) : y; /* exactly +-1 there, with or without fused products */
}

/* 2^y for -126 <= y <= 128 (inf at 128) and NaN (which it returns): Cephes exp2f's polynomial on r = y - round(y),
   |r| <= 1/2, times 2^round(y) made from its bits. Used bare where the exponent is known to be in range (the tiled
   forward's gain * tanh: |gain| <= 126, forward_f32 checks it), else through exp2_f's clamps. */
static inline float exp2_bounded(float y) {
    float n = (y + 12582912.0f) - 12582912.0f;
    n = (n == n) ? n : 0.0f;
    float r = y - n;
    float p = ((((1.535336188319500E-4f * r + 1.339887440266574E-3f) * r + 9.618437357674640E-3f) * r +
                5.550332471162809E-2f) *
                   r +
               2.402264791363012E-1f) *
                  r +
              6.931472028550421E-1f;
    p = 1.0f + r * p;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* 2^y: 0 below -126 (and for -inf; float32's subnormals, below 1.2e-38, are flushed), inf above 128, NaN for NaN */
static inline float exp2_f(float y) {
    float e = exp2_bounded(y < -126.0f ? -126.0f : (y > 128.0f ? 128.0f : y));
    return y < -126.0f ? 0.0f : e;
}

HFQ_CLONES
static void capped_rows(const float *q, long long q_sb, long long q_sh, const float *k, long long k_sb, long long k_sh,
                        long long k_st, const float *v, long long v_sb, long long v_sh, long long v_st,
                        const unsigned char *mask, long long m_sb, long long m_sh, long long m_sk, float *out,
                        long long o_sb, long long o_sh, long long batch, long long heads, long long kv_heads,
                        long long kv_len, long long dim, float scale, float cap, float *s) {
    const long long groups = heads / kv_heads;
    const float pre = scale / cap;
    vec8 acc[MAX_DIM / LANES], part[MAX_DIM / LANES];
    for (long long b = 0; b < batch; b++) {
        for (long long h = 0; h < heads; h++) {
            const float *qr = q + b * q_sb + h * q_sh;
            const float *kb = k + b * k_sb + (h / groups) * k_sh;
            const float *vb = v + b * v_sb + (h / groups) * v_sh;
            const unsigned char *mr = mask ? mask + b * m_sb + h * m_sh : NULL;
            /* logits, eight keys at a time (eight FMA chains in flight, and their lanes summed together: one
               shuffle tree per eight keys, not one per key -- at a small head dim that tree is most of a logit's
               work);
               the last keys one at a time; capped; masked */
            long long j = 0;
            for (; j + LANES <= kv_len; j += LANES) {
                vec8 dots[LANES];
                for (int u = 0; u < LANES; u++) dots[u] = (vec8){0};
                for (long long c = 0; c < dim; c += LANES) {
                    const vec8 qc = load8(qr + c);
                    for (int u = 0; u < LANES; u++) dots[u] += qc * load8(kb + (j + u) * k_st + c);
                }
                store8(s + j, lanes_sums(dots));
            }
            for (; j < kv_len; j++) {
                const float *kr = kb + j * k_st;
                vec8 lane = {0}, odd = {0}; /* two sums: half the rounding chain, and two FMA chains in flight */
                long long c = 0;
                for (; c + 2 * LANES <= dim; c += 2 * LANES) {
                    lane += load8(qr + c) * load8(kr + c);
                    odd += load8(qr + c + LANES) * load8(kr + c + LANES);
                }
                if (c < dim) lane += load8(qr + c) * load8(kr + c);
                lane += odd;
                s[j] = lanes_sum(lane);
            }
            for (long long j = 0; j < kv_len; j++) s[j] = cap * tanh_f(s[j] * pre);
            if (mr)
                for (long long j = 0; j < kv_len; j++)
                    if (!mr[j * m_sk]) s[j] = -INFINITY;
            /* row maximum (eight partial maxima, so the loop vectorises) */
            float top8[LANES];
            for (int u = 0; u < LANES; u++) top8[u] = -INFINITY;
            long long full = kv_len - kv_len % LANES;
            for (long long j = 0; j < full; j += LANES)
                for (int u = 0; u < LANES; u++) top8[u] = s[j + u] > top8[u] ? s[j + u] : top8[u];
            float top = -INFINITY;
            for (int u = 0; u < LANES; u++) top = top8[u] > top ? top8[u] : top;
            for (long long j = full; j < kv_len; j++) top = s[j] > top ? s[j] : top;
            float *o = out + b * o_sb + h * o_sh;
            if (top == -INFINITY) { /* no allowed key (or every logit NaN: the NaN below is kept) */
                int any_nan = 0;
                for (long long j = 0; j < kv_len; j++) any_nan |= s[j] != s[j];
                for (long long d = 0; d < dim; d++) o[d] = any_nan ? NAN : 0.0f;
                continue;
            }
            /* exponents and their sum */
            float sum8[LANES] = {0};
            for (long long j = 0; j < full; j += LANES)
                for (int u = 0; u < LANES; u++) {
                    float e = exp_nonpositive(s[j + u] - top);
                    s[j + u] = e;
                    sum8[u] += e;
                }
            float sum = lanes_sum(load8(sum8));
            for (long long j = full; j < kv_len; j++) {
                float e = exp_nonpositive(s[j] - top);
                s[j] = e;
                sum += e;
            }
            /* probabilities times values */
            const long long chunks = dim / LANES;
            /* sums of BLOCK keys at a time added into the total: a rounding chain of kv_len / BLOCK + BLOCK terms,
               not kv_len, however long the cache */
            for (long long c = 0; c < chunks; c++) acc[c] = (vec8){0};
            for (long long j0 = 0; j0 < kv_len; j0 += BLOCK) {
                const long long j1 = j0 + BLOCK < kv_len ? j0 + BLOCK : kv_len;
                if (chunks > FEW_CHUNKS) { /* each key's row once, a sum per eight values kept in `part` */
                    for (long long c = 0; c < chunks; c++) part[c] = (vec8){0};
                    for (long long j = j0; j < j1; j++) {
                        const float *vr = vb + j * v_st;
                        const vec8 p = (vec8){0} + s[j];
                        for (long long c = 0; c < chunks; c++) part[c] += p * load8(vr + c * LANES);
                    }
                    for (long long c = 0; c < chunks; c++) acc[c] += part[c];
                    continue;
                }
                /* a small head dim: the sums above are a few, each waiting on its last add through memory at every
                   key; here each eight values' sum runs as four chains over the keys, in registers */
                for (long long c = 0; c < chunks; c++) {
                    const float *vc = vb + c * LANES;
                    vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    long long j = j0;
                    for (; j + 4 <= j1; j += 4) {
                        a0 += ((vec8){0} + s[j]) * load8(vc + j * v_st);
                        a1 += ((vec8){0} + s[j + 1]) * load8(vc + (j + 1) * v_st);
                        a2 += ((vec8){0} + s[j + 2]) * load8(vc + (j + 2) * v_st);
                        a3 += ((vec8){0} + s[j + 3]) * load8(vc + (j + 3) * v_st);
                    }
                    for (; j < j1; j++) a0 += ((vec8){0} + s[j]) * load8(vc + j * v_st);
                    acc[c] += (a0 + a1) + (a2 + a3);
                }
            }
            const vec8 inv = (vec8){0} + 1.0f / sum;
            for (long long c = 0; c < chunks; c++) store8(o + c * LANES, acc[c] * inv);
        }
    }
}

/* The tiled path's capped elementwise passes (hf_qknorm/attention/chunked.py), float32. A tile is `n` blocks of
   `rows` rows of `cols` logits, contiguous; a per-row vector of a tile (log-sum-exp, delta) is `n` blocks of `rows`
   values, `stride` apart. */

/* The passes below go over a row CHUNK logits at a time, each step a loop of its own over the chunk: one loop doing
   everything per element vectorises worse (figures: benchmarks/results/tuning.md). */
#define CHUNK 256

/* The pairs of a tile a causal or windowed row may see are a band of its columns, the same for every block: row i
   of a block (query qi = i / groups) allows columns [lo0 + lo_step * qi, hi0 + hi_step * qi), clamped to the row.
   The passes write p = 0 (and the slope 0) outside it, so no masking pass over the tile follows; (0, 0, cols, 0)
   allows every column. */
typedef struct {
    long long lo0, lo_step, hi0, hi_step, groups;
} band;

static inline void band_row(const band *w, long long i, long long cols, long long *a, long long *b) {
    const long long qi = i / w->groups;
    long long lo = w->lo0 + w->lo_step * qi, hi = w->hi0 + w->hi_step * qi;
    lo = lo < 0 ? 0 : (lo > cols ? cols : lo);
    hi = hi < lo ? lo : (hi > cols ? cols : hi);
    *a = lo;
    *b = hi;
}

/* zero x[j] for the j of [j0, j0 + m) outside [a, b) (a select, so the loop vectorises) */
static inline void outside_band(float *x, long long j0, long long m, long long a, long long b) {
    if (j0 >= a && j0 + m <= b) return;
    for (long long j = 0; j < m; j++) x[j] = (j0 + j >= a && j0 + j < b) ? x[j] : 0.0f;
}

/* forward: x holds 2s/c (the matmul's output); p = 2^(gain * tanh(x / 2)) written over it, t = tanh(x / 2) into
   `kept` where given, each row's sum of p into `sums` (eight lanes over the row, then its last cols % 8); p and t
   are 0 outside the row's band, and chunks wholly outside it are not computed */
HFQ_CLONES
static void tile_forward(float *x, long long blocks, long long rows, long long cols, float gain, float *kept,
                         float *sums, band w) {
    float scratch[CHUNK];
    const long long full = cols - cols % LANES;
    for (long long r = 0; r < blocks * rows; r++) {
        float *xr = x + r * cols;
        long long a, b;
        band_row(&w, r % rows, cols, &a, &b);
        vec8 acc = {0};
        for (long long j0 = 0; j0 < cols; j0 += CHUNK) {
            const long long m = cols - j0 < CHUNK ? cols - j0 : CHUNK;
            float *e = xr + j0;
            float *t = kept ? kept + r * cols + j0 : scratch;
            if (j0 + m <= a || j0 >= b) {
                memset(e, 0, (size_t)m * sizeof(float));
                if (kept) memset(t, 0, (size_t)m * sizeof(float));
                continue;
            }
            for (long long j = 0; j < m; j++) t[j] = tanh_f(0.5f * e[j]);
            for (long long j = 0; j < m; j++) e[j] = exp2_bounded(gain * t[j]);
            outside_band(e, j0, m, a, b);
            for (long long j = 0; j + LANES <= m; j += LANES) acc += load8(e + j);
        }
        float sum = lanes_sum(acc);
        for (long long j = full; j < cols; j++) sum += xr[j];
        sums[r] = sum;
    }
}

/* backward, before the products: t = tanh(src / 2) (src holds 2s/c) or t = src (forward's kept tanh);
   p = 2^(gain * t - lse) and the cap's slope 1 - t^2, both 0 outside the row's band; `p` may be `src` (a chunk's t
   is read before its p is written). */
HFQ_CLONES
static void tile_backward_p(const float *src, int recompute, long long blocks, long long rows, long long cols,
                            const float *neg_lse, long long lse_stride, float gain, float *p, float *slope, band w) {
    float scratch[CHUNK];
    for (long long b = 0; b < blocks; b++)
        for (long long i = 0; i < rows; i++) {
            const long long r = b * rows + i;
            const float shift = neg_lse[b * lse_stride + i];
            long long lo, hi;
            band_row(&w, i, cols, &lo, &hi);
            for (long long j0 = 0; j0 < cols; j0 += CHUNK) {
                const long long m = cols - j0 < CHUNK ? cols - j0 : CHUNK;
                const float *sr = src + r * cols + j0, *t = recompute ? scratch : sr;
                float *pr = p + r * cols + j0, *dr = slope + r * cols + j0;
                if (j0 + m <= lo || j0 >= hi) {
                    memset(pr, 0, (size_t)m * sizeof(float));
                    memset(dr, 0, (size_t)m * sizeof(float));
                    continue;
                }
                if (recompute)
                    for (long long j = 0; j < m; j++) scratch[j] = tanh_f(0.5f * sr[j]);
                for (long long j = 0; j < m; j++) dr[j] = 1.0f - t[j] * t[j];
                for (long long j = 0; j < m; j++) pr[j] = exp2_f(gain * t[j] + shift);
                outside_band(pr, j0, m, lo, hi);
                outside_band(dr, j0, m, lo, hi);
            }
        }
}

/* backward, after dP = dO V^T: dS = (dP - delta) * p * slope, written over dP */
HFQ_CLONES
static void tile_backward_ds(float *dp, const float *p, const float *slope, long long blocks, long long rows,
                             long long cols, const float *delta, long long delta_stride) {
    for (long long b = 0; b < blocks; b++)
        for (long long i = 0; i < rows; i++) {
            const long long r = b * rows + i;
            const float d = delta[b * delta_stride + i];
            float *dr = dp + r * cols;
            const float *pr = p + r * cols, *sr = slope + r * cols;
            for (long long j = 0; j < cols; j++) dr[j] = (dr[j] - d) * pr[j] * sr[j];
        }
}

/* The wrappers below take each tensor as the torch.Tensor itself and read, on every call, its data pointer, dtype,
   shape and strides (in elements), storage offset (in elements) and its storage's size in bytes through the tensor's
   methods (tensor_args; nothing is cached: a storage can be resized or swapped between calls). Then they check them
   before any loop runs: the dtype, the rank, every size against the others, the strides the loops assume, and that
   every index a loop will touch lies inside the storage. A check that fails raises one ValueError naming the
   argument; the caller's Python (native.py) holds no safety of its own. Reading the metadata here rather than in
   Python is also what keeps a small call cheap: no Python frame or tuples per tensor. */

#define CODE_FLOAT32 1
#define CODE_BOOL 2
#define MAX_RANK 4
#define MAX_EXTENT (1LL << 60) /* more elements than any storage: past it, the products below could overflow */

typedef struct {
    const char *name;
    uintptr_t ptr;
    long long code, rank, strides, offset, nbytes; /* strides: how many strides were given */
    long long extent; /* elements the storage holds from the pointer on: nbytes / element size - offset */
    long long size[MAX_RANK], stride[MAX_RANK];
} tensor_arg;

enum { BAD_NONE, BAD_DTYPE, BAD_RANK, BAD_SHAPE, BAD_STRIDE, BAD_BOUNDS, BAD_SIZES };

static const char *const problems[] = {
    "",
    "has the wrong dtype",
    "has the wrong number of dimensions",
    "has a shape that does not match the other arguments",
    "has strides the op does not take (its last dimension must be contiguous, a tile contiguous throughout)",
    "reaches past the end of its storage",
    "has sizes the op does not take (a head dim a multiple of 8 up to 512, key heads dividing the heads, keys)",
};

/* "[a, b, c]" of up to MAX_RANK integers, into `text` */
static void list_text(char *text, size_t room, const long long *values, long long count) {
    size_t used = (size_t)PyOS_snprintf(text, room, "[");
    for (long long d = 0; d < count && d < MAX_RANK && used < room; d++)
        used += (size_t)PyOS_snprintf(text + used, room - used, d ? ", %lld" : "%lld", values[d]);
    if (used < room) PyOS_snprintf(text + used, room - used, "%s]", count > MAX_RANK ? ", ..." : "");
}

/* the error of check `bad` on argument `t` (or of the whole call where t is NULL), as one ValueError */
static void *refuse(const char *op, const tensor_arg *t, int bad) {
    if (t) {
        char sizes[128], strides[128];
        list_text(sizes, sizeof sizes, t->size, t->rank);
        list_text(strides, sizeof strides, t->stride, t->strides);
        PyErr_Format(PyExc_ValueError,
                     "hf_qknorm native %s: %s %s (shape %s, strides %s, dtype code %lld, storage offset %lld, storage %lld bytes)",
                     op, t->name, problems[bad], sizes, strides, t->code, t->offset, t->nbytes);
    } else {
        PyErr_Format(PyExc_ValueError, "hf_qknorm native %s: %s", op, problems[bad]);
    }
    return NULL;
}

static int tuple_ints(PyObject *tuple, long long *out, long long *count) {
    if (!PyTuple_Check(tuple)) {
        PyErr_SetString(PyExc_TypeError, "shape and strides must be tuples of integers");
        return -1;
    }
    *count = PyTuple_GET_SIZE(tuple);
    for (Py_ssize_t a = 0; a < *count && a < MAX_RANK; a++) {
        out[a] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, a));
        if (out[a] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* torch.Tensor, torch.float32 and torch.bool (PyInit__native), and the names of the methods tensor_args calls */
static PyObject *tensor_type, *dtype_float32, *dtype_bool;
static PyObject *name_data_ptr, *name_dtype, *name_shape, *name_stride, *name_storage_offset, *name_untyped_storage,
    *name_nbytes;

/* `name()` of `obj`, a new reference or NULL with a Python error (a vectorcall: no bound method made; the slot
   before `obj` is the one PY_VECTORCALL_ARGUMENTS_OFFSET lets the callee use) */
static PyObject *call0(PyObject *obj, PyObject *name) {
    PyObject *args[2] = {NULL, obj};
    return PyObject_VectorcallMethod(name, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* a long long from a new reference, which it releases; -1 with a Python error on failure */
static int take_ll(PyObject *value, long long *out) {
    if (!value) return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* a tuple of integers from a new reference, which it releases */
static int take_ints(PyObject *value, long long *out, long long *count) {
    if (!value) return -1;
    int rc = tuple_ints(value, out, count);
    Py_DECREF(value);
    return rc;
}

/* One tensor argument, read afresh: its pointer, dtype code (CODE_FLOAT32, CODE_BOOL, else 0), shape, strides,
   storage offset and storage bytes, the extent derived from them (a negative offset or size leaves it negative,
   which check_tensor refuses). Only a plain torch.Tensor is taken: a subclass (a DTensor, a fake tensor) may not
   hold its values at its data pointer, and its methods could say anything. -1 with a Python error otherwise. */
static int tensor_args(PyObject *obj, const char *name, tensor_arg *t) {
    memset(t, 0, sizeof *t);
    t->name = name;
    if (!tensor_type || Py_TYPE(obj) != (PyTypeObject *)tensor_type) {
        PyErr_Format(PyExc_TypeError, "hf_qknorm native: %s must be a torch.Tensor (not a subclass), got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *value = call0(obj, name_data_ptr);
    if (!value) return -1;
    t->ptr = (uintptr_t)PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    if (t->ptr == (uintptr_t)-1 && PyErr_Occurred()) return -1;
    if (!(value = PyObject_GetAttr(obj, name_dtype))) return -1;
    t->code = value == dtype_float32 ? CODE_FLOAT32 : value == dtype_bool ? CODE_BOOL : 0;
    Py_DECREF(value);
    if (take_ints(PyObject_GetAttr(obj, name_shape), t->size, &t->rank) < 0 ||
        take_ints(call0(obj, name_stride), t->stride, &t->strides) < 0 ||
        take_ll(call0(obj, name_storage_offset), &t->offset) < 0)
        return -1;
    PyObject *storage = call0(obj, name_untyped_storage);
    if (!storage || take_ll(call0(storage, name_nbytes), &t->nbytes) < 0) {
        Py_XDECREF(storage);
        return -1;
    }
    Py_DECREF(storage);
    const long long item = t->code == CODE_FLOAT32 ? (long long)sizeof(float) : 1;
    t->extent = (t->offset < 0 || t->nbytes < 0) ? -1 : t->nbytes / item - t->offset;
    return 0;
}

/* dtype, rank, and every index the shape and strides reach inside [0, extent): the largest is the sum of
   (size - 1) * stride; an empty tensor reaches none */
static int check_tensor(const tensor_arg *t, long long code, long long rank) {
    if (t->code != code) return BAD_DTYPE;
    if (t->rank != rank || t->strides != rank) return BAD_RANK;
    if (t->extent < 0 || t->extent > MAX_EXTENT) return BAD_BOUNDS;
    long long last = 0;
    for (long long d = 0; d < rank; d++) {
        if (t->size[d] < 0 || t->stride[d] < 0) return BAD_BOUNDS;
        if (t->size[d] == 0) return BAD_NONE;
    }
    for (long long d = 0; d < rank; d++) {
        if (t->size[d] > 1 && t->stride[d] > (MAX_EXTENT - last) / (t->size[d] - 1)) return BAD_BOUNDS;
        last += (t->size[d] - 1) * t->stride[d];
    }
    if (last >= t->extent || t->ptr == 0) return BAD_BOUNDS;
    return BAD_NONE;
}

/* a tile (blocks, rows, cols) or a per-row vector (blocks, rows, 1): float32, the shape given, rows `row_stride`
   apart in a block (1: the last dims contiguous) */
static int check_tile(const tensor_arg *t, long long blocks, long long rows, long long cols, int contiguous) {
    int bad = check_tensor(t, CODE_FLOAT32, 3);
    if (bad) return bad;
    if (t->size[0] != blocks || t->size[1] != rows || t->size[2] != cols) return BAD_SHAPE;
    if ((cols > 1 && t->stride[2] != 1) || (rows > 1 && t->stride[1] != cols)) return BAD_STRIDE;
    if (contiguous && blocks > 1 && t->stride[0] != rows * cols) return BAD_STRIDE;
    return BAD_NONE;
}

/* The optional band of a pass (band_row): five integers after its other arguments, or none (every column allowed). */
static int band_args(PyObject *const *args, Py_ssize_t count, long long cols, band *out) {
    *out = (band){0, 0, cols, 0, 1};
    if (count == 0) return 0;
    long long v[5];
    for (int a = 0; a < 5; a++) {
        v[a] = PyLong_AsLongLong(args[a]);
        if (v[a] == -1 && PyErr_Occurred()) return -1;
    }
    if (v[4] <= 0) {
        PyErr_Format(PyExc_ValueError, "band groups must be positive, got %lld", v[4]);
        return -1;
    }
    *out = (band){v[0], v[1], v[2], v[3], v[4]};
    return 0;
}

/* A float for an error message: PyErr_Format takes no %g (Python 3.12 raises SystemError on it), so it goes in as
   text. */
typedef struct {
    char text[32];
} number_text;

static number_text as_text(double value) {
    number_text out;
    PyOS_snprintf(out.text, sizeof out.text, "%g", value);
    return out;
}

static int get_float(PyObject *arg, double *out) {
    *out = PyFloat_AsDouble(arg);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

#define TENSOR(slot, name, var)                                                                                       \
    if (tensor_args(args[slot], name, &var) < 0) return NULL
#define CHECKED(call, var)                                                                                            \
    do {                                                                                                               \
        int bad_ = (call);                                                                                             \
        if (bad_) return refuse(op, &var, bad_);                                                                       \
    } while (0)

/* forward_f32(x, kept or None, sums, gain[, lo0, lo_step, hi0, hi_step, groups]), the tensors as they are
   (tensor_args), None for no kept: x (blocks, rows, cols) contiguous, written over; kept the
   same; sums (blocks, rows, 1) */
static PyObject *forward_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    const char *op = "forward_f32";
    tensor_arg x, kept, sums;
    band w;
    double gain;
    if (nargs != 4 && nargs != 9)
        return PyErr_Format(PyExc_TypeError, "forward_f32 takes 4 or 9 arguments, got %zd", nargs);
    TENSOR(0, "x", x);
    const int has_kept = args[1] != Py_None;
    if (has_kept) TENSOR(1, "kept", kept);
    TENSOR(2, "sums", sums);
    if (get_float(args[3], &gain) < 0) return NULL;
    const long long blocks = x.size[0], rows = x.size[1], cols = x.size[2];
    CHECKED(check_tile(&x, blocks, rows, cols, 1), x);
    if (has_kept) CHECKED(check_tile(&kept, blocks, rows, cols, 1), kept);
    CHECKED(check_tile(&sums, blocks, rows, 1, 1), sums);
    if (!(fabs(gain) <= 126.0)) {
        PyErr_Format(PyExc_ValueError, "forward_f32: gain must be within [-126, 126] (no row shift), got %s",
                     as_text(gain).text);
        return NULL;
    }
    if (band_args(args + 4, nargs - 4, cols, &w) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS tile_forward((float *)x.ptr, blocks, rows, cols, (float)gain,
                                        has_kept ? (float *)kept.ptr : NULL, (float *)sums.ptr, w);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* backward_p_f32(src, recompute, neg_lse, p, slope, gain[, band as forward_f32]): src, p, slope (blocks, rows, cols)
   contiguous (p may be src); neg_lse (blocks, rows, 1), its rows contiguous, its blocks any stride apart */
static PyObject *backward_p_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    const char *op = "backward_p_f32";
    tensor_arg src, lse, p, slope;
    band w;
    double gain;
    if (nargs != 6 && nargs != 11)
        return PyErr_Format(PyExc_TypeError, "backward_p_f32 takes 6 or 11 arguments, got %zd", nargs);
    TENSOR(0, "src", src);
    const int recompute = PyObject_IsTrue(args[1]);
    if (recompute < 0) return NULL;
    if (tensor_args(args[2], "neg_lse", &lse) < 0 || tensor_args(args[3], "p", &p) < 0 ||
        tensor_args(args[4], "slope", &slope) < 0 || get_float(args[5], &gain) < 0)
        return NULL;
    const long long blocks = src.size[0], rows = src.size[1], cols = src.size[2];
    CHECKED(check_tile(&src, blocks, rows, cols, 1), src);
    CHECKED(check_tile(&lse, blocks, rows, 1, 0), lse);
    CHECKED(check_tile(&p, blocks, rows, cols, 1), p);
    CHECKED(check_tile(&slope, blocks, rows, cols, 1), slope);
    if (band_args(args + 6, nargs - 6, cols, &w) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS tile_backward_p((const float *)src.ptr, recompute, blocks, rows, cols,
                                           (const float *)lse.ptr, lse.stride[0], (float)gain, (float *)p.ptr,
                                           (float *)slope.ptr, w);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* backward_ds_f32(dp, p, slope, delta): dp, p, slope (blocks, rows, cols) contiguous, dp written over; delta as
   backward_p_f32's neg_lse */
static PyObject *backward_ds_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    const char *op = "backward_ds_f32";
    tensor_arg dp, p, slope, delta;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "backward_ds_f32 takes 4 arguments, got %zd", nargs);
    TENSOR(0, "dp", dp);
    TENSOR(1, "p", p);
    TENSOR(2, "slope", slope);
    TENSOR(3, "delta", delta);
    const long long blocks = dp.size[0], rows = dp.size[1], cols = dp.size[2];
    CHECKED(check_tile(&dp, blocks, rows, cols, 1), dp);
    CHECKED(check_tile(&p, blocks, rows, cols, 1), p);
    CHECKED(check_tile(&slope, blocks, rows, cols, 1), slope);
    CHECKED(check_tile(&delta, blocks, rows, 1, 0), delta);
    Py_BEGIN_ALLOW_THREADS tile_backward_ds((float *)dp.ptr, (const float *)p.ptr, (const float *)slope.ptr, blocks,
                                            rows, cols, (const float *)delta.ptr, delta.stride[0]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* the decoding op's arguments against each other: q (batch, heads, 1, dim); k and v (batch, kv_heads, kv_len, dim);
   out (batch, 1, heads, dim); the mask, where given, bool (batch | 1, heads | 1, 1, kv_len); every last dimension
   contiguous */
static PyObject *check_capped(const tensor_arg *q, const tensor_arg *k, const tensor_arg *v, const tensor_arg *m,
                              const tensor_arg *out) {
    const char *op = "capped_f32";
    const tensor_arg *floats[4] = {q, k, v, out};
    for (int a = 0; a < 4; a++) CHECKED(check_tensor(floats[a], CODE_FLOAT32, 4), *floats[a]);
    if (m) CHECKED(check_tensor(m, CODE_BOOL, 4), *m);
    const long long batch = q->size[0], heads = q->size[1], dim = q->size[3];
    const long long kv_heads = k->size[1], kv_len = k->size[2];
    if (q->size[2] != 1) return refuse(op, q, BAD_SHAPE);
    if (k->size[0] != batch || k->size[3] != dim) return refuse(op, k, BAD_SHAPE);
    for (int d = 0; d < 4; d++)
        if (v->size[d] != k->size[d]) return refuse(op, v, BAD_SHAPE);
    if (out->size[0] != batch || out->size[1] != 1 || out->size[2] != heads || out->size[3] != dim)
        return refuse(op, out, BAD_SHAPE);
    if (m && ((m->size[0] != 1 && m->size[0] != batch) || (m->size[1] != 1 && m->size[1] != heads) ||
              m->size[2] != 1 || m->size[3] != kv_len))
        return refuse(op, m, BAD_SHAPE);
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || kv_len <= 0 || dim <= 0 || dim % LANES || dim > MAX_DIM)
        return refuse(op, NULL, BAD_SIZES);
    for (int a = 0; a < 4; a++)
        if (floats[a]->stride[3] != 1) return refuse(op, floats[a], BAD_STRIDE);
    return Py_None; /* borrowed: checked */
}

/* capped_f32(q, k, v, mask, out, scale, cap): tensors (tensor_args), None for no mask; out written, nothing else. */
static PyObject *capped_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    tensor_arg q, k, v, m, out;
    double scale, cap;
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "capped_f32 takes 7 arguments, got %zd", nargs);
    TENSOR(0, "query", q);
    TENSOR(1, "key", k);
    TENSOR(2, "value", v);
    const int has_mask = args[3] != Py_None;
    if (has_mask) TENSOR(3, "mask", m);
    TENSOR(4, "out", out);
    if (get_float(args[5], &scale) < 0 || get_float(args[6], &cap) < 0) return NULL;
    if (!check_capped(&q, &k, &v, has_mask ? &m : NULL, &out)) return NULL;
    if (!(cap > 0.0)) {
        PyErr_Format(PyExc_ValueError, "hf_qknorm native capped_f32: cap must be positive, got %s", as_text(cap).text);
        return NULL;
    }
    const long long kv_len = k.size[2];
    float *s = (float *)malloc((size_t)kv_len * sizeof(float));
    if (!s) return PyErr_NoMemory();
    /* a dimension of size 1 is read at index 0 only, whatever its stride */
#define STRIDE(t, d) ((t).size[d] > 1 ? (t).stride[d] : 0)
    Py_BEGIN_ALLOW_THREADS capped_rows(
        (const float *)q.ptr, STRIDE(q, 0), STRIDE(q, 1), (const float *)k.ptr, STRIDE(k, 0), STRIDE(k, 1),
        STRIDE(k, 2), (const float *)v.ptr, STRIDE(v, 0), STRIDE(v, 1), STRIDE(v, 2),
        has_mask ? (const unsigned char *)m.ptr : NULL, has_mask ? STRIDE(m, 0) : 0, has_mask ? STRIDE(m, 1) : 0,
        has_mask ? STRIDE(m, 3) : 0, (float *)out.ptr, STRIDE(out, 0), STRIDE(out, 2), q.size[0], q.size[1],
        k.size[1], kv_len, q.size[3], (float)scale, (float)cap, s);
    Py_END_ALLOW_THREADS free(s);
#undef STRIDE
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"capped_f32", (PyCFunction)(void (*)(void))capped_f32, METH_FASTCALL,
     "One decoding query's capped attention, float32 (hf_qknorm.attention.native.capped_decode)."},
    {"forward_f32", (PyCFunction)(void (*)(void))forward_f32, METH_FASTCALL,
     "A capped tile's exponents, kept tanh and row sums (hf_qknorm.attention.chunked)."},
    {"backward_p_f32", (PyCFunction)(void (*)(void))backward_p_f32, METH_FASTCALL,
     "A capped tile's probabilities and the cap's slope in backward (hf_qknorm.attention.chunked)."},
    {"backward_ds_f32", (PyCFunction)(void (*)(void))backward_ds_f32, METH_FASTCALL,
     "A capped tile's logit gradients (hf_qknorm.attention.chunked)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

/* torch's Tensor type and dtypes, and the method names, once: every tensor argument is checked against them */
static int init_torch(void) {
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch) return -1;
    tensor_type = PyObject_GetAttrString(torch, "Tensor");
    dtype_float32 = PyObject_GetAttrString(torch, "float32");
    dtype_bool = PyObject_GetAttrString(torch, "bool");
    Py_DECREF(torch);
    if (!tensor_type || !dtype_float32 || !dtype_bool || !PyType_Check(tensor_type)) return -1;
    const char *names[] = {"data_ptr", "dtype", "shape", "stride", "storage_offset", "untyped_storage", "nbytes"};
    PyObject **slots[] = {&name_data_ptr,       &name_dtype,           &name_shape, &name_stride,
                          &name_storage_offset, &name_untyped_storage, &name_nbytes};
    for (int a = 0; a < 7; a++)
        if (!(*slots[a] = PyUnicode_InternFromString(names[a]))) return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (init_torch() < 0) return NULL;
    return PyModule_Create(&module);
}
