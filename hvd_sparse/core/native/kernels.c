/* hvd_sparse fused CPU kernels: select, count, add, add-and-select, merge-add, intersect (see __init__.py for
 * the design and kernels.py for the Python API).
 *
 * hvds_add_f32: out = r + g (or out = g when r == NULL) over float32 buffers, in one pass, counting the
 * non-finite results on the way: error feedback's acc = residual + grad and the non-finite check of the
 * step fused (IEEE-754 float additions, so the sums equal numpy's and torch's bit for bit).
 *
 * hvds_add_select_f32: the same pass, which also selects from out what hvds_select_f32 would select (an
 * on-the-fly selection of the sum: on Ok-Topk's reuse steps the threshold is known before the step).
 *
 * hvds_select_f32: one read pass over a float32 buffer x[0..n) that writes, in ascending order, the
 * indices i (plus `base`) with  lo <= (bits(x[i]) & 0x7fffffff) <= hi,  i.e. lo <= bits(|x[i]|) <= hi.
 * For non-negative floats the IEEE-754 bit patterns order like the values, so every threshold rule of the
 * library (|x| >= t, |x| > t, |x| >= t and x != 0) is one such integer range, computed by the caller;
 * hi <= 0x7f800000 (+inf) keeps NaN (bits above +inf) out of every selection; hi = 0x7fffffff takes every NaN
 * too (hvds_select_f32 only).
 *
 * Threads: the buffer is cut into `nthreads` contiguous chunks (multiples of 64 elements); thread t writes
 * its indices to idx_out[t*cap ...] (and the values' bits to val_out[t*cap ...] when val_out != NULL),
 * at most `cap` of them, but counts all of them in counts[t]. The caller concatenates the segments in
 * order, or, when some counts[t] > cap, grows cap and calls again. idx_out == NULL: count only.
 * Plain pthreads, created per call (no OpenMP runtime next to the ones torch and TensorFlow bundle, and
 * nothing left running across fork()).  No torch / Python headers: compiles in well under a second.
 */
#include <pthread.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The vector ops of the select/count loop: 8 (AVX2) or 4 (SSE2) int32 lanes of one register. */
#if defined(__AVX2__)
#include <immintrin.h>
#define HVDS_SIMD "avx2"
#define HVDS_LANES 8
typedef __m256i vec_t;
#define V_SET1(x) _mm256_set1_epi32(x)
#define V_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_AND(a, b) _mm256_and_si256(a, b)
#define V_GT(a, b) _mm256_cmpgt_epi32(a, b)
#define V_ANDNOT(a, b) _mm256_andnot_si256(a, b)
#define V_MASK(a) _mm256_movemask_ps(_mm256_castsi256_ps(a))
#elif defined(__SSE2__)
#include <emmintrin.h>
#define HVDS_SIMD "sse2"
#define HVDS_LANES 4
typedef __m128i vec_t;
#define V_SET1(x) _mm_set1_epi32(x)
#define V_LOAD(p) _mm_loadu_si128((const __m128i *)(p))
#define V_AND(a, b) _mm_and_si128(a, b)
#define V_GT(a, b) _mm_cmpgt_epi32(a, b)
#define V_ANDNOT(a, b) _mm_andnot_si128(a, b)
#define V_MASK(a) _mm_movemask_ps(_mm_castsi128_ps(a))
#else
#define HVDS_SIMD "scalar"
#endif

#define HVDS_ABI 6
#define HVDS_MAX_THREADS 256

int hvds_abi_version(void) { return HVDS_ABI; }
const char *hvds_simd(void) { return HVDS_SIMD; }

/* The first member of every job: the element range [s, e) of its thread (run_jobs reads it). */
typedef struct {
    int64_t s, e;
} range_t;

