/* One decoding query's capped attention in one call: the lean path's ops (hf_qknorm/attention/lean.py) fused.

   softmax(mask(c * tanh(scale * q.k / c))) v for every (batch, head) row of a single query, float32, on the CPU.
   Decoding a small model spends its time per op, not per element: the lean path's six ATen calls (matmul, scale,
   tanh, cap, softmax, matmul) cost about six times one call's overhead, where the unpatched model's sdpa costs one.
   This is one call, with the same semantics as lean_attention: the cap before the mask, a row with no allowed key
   gives zeros, float32 sums. The tanh, exp and exp2 are evaluated here so that the loops vectorise: a rational tanh
   (tanh_f), Cephes' float32 exp and exp2 polynomials, each within 2 ulp of the float64 values
   (tests/attention/test_native.py measures them; scripts/check_native_tanh.py checks the tanh on every float32).
   The same file holds the tiled path's capped elementwise passes (tile_forward, tile_backward_p, tile_backward_ds).

   Built at install time as an optional extension (setup.py); where it cannot be built, or HF_QKNORM_NATIVE=0 is set,
   lean.py runs its ATen ops instead. On x86-64 Linux with GCC an AVX2/FMA clone is chosen at load time.

   Memory: the caller passes data pointers and strides of live CPU tensors (lean.py and chunked.py check dtype,
   device, layout); the decoding op reads q, k, v and the mask within the given shapes and writes only `out` (batch,
   heads, dim), the passes read and write only the tiles they are given. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
   below 2^-12, never past 1, NaN for NaN. About half the time of Cephes' tanhf computed branch-free. */
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
                        long long batch, long long heads, long long kv_heads, long long kv_len, long long dim,
                        float scale, float cap, float *s) {
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
               shuffle tree per eight keys, not one per key -- at head_dim 16 that tree was most of a logit's work);
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
            float *o = out + (b * heads + h) * dim;
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
   everything per element vectorised worse (3.3 ns per element against 2.0 split, AVX2). */
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

/* Arguments of the wrappers below: Python integers (pointers, sizes, strides in elements) and floats, in the order
   of the C function's parameters. */
static int ints(PyObject *const *args, Py_ssize_t count, long long *out) {
    for (Py_ssize_t a = 0; a < count; a++) {
        out[a] = PyLong_AsLongLong(args[a]);
        if (out[a] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int sizes_ok(long long blocks, long long rows, long long cols) {
    if (blocks < 0 || rows < 0 || cols < 0) {
        PyErr_Format(PyExc_ValueError, "tile sizes must not be negative: %lld, %lld, %lld", blocks, rows, cols);
        return 0;
    }
    return 1;
}

#define PTR(type, value) ((type *)(uintptr_t)(value))

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

/* The optional band of a pass (band_row): five integers after its other arguments, or none (every column allowed). */
static int band_args(PyObject *const *args, Py_ssize_t count, long long cols, band *out) {
    *out = (band){0, 0, cols, 0, 1};
    if (count == 0) return 0;
    long long v[5];
    if (ints(args, 5, v) < 0) return -1;
    if (v[4] <= 0) {
        PyErr_Format(PyExc_ValueError, "band groups must be positive, got %lld", v[4]);
        return -1;
    }
    *out = (band){v[0], v[1], v[2], v[3], v[4]};
    return 0;
}

/* forward_f32(x, blocks, rows, cols, kept or 0, sums, gain[, lo0, lo_step, hi0, hi_step, groups]) */
static PyObject *forward_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long i[6];
    band w;
    if (nargs != 7 && nargs != 12)
        return PyErr_Format(PyExc_TypeError, "forward_f32 takes 7 or 12 arguments, got %zd", nargs);
    if (ints(args, 6, i) < 0) return NULL;
    double gain = PyFloat_AsDouble(args[6]);
    if (gain == -1.0 && PyErr_Occurred()) return NULL;
    if (!sizes_ok(i[1], i[2], i[3])) return NULL;
    if (!(fabs(gain) <= 126.0)) {
        PyErr_Format(PyExc_ValueError, "forward_f32: gain must be within [-126, 126] (no row shift), got %s",
                     as_text(gain).text);
        return NULL;
    }
    if (band_args(args + 7, nargs - 7, i[3], &w) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS tile_forward(PTR(float, i[0]), i[1], i[2], i[3], (float)gain, PTR(float, i[4]),
                                        PTR(float, i[5]), w);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* backward_p_f32(src, recompute, blocks, rows, cols, neg_lse, lse_stride, p, slope, gain[, band as forward_f32]) */
static PyObject *backward_p_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long i[9];
    band w;
    if (nargs != 10 && nargs != 15)
        return PyErr_Format(PyExc_TypeError, "backward_p_f32 takes 10 or 15 arguments, got %zd", nargs);
    if (ints(args, 9, i) < 0) return NULL;
    double gain = PyFloat_AsDouble(args[9]);
    if (gain == -1.0 && PyErr_Occurred()) return NULL;
    if (!sizes_ok(i[2], i[3], i[4])) return NULL;
    if (band_args(args + 10, nargs - 10, i[4], &w) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS tile_backward_p(PTR(const float, i[0]), (int)i[1], i[2], i[3], i[4],
                                           PTR(const float, i[5]), i[6], (float)gain, PTR(float, i[7]),
                                           PTR(float, i[8]), w);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* backward_ds_f32(dp, p, slope, blocks, rows, cols, delta, delta_stride) */
static PyObject *backward_ds_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long i[8];
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "backward_ds_f32 takes 8 arguments, got %zd", nargs);
    if (ints(args, 8, i) < 0) return NULL;
    if (!sizes_ok(i[3], i[4], i[5])) return NULL;
    Py_BEGIN_ALLOW_THREADS tile_backward_ds(PTR(float, i[0]), PTR(const float, i[1]), PTR(const float, i[2]), i[3],
                                            i[4], i[5], PTR(const float, i[6]), i[7]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* capped_f32(q, q_sb, q_sh, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st, mask, m_sb, m_sh, m_sk, out,
              batch, heads, kv_heads, kv_len, dim, scale, cap): pointers and strides (in elements) as integers,
              mask 0 for none; out is (batch, heads, dim) contiguous. */
static PyObject *capped_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 23) {
        PyErr_Format(PyExc_TypeError, "capped_f32 takes 23 arguments, got %zd", nargs);
        return NULL;
    }
    long long i[21];
    int slot = 0;
    for (Py_ssize_t a = 0; a < 21; a++) {
        i[slot] = PyLong_AsLongLong(args[a]);
        if (i[slot] == -1 && PyErr_Occurred()) return NULL;
        slot++;
    }
    double scale = PyFloat_AsDouble(args[21]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    double cap = PyFloat_AsDouble(args[22]);
    if (cap == -1.0 && PyErr_Occurred()) return NULL;
    long long batch = i[16], heads = i[17], kv_heads = i[18], kv_len = i[19], dim = i[20];
    if (batch < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || kv_len <= 0 || dim <= 0 || dim % LANES ||
        dim > MAX_DIM || !(cap > 0.0)) {
        PyErr_Format(PyExc_ValueError,
                     "capped_f32: unsupported sizes (batch %lld, heads %lld, kv_heads %lld, kv_len %lld, dim %lld, "
                     "cap %s)",
                     batch, heads, kv_heads, kv_len, dim, as_text(cap).text);
        return NULL;
    }
    float *s = (float *)malloc((size_t)kv_len * sizeof(float));
    if (!s) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS capped_rows((const float *)(uintptr_t)i[0], i[1], i[2], (const float *)(uintptr_t)i[3],
                                       i[4], i[5], i[6], (const float *)(uintptr_t)i[7], i[8], i[9], i[10],
                                       (const unsigned char *)(uintptr_t)i[11], i[12], i[13], i[14],
                                       (float *)(uintptr_t)i[15], batch, heads, kv_heads, kv_len, dim, (float)scale,
                                       (float)cap, s);
    Py_END_ALLOW_THREADS free(s);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"capped_f32", (PyCFunction)(void (*)(void))capped_f32, METH_FASTCALL,
     "One decoding query's capped attention, float32 (hf_qknorm.attention.lean)."},
    {"forward_f32", (PyCFunction)(void (*)(void))forward_f32, METH_FASTCALL,
     "A capped tile's exponents, kept tanh and row sums (hf_qknorm.attention.chunked)."},
    {"backward_p_f32", (PyCFunction)(void (*)(void))backward_p_f32, METH_FASTCALL,
     "A capped tile's probabilities and the cap's slope in backward (hf_qknorm.attention.chunked)."},
    {"backward_ds_f32", (PyCFunction)(void (*)(void))backward_ds_f32, METH_FASTCALL,
     "A capped tile's logit gradients (hf_qknorm.attention.chunked)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