/* fn(job) for the n jobs of `size` bytes each at `jobs`, job 0 on the calling thread and the others on threads of
 * their own; a job with an empty range starts no thread, and a job whose thread could not start runs here. */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t size, int n)
{
    pthread_t tids[HVDS_MAX_THREADS];
    int started[HVDS_MAX_THREADS];
    for (int t = 1; t < n; t++) {
        const range_t *rg = (const range_t *)((char *)jobs + (size_t)t * size);
        started[t] = rg->e > rg->s && pthread_create(&tids[t], NULL, fn, (char *)jobs + (size_t)t * size) == 0;
    }
    fn(jobs);
    for (int t = 1; t < n; t++) {
        const range_t *rg = (const range_t *)((char *)jobs + (size_t)t * size);
        if (started[t]) pthread_join(tids[t], NULL);
        else if (rg->e > rg->s) fn((char *)jobs + (size_t)t * size);
    }
}

typedef struct {
    range_t rg;            /* element range [s, e) of this thread (first: see run_jobs) */
    const uint32_t *u;
    uint32_t lo, hi;
    int64_t base;          /* added to every written index */
    int64_t *io;           /* this thread's index segment, or NULL (count only) */
    uint32_t *vo;          /* this thread's value segment, or NULL */
    int64_t cap;
    int64_t count;         /* out: number of matches in [s, e) */
} job_t;

#define HVDS_EMIT(pos)                                                \
    do {                                                              \
        if (c < cap) {                                                \
            io[c] = base + (pos);                                     \
            if (vo) vo[c] = u[(pos)];                                 \
        }                                                             \
        c++;                                                          \
    } while (0)

static int64_t scan(const uint32_t *u, int64_t s, int64_t e, uint32_t lo, uint32_t hi, int64_t base,
                    int64_t *io, uint32_t *vo, int64_t cap)
{
    int64_t c = 0, i = s;
    const uint32_t span = hi - lo;  /* lo <= hi checked by the caller */
#if defined(HVDS_LANES)
    /* a = bits(|x|) < 2^31, lo - 1 >= -1, hi < 2^31: signed compares are exact; a <= hi is "not a > hi" */
    const vec_t absm = V_SET1(0x7fffffff);
    const vec_t vlo = V_SET1((int32_t)lo - 1);
    const vec_t vhi = V_SET1((int32_t)hi);
    for (; i + 4 * HVDS_LANES <= e; i += 4 * HVDS_LANES) {     /* four registers: a 32- or 16-bit mask */
        uint32_t m = 0;
        for (int q = 0; q < 4; q++) {
            vec_t a = V_AND(V_LOAD(u + i + HVDS_LANES * q), absm);
            vec_t sel = V_ANDNOT(V_GT(a, vhi), V_GT(a, vlo));
            m |= (uint32_t)V_MASK(sel) << (HVDS_LANES * q);
        }
        if (!io) { c += __builtin_popcount(m); continue; }
        while (m) {
            int j = __builtin_ctz(m);
            m &= m - 1;
            HVDS_EMIT(i + j);
        }
    }
#else
    for (; i + 32 <= e; i += 32) {          /* a vectorisable "any match in this block" test first */
        uint32_t any = 0;
        for (int j = 0; j < 32; j++) any |= (uint32_t)(((u[i + j] & 0x7fffffffu) - lo) <= span);
        if (!any) continue;
        for (int j = 0; j < 32; j++) {
            if (((u[i + j] & 0x7fffffffu) - lo) <= span) {
                if (io) HVDS_EMIT(i + j); else c++;
            }
        }
    }
#endif
    for (; i < e; i++) {
        if (((u[i] & 0x7fffffffu) - lo) <= span) {
            if (io) HVDS_EMIT(i); else c++;
        }
    }
    return c;
}

static void *run_job(void *arg)
{
    job_t *j = (job_t *)arg;
    j->count = scan(j->u, j->rg.s, j->rg.e, j->lo, j->hi, j->base, j->io, j->vo, j->cap);
    return NULL;
}

/* Returns the total count (sum of counts[0..nthreads)), or -1 on bad arguments. */
int64_t hvds_select_f32(const float *x, int64_t n, uint32_t lo, uint32_t hi, int64_t base,
                        int64_t *idx_out, uint32_t *val_out, int64_t cap, int nthreads, int64_t *counts)
{
    job_t jobs[HVDS_MAX_THREADS];
    if (n < 0 || cap < 0 || nthreads < 1 || nthreads > HVDS_MAX_THREADS || !counts || hi > 0x7fffffffu)
        return -1;
    if (n == 0 || lo > hi) {
        for (int t = 0; t < nthreads; t++) counts[t] = 0;
        return 0;
    }
    int64_t chunk = (n + nthreads - 1) / nthreads;
    chunk = (chunk + 63) & ~(int64_t)63;
    for (int t = 0; t < nthreads; t++) {
        job_t *j = &jobs[t];
        int64_t s = (int64_t)t * chunk, e = s + chunk;
        if (s > n) s = n;
        if (e > n) e = n;
        j->u = (const uint32_t *)x;
        j->rg.s = s;
        j->rg.e = e;
        j->lo = lo;
        j->hi = hi;
        j->base = base;
        j->io = idx_out ? idx_out + (int64_t)t * cap : NULL;
        j->vo = (idx_out && val_out) ? val_out + (int64_t)t * cap : NULL;
        j->cap = cap;
        j->count = 0;
    }
    run_jobs(run_job, jobs, sizeof(job_t), nthreads);
    int64_t total = 0;
    for (int t = 0; t < nthreads; t++) {
        counts[t] = jobs[t].count;
        total += jobs[t].count;
    }
    return total;
}

/* -- hvds_add_f32 / hvds_add_select_f32 ------------------------------------------------------------------- */
typedef struct {
    range_t rg;            /* element range [s, e) of this thread (first: see run_jobs) */
    const float *r;
    float *g, *out;
    int zero_g;            /* write 0.0f into g[i] once it is read (g is the caller's output, to be filled later) */
    int stream;            /* out aliases neither r nor g: non-temporal stores (no read-for-ownership of out) */
    int64_t bad;           /* out: non-finite results in [s, e) */
    /* the fused selection (io != NULL): out[i] with lo <= bits(|out[i]|) <= hi, as hvds_select_f32 */
    uint32_t lo, hi;
    int64_t base;
    int64_t *io;           /* this thread's index segment, or NULL (no selection) */
    uint32_t *vo;          /* this thread's value segment (bits of out[i]) */
    int64_t cap;
    int64_t count;         /* out: number of matches in [s, e) */
} add_job_t;

/* the emission of one selected entry: index and value bits into this thread's segment while there is room
 * (the count goes on, so the caller sees an overflow); c, cap, io, vo, base are locals of the caller */
#define HVDS_ADD_EMIT(pos, bits)                                      \
    do {                                                              \
        if (c < cap) {                                                \
            io[c] = base + (pos);                                     \
            vo[c] = (bits);                                           \
        }                                                             \
        c++;                                                          \
    } while (0)

#if defined(__AVX2__)
/* lane numbers of the set bits of every 8-bit mask, in ascending order (then zeros): the permutation that packs
 * the selected lanes of a block to the front (filled once, before any thread starts) */
static int32_t hvds_pack_lut[256][8];
static pthread_once_t hvds_pack_once = PTHREAD_ONCE_INIT;

static void hvds_pack_init(void)
{
    for (int m = 0; m < 256; m++) {
        int c = 0;
        for (int q = 0; q < 8; q++)
            if (m & (1 << q)) hvds_pack_lut[m][c++] = q;
        while (c < 8) hvds_pack_lut[m][c++] = 0;
    }
}
#endif

/* one element of the pass, scalar (alignment head, tail, builds without AVX2); locals of run_add */
#define HVDS_ADD_ONE(i)                                                          \
    do {                                                                         \
        float v = r ? r[i] + g[i] : g[i];                                        \
        uint32_t b;                                                              \
        __builtin_memcpy(&b, &v, 4);                                             \
        out[i] = v;                                                              \
        if (zero_g) g[i] = 0.0f;                                                 \
        bad += (b & 0x7f800000u) == 0x7f800000u;  /* exponent all ones: +-inf or NaN */ \
        if (sel && ((b & 0x7fffffffu) - lo) <= span) HVDS_ADD_EMIT(i, b);       \
    } while (0)

static void *run_add(void *arg)
{
    add_job_t *j = (add_job_t *)arg;
    const float *r = j->r;
    float *g = j->g;
    float *out = j->out;                               /* may be r */
    int64_t *restrict io = j->io;
    uint32_t *restrict vo = j->vo;
    const int64_t cap = j->cap, base = j->base, e = j->rg.e;
    const int zero_g = j->zero_g, sel = io != NULL;
    const uint32_t lo = j->lo, span = j->hi - j->lo;
    int64_t i = j->rg.s, bad = 0, c = 0;
#if defined(__AVX2__)
    if (j->stream) {
        for (; i < e && ((uintptr_t)(out + i) & 31u); i++)      /* scalar until out + i is 32-byte aligned */
            HVDS_ADD_ONE(i);
        const __m256i expm = _mm256_set1_epi32(0x7f800000);
        const __m256i absm = _mm256_set1_epi32(0x7fffffff);
        /* bits(|v|) < 2^31, lo - 1 >= -1, hi + 1 <= 0x7f800001: signed compares are exact (as in scan) */
        const __m256i vlo = _mm256_set1_epi32((int32_t)j->lo - 1);
        const __m256i vhi = _mm256_set1_epi32((int32_t)j->hi + 1);
        __m256i nbad = _mm256_setzero_si256();
        const __m256 zero = _mm256_setzero_ps();
        for (; i + 8 <= e; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 v = r ? _mm256_add_ps(_mm256_loadu_ps(r + i), gv) : gv;
            _mm256_stream_ps(out + i, v);
            if (zero_g) _mm256_storeu_ps(g + i, zero);
            __m256i vb = _mm256_castps_si256(v);
            __m256i ex = _mm256_and_si256(vb, expm);
            nbad = _mm256_sub_epi32(nbad, _mm256_cmpeq_epi32(ex, expm));   /* -(-1) per non-finite lane */
            if (sel) {
                __m256i a = _mm256_and_si256(vb, absm);
                int m = _mm256_movemask_ps(_mm256_castsi256_ps(
                    _mm256_and_si256(_mm256_cmpgt_epi32(a, vlo), _mm256_cmpgt_epi32(vhi, a))));
                if (m) {
                    if (c + 8 <= cap) {                /* pack the block's selected lanes: no loop per entry */
                        __m256i perm = _mm256_loadu_si256((const __m256i *)hvds_pack_lut[m]);
                        _mm256_storeu_si256((__m256i *)(vo + c), _mm256_permutevar8x32_epi32(vb, perm));
                        __m256i at = _mm256_set1_epi64x(base + i);
                        _mm256_storeu_si256((__m256i *)(io + c),
                                            _mm256_add_epi64(at, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(perm))));
                        _mm256_storeu_si256((__m256i *)(io + c + 4),
                                            _mm256_add_epi64(at, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(perm, 1))));
                        c += __builtin_popcount((unsigned)m);
                    } else {
                        uint32_t lanes[8];
                        _mm256_storeu_si256((__m256i *)lanes, vb);
                        while (m) {
                            int q = __builtin_ctz(m);
                            m &= m - 1;
                            HVDS_ADD_EMIT(i + q, lanes[q]);
                        }
                    }
                }
            }
        }
        _mm_sfence();
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, nbad);
        for (int q = 0; q < 8; q++) bad += lanes[q];   /* < 2^31 per lane: chunks are far smaller */
    }
#endif
    for (; i < e; i++)
        HVDS_ADD_ONE(i);
    j->bad = bad;
    j->count = c;
    return NULL;
}

/* out[i] = r[i] + g[i] (r == NULL: out[i] = g[i]) for i < n, and g[i] = 0 afterwards when zero_g; returns the
 * number of non-finite out[i], or -1 on bad arguments. out may be r (element-wise); with zero_g it must not be g.
 * With idx_out != NULL, the same pass also selects from out as hvds_select_f32 does from x (same lo, hi, base,
 * segments idx_out/val_out of cap entries per thread, counts[t] = all matches of thread t, even past cap); the
 * caller handles an overflowed segment from out itself: the additions are done and g may be zeroed, so the
 * call must not be repeated. */
int64_t hvds_add_select_f32(const float *r, float *g, float *out, int64_t n, int nthreads, int zero_g,
                            uint32_t lo, uint32_t hi, int64_t base, int64_t *idx_out, uint32_t *val_out,
                            int64_t cap, int64_t *counts)
{
    add_job_t jobs[HVDS_MAX_THREADS];
    if (n < 0 || nthreads < 1 || nthreads > HVDS_MAX_THREADS || !g || !out || (zero_g && out == g))
        return -1;
    if (idx_out && (!val_out || !counts || cap < 0 || hi > 0x7f800000u))
        return -1;
#if defined(__AVX2__)
    pthread_once(&hvds_pack_once, hvds_pack_init);
#endif
    int64_t chunk = (n + nthreads - 1) / nthreads;
    chunk = (chunk + 63) & ~(int64_t)63;
    for (int t = 0; t < nthreads; t++) {
        int64_t s = (int64_t)t * chunk, e = s + chunk;
        add_job_t *j = &jobs[t];
        j->r = r;
        j->g = g;
        j->out = out;
        j->rg.s = s > n ? n : s;
        j->rg.e = e > n ? n : e;
        j->zero_g = zero_g;
        j->stream = out != r && out != g;
        j->bad = 0;
        /* lo > hi (an empty rule) selects nothing: no segment at all */
        j->io = (idx_out && lo <= hi) ? idx_out + (int64_t)t * cap : NULL;
        j->vo = j->io ? val_out + (int64_t)t * cap : NULL;
        j->lo = j->io ? lo : 1;
        j->hi = j->io ? hi : 0;
        j->base = base;
        j->cap = cap;
        j->count = 0;
    }
    run_jobs(run_add, jobs, sizeof(add_job_t), nthreads);
    int64_t bad = 0;
    for (int t = 0; t < nthreads; t++) bad += jobs[t].bad;
    if (idx_out && counts)
        for (int t = 0; t < nthreads; t++) counts[t] = jobs[t].count;
    return bad;
}

int64_t hvds_add_f32(const float *r, float *g, float *out, int64_t n, int nthreads, int zero_g)
{
    return hvds_add_select_f32(r, g, out, n, nthreads, zero_g, 1, 0, 0, NULL, NULL, 0, NULL);
}

/* -- hvds_merge_add_f32 / hvds_intersect_i64: the k-sized merges of the sparse reducers ---------------------- */

/* x where c is 1, +0.0f where c is 0, by a mask of its bits: no branch (a compiler may well compile
 * "c ? x : 0.0f" as one). */
static inline float keep_if(float x, int c)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    b &= 0u - (uint32_t)c;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* Two ascending runs a (na pairs) and b (nb) merged into out: every index once, with the sum (a's value + 0.0f) +
 * b's value, where a run that lacks the index gives 0.0f. a's values are rank-order sums so far (0.0f + v_0 + ...,
 * never -0.0, so "+ 0.0f" leaves them as they are) or the first run's own values (then "+ 0.0f" is the sum's
 * "0.0f +"): the bits of "dst[idx_b] += val_b" on a dst that holds a. Branch-free: which run holds the next index
 * is data, and mispredicted branches cost several times the merge itself. Returns the pairs written. */
static int64_t merge2(const int64_t *ai, const float *av, int64_t na, const int64_t *bi, const float *bv, int64_t nb,
                      int64_t *oi, float *ov)
{
    int64_t i = 0, j = 0, m = 0;
    while (i < na && j < nb) {
        const int64_t x = ai[i], y = bi[j];
        const float u = av[i], v = bv[j];
        const int ta = x <= y, tb = y <= x;
        oi[m] = ta ? x : y;
        ov[m] = (keep_if(u, ta) + 0.0f) + keep_if(v, tb);
        i += ta;
        j += tb;
        m++;
    }
    for (; i < na; i++, m++) { oi[m] = ai[i]; ov[m] = av[i] + 0.0f; }
    for (; j < nb; j++, m++) { oi[m] = bi[j]; ov[m] = 0.0f + bv[j]; }
    return m;
}

/* P runs of (index, value) pairs, run s = pairs [off_s, off_s + counts[s]) of idx/val, each strictly ascending in
 * index, are merged into their sorted distinct indexes out_idx and the sums out_val: every sum is
 * 0.0f + v_s1 + v_s2 + ... over the runs s1 < s2 < ... that hold the index, in that order (the additions of a
 * dense "dst = 0; dst[idx_s] += val_s for s = 0..P-1", so the sums are the same bits). out_* have room for the
 * total. Returns the number of distinct indexes, or -1 when a run is not strictly ascending, on bad arguments or
 * when the scratch buffer cannot be allocated (the caller then takes its general path). The runs are added one
 * after the other into the sums so far (merge2), alternating between out_* and a scratch buffer so that the last
 * merge writes out_*. */
int64_t hvds_merge_add_f32(const int64_t *idx, const float *val, const int64_t *counts, int P,
                           int64_t *out_idx, float *out_val)
{
    if (P < 1 || P > HVDS_MAX_THREADS) return -1;
    int64_t total = 0;
    for (int s = 0; s < P; s++) {
        if (counts[s] < 0) return -1;
        for (int64_t i = total + 1; i < total + counts[s]; i++)
            if (idx[i] <= idx[i - 1]) return -1;
        total += counts[s];
    }
    int64_t *tmp_idx = NULL;
    float *tmp_val = NULL;
    if (P > 2) {
        tmp_idx = malloc((size_t)total * sizeof *tmp_idx + 1);
        tmp_val = malloc((size_t)total * sizeof *tmp_val + 1);
        if (!tmp_idx || !tmp_val) { free(tmp_idx); free(tmp_val); return -1; }
    }
    const int64_t *ai = idx;                        /* the sums so far: run 0 itself to begin with */
    const float *av = val;
    int64_t m = counts[0], off = counts[0];
    for (int s = 1; s < P; s++) {
        const int to_out = (P - 1 - s) % 2 == 0;    /* the last merge (s = P - 1) writes out_* */
        int64_t *oi = to_out ? out_idx : tmp_idx;
        float *ov = to_out ? out_val : tmp_val;
        m = merge2(ai, av, m, idx + off, val + off, counts[s], oi, ov);
        ai = oi;
        av = ov;
        off += counts[s];
    }
    if (P == 1)
        for (int64_t i = 0; i < m; i++) { out_idx[i] = idx[i]; out_val[i] = 0.0f + val[i]; }
    free(tmp_idx);
    free(tmp_val);
    return m;
}

/* The elements of the strictly ascending a[0..na) that occur in the strictly ascending b[0..nb), ascending, into
 * out (room for min(na, nb)); returns their number, or -1 when an input is not strictly ascending. */
int64_t hvds_intersect_i64(const int64_t *a, int64_t na, const int64_t *b, int64_t nb, int64_t *out)
{
    if (na < 0 || nb < 0) return -1;
    for (int64_t i = 1; i < na; i++) if (a[i] <= a[i - 1]) return -1;
    for (int64_t i = 1; i < nb; i++) if (b[i] <= b[i - 1]) return -1;
    int64_t i = 0, j = 0, m = 0;
    while (i < na && j < nb) {                      /* branch-free: the order of a and b is data */
        const int64_t x = a[i], y = b[j];
        out[m] = x;
        m += x == y;
        i += x <= y;
        j += y <= x;
    }
    return m;
}

/* 1 when x[0..n) is ascending (repeats allowed): one pass without an early exit, which the compiler vectorizes. */
static int ascending_i64(const int64_t *x, int64_t n)
{
    int64_t down = 0;
    for (int64_t i = 1; i < n; i++) down |= x[i] < x[i - 1];
    return !down;
}

/* a[0..na) with every entry that does not occur in b[0..nb) replaced by fill, into out (room for na); a and b
 * ascending (not strictly: repeats, such as trailing fill padding, are allowed); fill never matches. Returns how
 * many entries of a were kept, or -1 when an input is not ascending.
 *
 * AVX2: blocks of four against blocks of four. A block of a is compared with every block of b that overlaps it
 * (all 16 pairs: b rotated three times), its hits accumulate until it moves on; the block whose last element is
 * smaller moves on, a's on a tie (so an a block whose last value repeats in the next one is still compared with
 * the b block holding that value). The elements left over take the scalar loop, the hits so far carried in. */
int64_t hvds_members_i64(const int64_t *a, int64_t na, const int64_t *b, int64_t nb, int64_t fill, int64_t *out)
{
    if (na < 0 || nb < 0) return -1;
    if (!ascending_i64(a, na) || !ascending_i64(b, nb)) return -1;
    int64_t i = 0, j = 0;
    unsigned carried = 0;                           /* hits of a[i..i+3] found so far (bit t: a[i+t]) */
#if defined(__AVX2__)
    const __m256i fv = _mm256_set1_epi64x(fill);
    __m256i acc = _mm256_setzero_si256();          /* the same hits, lane by lane */
    while (i + 4 <= na && j + 4 <= nb) {
        const __m256i va = _mm256_loadu_si256((const __m256i *)(a + i));
        const __m256i vb = _mm256_loadu_si256((const __m256i *)(b + j));
        __m256i hit = _mm256_cmpeq_epi64(va, vb);
        hit = _mm256_or_si256(hit, _mm256_cmpeq_epi64(va, _mm256_permute4x64_epi64(vb, 0x39)));
        hit = _mm256_or_si256(hit, _mm256_cmpeq_epi64(va, _mm256_permute4x64_epi64(vb, 0x4e)));
        hit = _mm256_or_si256(hit, _mm256_cmpeq_epi64(va, _mm256_permute4x64_epi64(vb, 0x93)));
        acc = _mm256_or_si256(acc, _mm256_andnot_si256(_mm256_cmpeq_epi64(va, fv), hit));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_blendv_epi8(fv, va, acc));
        const int64_t next_a = a[i + 3] <= b[j + 3];
        i += 4 * next_a;
        j += 4 * (1 - next_a);
        acc = _mm256_and_si256(acc, _mm256_set1_epi64x(next_a - 1));    /* a new block of a: no hits yet */
    }
    carried = (unsigned)_mm256_movemask_pd(_mm256_castsi256_pd(acc));
#endif
    /* Branch-free: one step either passes an element of b below a[i] or settles a[i] (its last write stands). */
    const int64_t from = i;
    while (i < na) {
        const int more = j < nb;                    /* b not passed yet (else a[i] settles as not found) */
        const int64_t x = a[i], y = nb ? b[more ? j : nb - 1] : fill;
        const int below = more & (y < x);
        const int before = (i - from < 4) & (int)((carried >> ((i - from) & 3)) & 1);
        const int hit = ((more & (y == x)) | before) & (x != fill);
        out[i] = hit ? x : fill;
        i += !below;
        j += below;
    }
    int64_t m = 0;
    for (int64_t t = 0; t < na; t++) m += out[t] != fill;
    return m;
}
