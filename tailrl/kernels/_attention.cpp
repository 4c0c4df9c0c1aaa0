// Row attention over a paged KV cache: every query token attends to its own row's keys, read
// through the row's block table.
//
// Why a kernel of our own: decode and verify steps have 1-17 queries per row, and PyTorch's
// CPU SDPA spends 5-10x the time of reading the K/V on them (measured: batch 64, 400
// positions, bfloat16: 1.1-1.5 ms per layer call against 0.2 ms to read the cache), so the
// bulk of a rollout was attention-bound. Here a row's K/V is read from memory once per
// (row, KV head) and stays in cache for all of the row's queries and their G query heads.
//
// Visibility. Query t sees the keys of its row at cache positions [0, prefix[t]) followed by
// extra[estart[t] .. estart[t] + ecount[t]) (a tree draft node: its ancestors and itself).
// Its "visible index" v runs over that sequence in order. A sliding-window layer also gives each
// query an origin: it sees no position of its prefix below origin[t] (its extras, a few
// positions behind it, are all inside the window; an origin past the prefix hides the prefix).
// A score is the scaled query's dot product with a key; with a soft cap (Gemma 2's, cap > 0)
// it becomes cap * tanh(score / cap), lane by lane, before the softmax. With attention sinks
// (gpt-oss's: a learned logit per query head, sinks non-null) the softmax's denominator also
// counts exp(sink): one more term, added after the keys, which weighs no value.
//
// Batch invariance (why outputs are identical with and without speculation): the arithmetic
// for a query depends only on its visible keys' K/V in visible order and on q: scores are dot
// products in a fixed order, and the online softmax runs over blocks of BLOCK visible keys
// (v in [b*BLOCK, (b+1)*BLOCK)). A tree node whose ancestors sit at cache positions other
// than their depths sees the same sequence as plain decoding of that token, so it computes
// the same bits; so does a query of a row batched with any other rows.
//
// Paging. The cache is a pool of blocks of BLOCK positions (keys [blocks, KV, BLOCK * D],
// values [blocks, KV, BLOCK, D]); row r's position p lives in block table[r][p / BLOCK] at
// offset p % BLOCK. Reading through the table changes no arithmetic: a query sees the same
// keys in the same order wherever their blocks are.
//
// Key layout. A block's keys for one KV head are [D/2][BLOCK][2]: pairs of head dimensions side
// by side for every key (key_at). A block is one contiguous read, and on CPUs with AVX512-BF16 a
// bfloat16 block is scored with one dot-product-of-pairs instruction per 16 keys and 2
// dimensions (the query rounded to bfloat16 once); values stay [BLOCK][D] and are weighed in
// float.
//
// Accumulation is in float (double for float64 caches). Tensors are passed as raw pointers
// with element strides; the Python side checks shapes, dtypes and bounds.
#include <pybind11/pybind11.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

namespace {

constexpr int BLOCK = 32;   // keys per online-softmax block
constexpr int LANES = 16;   // accumulator elements kept in registers at a time
constexpr int CHAINS = 4;   // independent accumulation chains (FMA latency x throughput)

inline float load(const uint16_t* p) {          // bfloat16 -> float: the high half of a float
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float load(const float* p) { return *p; }
inline double load(const double* p) { return *p; }

inline void store(uint16_t* p, float f) {       // float -> bfloat16, round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    *p = static_cast<uint16_t>(u >> 16);
}
inline void store(float* p, float f) { *p = f; }
inline void store(double* p, double f) { *p = f; }

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

struct Layout {
    int64_t n, heads, kv_heads, dim;
    int64_t q_s0, q_s1;              // q strides (token, head); dim stride 1
    int64_t k_s0, k_s1;              // key pool strides (block, kv head); a block's keys inside (key_at)
    int64_t v_s0, v_s1, v_s2;        // value pool strides (block, kv head, position); dim stride 1
    int64_t o_s0, o_s1;
};

// One row's K/V for one KV head, through its block table.
template <typename T>
struct RowKV {
    const T* k;                      // the pool's keys at this head (block 0)
    const T* v;                      // the pool's values at this head (block 0)
    const int32_t* table;            // the row's block table
    int64_t k_s0, v_s0, v_s2;
    const T* key_block(int64_t b) const { return k + table[b] * k_s0; }      // keys of the row's block b
    const T* value(int64_t p) const { return v + table[p / BLOCK] * v_s0 + (p % BLOCK) * v_s2; }
};

// Offset of key (dimension d, lane p of a block) inside one KV head's key block.
inline int64_t key_at(int64_t d, int64_t p, int64_t D) {
    (void)D;
    return (d / 2) * (2 * BLOCK) + p * 2 + (d & 1);
}

// exp for softmax weights, branch-free so the compiler vectorises it: x = n ln2 + r,
// e^r by a degree-6 polynomial (|r| <= ln2 / 2, relative error ~2e-7), times 2^n from the
// exponent bits. Softmax only needs the same function everywhere, which this is.
inline float fast_exp(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    const float shift = 12582912.0f;                          // 1.5 * 2^23: rounds to integer
    float t = x * 1.44269504088896341f + shift;
    float n = t - shift;
    int32_t ni;
    std::memcpy(&ni, &t, 4);
    ni -= 0x4B400000;                                         // the integer n
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f / 720 * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = (ni + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}
inline double fast_exp(double x) { return std::exp(x); }

// A score's soft cap, cap * tanh(s / cap), branch-free so the compiler vectorises it: tanh(x) =
// sign(x) (1 - e) / (1 + e) with e = exp(-2 |x|) (fast_exp's; libm's tanhf per score cost the
// attention 10-24% on an AVX2 CPU, benchmarks/soft_cap.py).
template <typename A>
inline A soft_cap(A s, A cap) {
    const A x = s / cap;
    const A e = fast_exp(A(-2) * std::abs(x));
    const A t = (A(1) - e) / (A(1) + e);
    return cap * (x < 0 ? -t : t);
}

// State of one query head's online softmax.
template <typename A>
struct Query {
    const A* q;          // [D] scaled query, in the accumulation type
    const uint32_t* qp;  // [D/2] the scaled query as bfloat16 pairs (bfloat16 fast path only)
    A* acc;              // [D]; on the fast path, per 32 dimensions: the 16 even ones, then the odd ones
    A m, l;
    bool started;
    A cap;               // the scores' soft cap (0: none)
};

// Scores of one block (kb, in the cache's layout) against a query, in the accumulation type.
// CHAINS interleaved partial sums over the head dimension (independent chains keep the FMA
// units busy; the order is fixed, so every path computes the same bits). Lane j depends only
// on key j and the query.
template <typename T, typename A>
inline void block_scores(const A* q, const T* kb, int64_t D, A* s) {
    alignas(64) A sp[CHAINS][BLOCK];
    for (int u = 0; u < CHAINS; ++u)
        for (int j = 0; j < BLOCK; ++j) sp[u][j] = 0;
    int64_t d = 0;
    for (; d + CHAINS <= D; d += CHAINS) {
        for (int u = 0; u < CHAINS; ++u) {
            const A qd = q[d + u];
            const T* kd = kb + key_at(d + u, 0, D);
#pragma omp simd
            for (int j = 0; j < BLOCK; ++j) sp[u][j] += qd * load(kd + 2 * j);
        }
    }
    for (; d < D; ++d) {
        const A qd = q[d];
        const T* kd = kb + key_at(d, 0, D);
#pragma omp simd
        for (int j = 0; j < BLOCK; ++j) sp[0][j] += qd * load(kd + 2 * j);
    }
#pragma omp simd
    for (int j = 0; j < BLOCK; ++j) s[j] = (sp[0][j] + sp[1][j]) + (sp[2][j] + sp[3][j]);
}

// Online softmax over one block's scores s (lanes outside [lo, nb) are ignored): writes the
// block's weights p (zero outside), updates the running max and sum, returns the factor by which
// the accumulator must be scaled.
template <typename A>
inline A softmax_block(Query<A>& st, A* s, int64_t lo, int64_t nb, A* p) {
    if (st.cap > 0) {                           // each lane alone, every lane (the unseen ones are replaced below)
        const A cap = st.cap;
#pragma omp simd
        for (int j = 0; j < BLOCK; ++j) s[j] = soft_cap(s[j], cap);
    }
    // block max over lanes [lo, nb) (exact in any order): the other lanes repeat lane lo, then an
    // elementwise max of the two halves, down to one
    for (int64_t j = 0; j < lo; ++j) s[j] = s[lo];
    for (int64_t j = nb; j < BLOCK; ++j) s[j] = s[lo];
    alignas(64) A mx[BLOCK];
    for (int j = 0; j < BLOCK; ++j) mx[j] = s[j];
    for (int w = BLOCK / 2; w > 0; w /= 2)
#pragma omp simd
        for (int j = 0; j < w; ++j) mx[j] = mx[j] > mx[j + w] ? mx[j] : mx[j + w];
    const A bm = mx[0];
    const A mnew = st.started ? std::max(st.m, bm) : bm;
    const A c = st.started ? fast_exp(st.m - mnew) : A(0);
#pragma omp simd
    for (int j = 0; j < BLOCK; ++j) p[j] = fast_exp(s[j] - mnew);
    for (int64_t j = 0; j < lo; ++j) p[j] = 0;
    for (int64_t j = nb; j < BLOCK; ++j) p[j] = 0;
    alignas(64) A ps[BLOCK];                    // block sum: a fixed pairwise reduction
    for (int j = 0; j < BLOCK; ++j) ps[j] = p[j];
    for (int w = BLOCK / 2; w > 0; w /= 2)
#pragma omp simd
        for (int j = 0; j < w; ++j) ps[j] += ps[j + w];
    st.l = st.l * c + ps[0];
    st.m = mnew;
    st.started = true;
    return c;
}

// acc = acc * c + sum_j p[j] v[j], each element in j order, in CHAINS interleaved partial
// sums over j; LANES elements at a time in a local array, so they stay in registers.
// v[j]: the value row of the block's j-th visible key.
template <typename T, typename A>
inline void weigh_values(A* acc, A c, const A* p, const T* const* v, int64_t nb, int64_t D) {
    int64_t d0 = 0;
    for (; d0 + LANES <= D; d0 += LANES) {
        A a[CHAINS][LANES] = {};
        int64_t j = 0;
        for (; j + CHAINS <= nb; j += CHAINS) {
            for (int u = 0; u < CHAINS; ++u) {
                const A pj = p[j + u];
                const T* vj = v[j + u] + d0;
#pragma omp simd
                for (int i = 0; i < LANES; ++i) a[u][i] += pj * load(vj + i);
            }
        }
        for (; j < nb; ++j) {
            const A pj = p[j];
            const T* vj = v[j] + d0;
#pragma omp simd
            for (int i = 0; i < LANES; ++i) a[0][i] += pj * load(vj + i);
        }
#pragma omp simd
        for (int i = 0; i < LANES; ++i) acc[d0 + i] = acc[d0 + i] * c + ((a[0][i] + a[1][i]) + (a[2][i] + a[3][i]));
    }
    for (; d0 < D; ++d0) {
        A a = acc[d0] * c;
        for (int64_t j = 0; j < nb; ++j) a += p[j] * load(v[j] + d0);
        acc[d0] = a;
    }
}

// One block's visible keys, lanes [lo, nb), for one query head (generic path): kb in the
// cache's layout, v[j] the value row of key j.
template <typename T, typename A>
inline void block_update(Query<A>& st, const T* kb, const T* const* v, int64_t lo, int64_t nb, int64_t D) {
    alignas(64) A s[BLOCK];
    alignas(64) A p[BLOCK];
    block_scores(st.q, kb, D, s);
    const A c = softmax_block(st, s, lo, nb, p);
    weigh_values(st.acc, c, p + lo, v + lo, nb - lo, D);
}

#include "_attention_bf16.h"   // block_update_bf16, HAVE_BF16_DOT (the AVX512-BF16 kernels)

// The fast path: bfloat16 caches, a head dimension in whole 32s, a CPU with AVX512-BF16.
template <typename T>
inline bool fast_path(int64_t D) {
    return HAVE_BF16_DOT && std::is_same<T, uint16_t>::value && D % 32 == 0;
}

// The row's keys at positions pos[0..nb) copied into one block of the cache's layout (kb, zero
// past nb): a tree node's gathered block.
template <typename T>
inline void gather_block(const RowKV<T>& r, const int64_t* pos, int64_t nb, int64_t D, T* kb) {
    std::memset(kb, 0, sizeof(T) * BLOCK * D);
    for (int64_t j = 0; j < nb; ++j) {
        const T* src = r.key_block(pos[j] / BLOCK);
        const int64_t lane = pos[j] % BLOCK;
        for (int64_t d = 0; d < D; ++d) kb[key_at(d, j, D)] = src[key_at(d, lane, D)];
    }
}

// Per-thread scratch of row_head.
template <typename T, typename A>
struct Scratch {
    std::vector<A> buf;                 // scaled queries, accumulators
    std::vector<uint32_t> qp;           // queries as bfloat16 pairs
    std::vector<T> kb;                  // a gathered block
    std::vector<Query<A>> st;
    std::vector<int64_t> shared_end;
};

// One block's keys, lanes [lo, nb) (kb: in the cache's layout, in place or gathered), for query
// state st.
template <typename T, typename A>
inline void update(Query<A>& st, bool fast, const T* kb, const T* const* v, int64_t lo, int64_t nb, int64_t D) {
    if constexpr (std::is_same<T, uint16_t>::value) {
        if (fast) {
            block_update_bf16(st, kb, v, lo, nb, D);
            return;
        }
    }
    block_update(st, kb, v, lo, nb, D);
}

inline uint32_t bf16_bits(float f) {
    uint16_t b;
    store(&b, f);
    return b;
}

// Where dimension d of a query's result sits in its accumulator.
inline int64_t acc_at(int64_t d, bool fast) {
    return fast ? (d / 32) * 32 + (d & 1) * 16 + (d % 32) / 2 : d;
}

// Ask for one block's keys and values (BLOCK * D elements each, contiguous) to be cached.
template <typename T>
inline void prefetch_block(const T* k, const T* v, int64_t D) {
    const char* kc = reinterpret_cast<const char*>(k);
    const char* vc = reinterpret_cast<const char*>(v);
    for (int64_t off = 0; off < static_cast<int64_t>(sizeof(T)) * BLOCK * D; off += 64) {
        __builtin_prefetch(kc + off);
        __builtin_prefetch(vc + off);
    }
}

// The factor of a query's weighted values with its head's sink in the softmax: the sink one more
// score after the keys (the running max and sum moved to include it), weighing no value.
template <typename A>
inline A with_sink(const Query<A>& s, A sink) {
    const A m = s.started ? std::max(s.m, sink) : sink;
    const A c = s.started ? fast_exp(s.m - m) : A(0);
    return c / (s.l * c + fast_exp(sink - m));
}

// All queries of one row, one KV head (r: its K/V through its block table).
// Phase 1: blocks of consecutive positions [0, most), read from memory once and from cache by
// every other query head that sees them; a query without extras uses its blocks up to its
// prefix (the last one partial), a query with extras stops at the last block boundary below
// its prefix. Phase 2: each query with extras gathers the rest of its visible keys (the
// prefix's tail, then the extras) into blocks of its own, aligned as in phase 1. A query with an
// origin (origin: null where no query has one) skips the lanes below it; phase 1 starts at the
// block of the row's lowest origin.
template <typename T, typename A>
void row_head(const A* q, const RowKV<T>& r, T* out, const Layout& L, int64_t t0, int64_t t1, int64_t kh,
              const int32_t* prefix, const int32_t* estart, const int32_t* ecount, const int32_t* extra,
              const int32_t* origin, A scale, A cap, const A* sinks, Scratch<T, A>& sc, const RowKV<T>* next) {
    const int64_t D = L.dim, G = L.heads / L.kv_heads, nq = (t1 - t0) * G;
    const bool fast = fast_path<T>(D);
    sc.buf.resize(static_cast<size_t>(2 * nq * D));
    sc.qp.resize(static_cast<size_t>(nq * D / 2 + 1));
    sc.kb.resize(static_cast<size_t>(BLOCK * D));
    sc.st.resize(static_cast<size_t>(nq));
    sc.shared_end.resize(static_cast<size_t>(nq));
    A* qs = sc.buf.data();
    A* accs = qs + nq * D;
    int64_t most = 0, first = INT64_MAX;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t pre = prefix[t];
        const int64_t end = ecount[t] ? (pre / BLOCK) * BLOCK : pre;
        const int64_t lo = origin ? std::min<int64_t>(origin[t], pre) : 0;
        if (lo < end) first = std::min(first, (lo / BLOCK) * BLOCK);
        for (int64_t g = 0; g < G; ++g) {
            const int64_t i = (t - t0) * G + g;
            const A* qh = q + (t * L.heads + kh * G + g) * D;
            A* qi = qs + i * D;
            for (int64_t d = 0; d < D; ++d) qi[d] = qh[d] * scale;
            for (int64_t d = 0; d < D; ++d) accs[i * D + d] = 0;
            uint32_t* qp = sc.qp.data() + i * D / 2;
            if (fast)
                for (int64_t d = 0; d + 1 < D; d += 2)
                    qp[d / 2] = bf16_bits(static_cast<float>(qi[d])) | bf16_bits(static_cast<float>(qi[d + 1])) << 16;
            sc.st[i] = Query<A>{qi, qp, accs + i * D, 0, 0, false, cap};
            sc.shared_end[i] = end;
        }
        most = std::max(most, end);
    }
    int64_t pos[BLOCK];
    const T* vrow[BLOCK];
    for (int64_t b0 = first; b0 < most; b0 += BLOCK) {
        const int64_t nb = std::min<int64_t>(BLOCK, most - b0);
        // the block is read in place (a partial block's unused lanes are readable, never used)
        const T* kb = r.key_block(b0 / BLOCK);
        const T* vb = r.value(b0);
        for (int64_t j = 0; j < nb; ++j) vrow[j] = vb + j * L.v_s2;
        // ask for the next block's K and V, and for the next work item's block b0, while this
        // block is computed (two streams in flight: decode attention is bound by memory latency)
        if (b0 + BLOCK < most) prefetch_block(r.key_block(b0 / BLOCK + 1), r.value(b0 + BLOCK), D);
        if (next) prefetch_block(next->key_block(b0 / BLOCK), next->value(b0), D);
        for (int64_t i = 0; i < nq; ++i) {
            const int64_t t = t0 + i / G;
            const int64_t lo = origin ? std::max<int64_t>(std::min(origin[t], prefix[t]) - b0, 0) : 0;
            const int64_t n = std::min<int64_t>(nb, sc.shared_end[i] - b0);
            if (n > lo) update<T, A>(sc.st[i], fast, kb, vrow, lo, n, D);
        }
    }
    for (int64_t t = t0; t < t1; ++t) {
        if (!ecount[t]) continue;
        const int64_t pre = prefix[t], from = (pre / BLOCK) * BLOCK, total = pre + ecount[t];
        const int32_t* ex = extra + estart[t];
        for (int64_t b0 = from; b0 < total; b0 += BLOCK) {
            const int64_t nb = std::min<int64_t>(BLOCK, total - b0);
            for (int64_t j = 0; j < nb; ++j) {
                pos[j] = b0 + j < pre ? b0 + j : ex[b0 + j - pre];
                vrow[j] = r.value(pos[j]);
            }
            const int64_t below = origin ? std::min(origin[t], prefix[t]) - b0 : 0;   // lanes below the origin
            const int64_t lo = std::min<int64_t>(std::max<int64_t>(below, 0), nb);
            if (lo == nb) continue;
            gather_block(r, pos, nb, D, sc.kb.data());
            for (int64_t g = 0; g < G; ++g)
                update<T, A>(sc.st[(t - t0) * G + g], fast, sc.kb.data(), vrow, lo, nb, D);
        }
    }
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t g = 0; g < G; ++g) {
            const Query<A>& s = sc.st[(t - t0) * G + g];
            const A inv = sinks ? with_sink(s, sinks[kh * G + g]) : s.l > 0 ? A(1) / s.l : A(0);
            T* o = out + t * L.o_s0 + (kh * G + g) * L.o_s1;
            for (int64_t d = 0; d < D; ++d) store(o + d, s.acc[acc_at(d, fast)] * inv);
        }
    }
}

// Attention of every query (q: [N, H, D] contiguous, in the accumulation type) over its row
// (row r's block table: table + r * t_s0).
template <typename T, typename A>
void attention(const A* q, const T* k, const T* v, T* out, const Layout& L, const int32_t* qrow,
               const int32_t* prefix, const int32_t* estart, const int32_t* ecount, const int32_t* extra,
               const int32_t* origin, const int32_t* table, int64_t t_s0, double scale, double cap, const A* sinks,
               int threads) {
    // Queries are grouped by row (flat order: row after row); find each row's span.
    std::vector<int64_t> span_start, span_end;
    for (int64_t t = 0; t < L.n; ++t) {
        if (t == 0 || qrow[t] != qrow[t - 1]) {
            span_start.push_back(t);
            span_end.push_back(t + 1);
        } else {
            span_end.back() = t + 1;
        }
    }
    const int64_t work = static_cast<int64_t>(span_start.size()) * L.kv_heads;
#pragma omp parallel num_threads(threads)
    {
        Scratch<T, A> sc;
#pragma omp for schedule(dynamic, 4)
        for (int64_t w = 0; w < work; ++w) {
            auto at = [&](int64_t item) {
                const int64_t kh = item % L.kv_heads, row = qrow[span_start[item / L.kv_heads]];
                return RowKV<T>{k + kh * L.k_s1, v + kh * L.v_s1, table + row * t_s0, L.k_s0, L.v_s0, L.v_s2};
            };
            const RowKV<T> r = at(w);
            const bool more = w + 1 < work;
            const RowKV<T> next = more ? at(w + 1) : r;
            const int64_t sp = w / L.kv_heads;
            row_head<T, A>(q, r, out, L, span_start[sp], span_end[sp], w % L.kv_heads, prefix, estart, ecount,
                           extra, origin, static_cast<A>(scale), static_cast<A>(cap), sinks, sc,
                           more ? &next : nullptr);
        }
    }
}

template <typename T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

Layout layout(py::tuple shape, py::tuple strides) {
    Layout L{};
    L.n = shape[0].cast<int64_t>();
    L.heads = shape[1].cast<int64_t>();
    L.kv_heads = shape[2].cast<int64_t>();
    L.dim = shape[3].cast<int64_t>();
    int64_t st[9];
    for (int i = 0; i < 9; ++i) st[i] = strides[i].cast<int64_t>();
    L.q_s0 = st[0]; L.q_s1 = st[1];
    L.k_s0 = st[2]; L.k_s1 = st[3];
    L.v_s0 = st[4]; L.v_s1 = st[5]; L.v_s2 = st[6];
    L.o_s0 = st[7]; L.o_s1 = st[8];
    return L;
}

struct Visibility {
    const int32_t *qrow, *prefix, *estart, *ecount, *extra, *table;
    int64_t t_s0;                    // the block table's row stride
    const int32_t* origin;           // [N] the first position of its prefix each query sees; null: 0
};

Visibility visibility(py::tuple vis) {
    auto p = [&](int i) { return ptr<const int32_t>(vis[i].cast<uintptr_t>()); };
    return Visibility{p(0), p(1), p(2), p(3), p(4), p(5), vis[6].cast<int64_t>(), p(7)};
}

// q (type T, strided) -> the accumulation type, then attention.
template <typename T>
void attend_t(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, const Layout& L, const Visibility& V,
              double scale, double cap, uintptr_t sinks, int threads) {
    using A = typename Acc<T>::type;
    std::vector<A> qa(static_cast<size_t>(L.n * L.heads * L.dim));
    const T* qt = ptr<const T>(q);
    for (int64_t t = 0; t < L.n; ++t)
        for (int64_t h = 0; h < L.heads; ++h)
            for (int64_t d = 0; d < L.dim; ++d)
                qa[(t * L.heads + h) * L.dim + d] = load(qt + t * L.q_s0 + h * L.q_s1 + d);
    attention<T, A>(qa.data(), ptr<const T>(k), ptr<const T>(v), ptr<T>(out), L, V.qrow, V.prefix, V.estart,
                    V.ecount, V.extra, V.origin, V.table, V.t_s0, scale, cap, ptr<const A>(sinks), threads);
}

void attend(int dtype, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, py::tuple shape, py::tuple strides,
            py::tuple vis, double scale, double cap, uintptr_t sinks, int threads) {
    const Layout L = layout(shape, strides);
    const Visibility V = visibility(vis);
    py::gil_scoped_release release;
    if (dtype == 0) attend_t<uint16_t>(q, k, v, out, L, V, scale, cap, sinks, threads);
    else if (dtype == 1) attend_t<float>(q, k, v, out, L, V, scale, cap, sinks, threads);
    else attend_t<double>(q, k, v, out, L, V, scale, cap, sinks, threads);
}

// Rotary embedding ("rotate half") of one head x (D values) at a position's cos/sin rows.
template <typename T, typename A>
inline void rope(const T* x, const A* c, const A* s, int64_t D, A* y) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; ++d) y[d] = load(x + d) * c[d] - load(x + d + half) * s[d];
    for (int64_t d = half; d < D; ++d) y[d] = load(x + d) * c[d] + load(x + d - half) * s[d];
}

// One layer's attention from its fused projection qkv [N, (H + 2 KV) * D] (row stride
// qkv_s0): RoPE on the query and key heads (in the accumulation type, at cos/sin [pos, D]),
// this step's keys and values written into the pool at their slots (block * BLOCK + lane), then
// attention. Phase 1 runs over tokens, phase 2 (after every write) over (row, KV head).
template <typename T>
void rope_attend_t(uintptr_t qkv, int64_t qkv_s0, uintptr_t cos, uintptr_t sin, const int64_t* positions,
                   const int64_t* slot, uintptr_t k, uintptr_t v, uintptr_t out, const Layout& L,
                   const Visibility& V, double scale, double cap, uintptr_t sinks, int threads) {
    using A = typename Acc<T>::type;
    const int64_t D = L.dim, H = L.heads, KV = L.kv_heads;
    std::vector<A> qa(static_cast<size_t>(L.n * H * D));
    const T* x = ptr<const T>(qkv);
    const A* ct = ptr<const A>(cos);
    const A* st = ptr<const A>(sin);
    T* kc = ptr<T>(k);
    T* vc = ptr<T>(v);
#pragma omp parallel num_threads(threads)
    {
        std::vector<A> y(static_cast<size_t>(D));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < L.n; ++t) {
            const T* row = x + t * qkv_s0;
            const A* c = ct + positions[t] * D;
            const A* s = st + positions[t] * D;
            for (int64_t h = 0; h < H; ++h) rope(row + h * D, c, s, D, qa.data() + (t * H + h) * D);
            const int64_t block = slot[t] / BLOCK, lane = slot[t] % BLOCK;
            for (int64_t kh = 0; kh < KV; ++kh) {
                rope(row + (H + kh) * D, c, s, D, y.data());
                T* kd = kc + block * L.k_s0 + kh * L.k_s1;
                for (int64_t d = 0; d < D; ++d) store(kd + key_at(d, lane, D), y[d]);
                const T* vs = row + (H + KV + kh) * D;
                T* vd = vc + block * L.v_s0 + kh * L.v_s1 + lane * L.v_s2;
                for (int64_t d = 0; d < D; ++d) vd[d] = vs[d];
            }
        }
    }
    attention<T, A>(qa.data(), kc, vc, ptr<T>(out), L, V.qrow, V.prefix, V.estart, V.ecount, V.extra, V.origin,
                    V.table, V.t_s0, scale, cap, ptr<const A>(sinks), threads);
}

void rope_attend(int dtype, uintptr_t qkv, int64_t qkv_s0, uintptr_t cos, uintptr_t sin, uintptr_t positions,
                 uintptr_t slots, uintptr_t k, uintptr_t v, uintptr_t out, py::tuple shape, py::tuple strides,
                 py::tuple vis, double scale, double cap, uintptr_t sinks, int threads) {
    const Layout L = layout(shape, strides);
    const Visibility V = visibility(vis);
    auto* pos = ptr<const int64_t>(positions);
    auto* sl = ptr<const int64_t>(slots);
    py::gil_scoped_release release;
    if (dtype == 0) rope_attend_t<uint16_t>(qkv, qkv_s0, cos, sin, pos, sl, k, v, out, L, V, scale, cap, sinks,
                                            threads);
    else if (dtype == 1) rope_attend_t<float>(qkv, qkv_s0, cos, sin, pos, sl, k, v, out, L, V, scale, cap, sinks,
                                              threads);
    else rope_attend_t<double>(qkv, qkv_s0, cos, sin, pos, sl, k, v, out, L, V, scale, cap, sinks,
                               threads);
}

// RMS norm of each row of x [N, C] (row stride xs0) times w [C], in the accumulation type:
// sum of squares in LANES partials, then a fixed pairwise reduction (row-local: batch invariant).
template <typename T>
void rms_norm_t(uintptr_t xp, int64_t xs0, uintptr_t wp, uintptr_t outp, int64_t n, int64_t C, double eps,
                int threads) {
    using A = typename Acc<T>::type;
    const T* x = ptr<const T>(xp);
    const T* w = ptr<const T>(wp);
    T* out = ptr<T>(outp);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * C > 32768)
    for (int64_t r = 0; r < n; ++r) {
        const T* xr = x + r * xs0;
        A part[LANES] = {};
        int64_t c = 0;
        for (; c + LANES <= C; c += LANES)
#pragma omp simd
            for (int i = 0; i < LANES; ++i) part[i] += load(xr + c + i) * load(xr + c + i);
        for (int wdt = LANES / 2; wdt > 0; wdt /= 2)
            for (int i = 0; i < wdt; ++i) part[i] += part[i + wdt];
        A ss = part[0];
        for (; c < C; ++c) ss += load(xr + c) * load(xr + c);
        const A inv = A(1) / std::sqrt(ss / A(C) + A(eps));
        T* o = out + r * C;
#pragma omp simd
        for (int64_t i = 0; i < C; ++i) store(o + i, load(xr + i) * inv * load(w + i));
    }
}

void rms_norm(int dtype, uintptr_t x, int64_t xs0, uintptr_t w, uintptr_t out, int64_t n, int64_t C, double eps,
              int threads) {
    py::gil_scoped_release release;
    if (dtype == 0) rms_norm_t<uint16_t>(x, xs0, w, out, n, C, eps, threads);
    else if (dtype == 1) rms_norm_t<float>(x, xs0, w, out, n, C, eps, threads);
    else rms_norm_t<double>(x, xs0, w, out, n, C, eps, threads);
}

// The gated activations of an MLP: rows [gate | up] of x [N, 2I] (row stride xs0) -> act(gate)
// rounded to T, times up, rounded to T (PyTorch's F.silu(gate) * up, two roundings). A row is one
// thread's, and every element is the same expression of IEEE operations (fast_exp's polynomial
// and exponent bits, no library call for float), so the vectorised loop and its scalar remainder
// give the same bits: an element's result is its own, whatever its place in the batch or the
// thread count. (PyTorch's elementwise kernels compute an element by a vectorised or a scalar
// path by its place in the flattened tensor and the threads' split of it, and for SiLU and GELU
// the two are other algorithms, with other bits.) SiLU x / (1 + e^-x); GELU's tanh form.

// x rounded to T's precision (bfloat16: to nearest even, as store), kept in the accumulation type
template <typename T, typename A>
inline A rounded(A x) {
    if constexpr (std::is_same_v<T, uint16_t>) {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        std::memcpy(&x, &u, 4);
    }
    return x;
}

template <typename A>
inline A silu(A x) { return x / (A(1) + fast_exp(-x)); }

template <typename A>
inline A gelu_tanh(A x) {                      // 0.5 x (1 + tanh(u)) = x / (1 + e^-2u): no cancellation
    const A u = A(0.7978845608028654) * (x + A(0.044715) * x * x * x);
    return x / (A(1) + fast_exp(A(-2) * u));
}

template <typename T, int KIND>
void act_mul_t(uintptr_t xp, int64_t xs0, uintptr_t outp, int64_t n, int64_t I, int threads) {
    const T* x = ptr<const T>(xp);
    T* out = ptr<T>(outp);
    using A = typename Acc<T>::type;
#pragma omp parallel num_threads(threads) if (n * I > 32768)
    {
        std::vector<A> buf(I);                              // one row's activations, in A
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            const T* g = x + r * xs0;
            const T* u = g + I;
            T* o = out + r * I;
            A* a = buf.data();
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) a[i] = load(g + i);
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) a[i] = rounded<T>(KIND == 0 ? silu(a[i]) : gelu_tanh(a[i]));
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) store(o + i, a[i] * load(u + i));
        }
    }
}

void act_mul(int dtype, int kind, uintptr_t x, int64_t xs0, uintptr_t out, int64_t n, int64_t I, int threads) {
    py::gil_scoped_release release;
    if (kind == 0) {
        if (dtype == 0) act_mul_t<uint16_t, 0>(x, xs0, out, n, I, threads);
        else if (dtype == 1) act_mul_t<float, 0>(x, xs0, out, n, I, threads);
        else act_mul_t<double, 0>(x, xs0, out, n, I, threads);
    } else {
        if (dtype == 0) act_mul_t<uint16_t, 1>(x, xs0, out, n, I, threads);
        else if (dtype == 1) act_mul_t<float, 1>(x, xs0, out, n, I, threads);
        else act_mul_t<double, 1>(x, xs0, out, n, I, threads);
    }
}

// gpt-oss's clamped SwiGLU of rows [gate | up]: gate clamped above at limit, up to [-limit, limit],
// then (up + 1) * gate * sigmoid(alpha * gate), each operation rounded to T as PyTorch's chain of
// bfloat16 operations rounds it (alpha * gate, the sigmoid, the product, up + 1, the result).
// Every element by the same code, as act_mul's.
template <typename T>
void swiglu_clamped_t(uintptr_t xp, int64_t xs0, uintptr_t outp, int64_t n, int64_t I, double alpha_,
                      double limit_, int threads) {
    const T* x = ptr<const T>(xp);
    T* out = ptr<T>(outp);
    using A = typename Acc<T>::type;
    const A alpha = static_cast<A>(alpha_), limit = static_cast<A>(limit_);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * I > 32768)
    for (int64_t r = 0; r < n; ++r) {
        const T* g = x + r * xs0;
        const T* u = g + I;
        T* o = out + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
            const A gi = std::min(load(g + i), limit);
            const A ui = std::min(std::max(load(u + i), -limit), limit);
            const A t = rounded<T>(gi * alpha);
            const A sg = rounded<T>(A(1) / (A(1) + fast_exp(-t)));
            const A glu = rounded<T>(gi * sg);
            store(o + i, rounded<T>(ui + A(1)) * glu);
        }
    }
}

void swiglu_clamped(int dtype, uintptr_t x, int64_t xs0, uintptr_t out, int64_t n, int64_t I, double alpha,
                    double limit, int threads) {
    py::gil_scoped_release release;
    if (dtype == 0) swiglu_clamped_t<uint16_t>(x, xs0, out, n, I, alpha, limit, threads);
    else if (dtype == 1) swiglu_clamped_t<float>(x, xs0, out, n, I, alpha, limit, threads);
    else swiglu_clamped_t<double>(x, xs0, out, n, I, alpha, limit, threads);
}

// ---- Gated DeltaNet (Qwen3.5's linear attention, model/deltanet.py) --------------------------
// A step's rows: seqs [S, 6] (state row, first flat token, tokens, committed tokens, fresh,
// snapshot), a row's tokens consecutive and in order, its committed tokens first, then the nodes
// of a chain draft. A committed token advances the row's states in place (its causal conv's last
// K-1 inputs, conv [R, 2, C, K-1]; its delta-rule state ssm [R, 2, VH, DK, DV]; index 0 of the
// second dimension: the states, 1: their snapshot); a draft node advances a copy, so the row's
// states stay those of its committed tokens; ``fresh``: the states start from zeros (the row's
// first token is position 0); ``snapshot`` > 0: the states after that many of its tokens are
// copied to the snapshot (a prompt's, which its siblings start from). A (row, value head) is one
// task: its conv over its key head's q and k channels and its v channels, then the rule; the conv
// states are written after every task has read the old ones. Every token is computed by the same
// code whatever the step holds (a draft node and the same token committed give the same bits):
// a row's result is its own.

// softplus as PyTorch's (threshold 20: x itself above)
template <typename A>
inline A softplus(A x) { return x > A(20) ? x : std::log1p(std::exp(x)); }

// One token through one value head's state S [DK][DV]: decayed, its memory of k corrected
// towards v by beta, read by q: o [DV]. Out of line, so a committed token and a draft node run
// the same instructions.
template <typename A>
__attribute__((noinline)) void delta_step(A* S, const A* k, const A* q, const A* v, A decay, A beta, int64_t DK,
                                          int64_t DV, A* o, A* mem) {
    for (int64_t j = 0; j < DV; ++j) mem[j] = A(0);
    for (int64_t i = 0; i < DK; ++i) {
        A* s = S + i * DV;
        const A ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < DV; ++j) {
            s[j] *= decay;
            mem[j] += s[j] * ki;
        }
    }
    for (int64_t j = 0; j < DV; ++j) mem[j] = (v[j] - mem[j]) * beta;
    for (int64_t j = 0; j < DV; ++j) o[j] = A(0);
    for (int64_t i = 0; i < DK; ++i) {
        A* s = S + i * DV;
        const A ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < DV; ++j) {
            s[j] += ki * mem[j];
            o[j] += s[j] * qi;
        }
    }
}

// x [n] scaled to unit L2 norm (eps 1e-6 inside the root, as Hugging Face's l2norm), times f
template <typename A>
inline void unit(const A* x, int64_t n, A f, A* y) {
    A ss = A(0);
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const A inv = A(1) / std::sqrt(ss + A(1e-6));
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * f;
}

struct DeltaShape {
    int64_t KH, VH, DK, DV, K, C;
};

// A row's causal conv for n channels at one token: each output the conv over its K-1 window
// (oldest first) and the token's input x, rounded to T, SiLU, rounded to T (Hugging Face: a conv
// in the model's dtype, then its activation); the windows shift in x. Windows and weights tap by
// tap (win[k * n + i], wt[k * n + i]: ``load_conv``), so each step runs over adjacent channels.
template <typename T, typename A>
inline void conv_step(const T* x, const A* wt, int64_t n, int64_t K, A* win, A* y) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = A(0);
    for (int64_t k = 0; k < K - 1; ++k)
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) y[i] += wt[k * n + i] * win[k * n + i];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const A xi = load(x + i);
        y[i] += wt[(K - 1) * n + i] * xi;
        y[i] = rounded<T>(silu(rounded<T>(y[i])));
    }
    for (int64_t k = 0; k + 1 < K - 1; ++k)
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) win[k * n + i] = win[(k + 1) * n + i];
    if (K > 1)
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) win[(K - 2) * n + i] = load(x + i);
}

// Channels [c0, c0 + n)'s conv weights (w [C, K]) and windows (a row's states st [C, K-1], or
// fresh: zeros), tap by tap into wt and win (``conv_step``).
template <typename T, typename A>
inline void load_conv(const T* w, const T* st, bool fresh, int64_t c0, int64_t n, int64_t K, A* wt, A* win) {
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t k = 0; k < K; ++k) wt[k * n + i] = load(w + (c0 + i) * K + k);
        for (int64_t k = 0; k < K - 1; ++k) win[k * n + i] = fresh ? A(0) : A(load(st + (c0 + i) * (K - 1) + k));
    }
}

// After the rule: each (row, channel)'s conv state becomes the last K-1 inputs among its window
// and the row's committed tokens; its snapshot those after ``snap`` tokens (plain data moves:
// the windows the rule read were the old ones, so none of them changes under it).
template <typename T>
void conv_states(const T* mixed, int64_t ms0, T* conv, const int64_t* seqs, int64_t S, const DeltaShape& d,
                 int threads) {
    const int64_t chunks = (d.C + 63) / 64, K = d.K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < S * chunks; ++task) {
        const int64_t* sq = seqs + (task / chunks) * 6;
        const int64_t row = sq[0], t0 = sq[1], done = sq[3], snap = sq[5];
        const int64_t c0 = (task % chunks) * 64, c1 = std::min(d.C, c0 + 64);
        T* st = conv + row * 2 * d.C * (K - 1);
        for (int64_t c = c0; c < c1; ++c) {
            for (const auto& [upto, dst] : {std::pair<int64_t, T*>{snap, st + (d.C + c) * (K - 1)},
                                            std::pair<int64_t, T*>{done, st + c * (K - 1)}}) {
                if (upto <= 0) continue;                  // (the snapshot first: it reads the old window too)
                for (int64_t k = 0; k < K - 1; ++k) {    // input k of the window after ``upto`` tokens
                    const int64_t j = upto - (K - 1) + k;
                    dst[k] = j >= 0 ? mixed[(t0 + j) * ms0 + c]
                                    : (sq[4] ? T(0) : st[c * (K - 1) + (K - 1) + j]);
                }
            }
        }
    }
}

template <typename T>
void delta_rule_t(uintptr_t mixedp, int64_t ms0, uintptr_t bp, uintptr_t ap, int64_t bs0, uintptr_t wp,
                  uintptr_t negap, uintptr_t dtbp, uintptr_t convp, uintptr_t ssmp, uintptr_t seqsp, int64_t S,
                  int64_t N, uintptr_t outp, const DeltaShape& d, int threads) {
    using A = typename Acc<T>::type;
    (void)N;
    const int64_t* seqs = ptr<const int64_t>(seqsp);
    const T* mixed = ptr<const T>(mixedp);
    const T* w = ptr<const T>(wp);
    const T* conv = ptr<const T>(convp);
    const T* b = ptr<const T>(bp);
    const T* a = ptr<const T>(ap);
    const A* nega = ptr<const A>(negap);
    const A* dtb = ptr<const A>(dtbp);
    A* ssm = ptr<A>(ssmp);
    T* out = ptr<T>(outp);
    const int64_t group = d.VH / d.KH, DK = d.DK, DV = d.DV, K = d.K;
    const A qf = A(1) / std::sqrt(A(DK));
#pragma omp parallel num_threads(threads)
    {
        std::vector<A> scratch(static_cast<size_t>(DK * DV)), buf(static_cast<size_t>(4 * DK + 3 * DV));
        std::vector<A> taps(static_cast<size_t>((2 * DK + DV) * (2 * K - 1)));
        A *kn = buf.data(), *qn = kn + DK, *o = qn + DK, *mem = o + DV, *y = mem + DV;   // y: q | k | v
        A *wq = taps.data(), *wk = wq + DK * K, *wv = wk + DK * K;                       // weights, then windows
        A *iq = wv + DV * K, *ik = iq + DK * (K - 1), *iv = ik + DK * (K - 1);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < S * d.VH; ++task) {
            const int64_t* sq = seqs + (task / d.VH) * 6;
            const int64_t row = sq[0], t0 = sq[1], cnt = sq[2], done = sq[3], vh = task % d.VH, kh = vh / group;
            const int64_t cq = kh * DK, ck = d.KH * DK + kh * DK, cv = 2 * d.KH * DK + vh * DV;
            const T* cst = conv + row * 2 * d.C * (K - 1);
            load_conv(w, cst, sq[4] != 0, cq, DK, K, wq, iq);
            load_conv(w, cst, sq[4] != 0, ck, DK, K, wk, ik);
            load_conv(w, cst, sq[4] != 0, cv, DV, K, wv, iv);
            A* state = ssm + (row * 2 * d.VH + vh) * DK * DV;
            A* snapshot = state + d.VH * DK * DV;
            if (sq[4]) std::fill(state, state + DK * DV, A(0));
            A* st = state;
            for (int64_t j = 0; j < cnt; ++j) {
                const int64_t t = t0 + j;
                if (j == done) {                       // the first draft node: on a copy from here on
                    std::copy(state, state + DK * DV, scratch.data());
                    st = scratch.data();
                }
                const T* xt = mixed + t * ms0;
                conv_step<T, A>(xt + cq, wq, DK, K, iq, y);
                conv_step<T, A>(xt + ck, wk, DK, K, ik, y + DK);
                conv_step<T, A>(xt + cv, wv, DV, K, iv, y + 2 * DK);
                unit(y, DK, qf, qn);
                unit(y + DK, DK, A(1), kn);
                const A beta = rounded<T>(A(1) / (A(1) + std::exp(-A(load(b + t * bs0 + vh)))));
                const A g = nega[vh] * softplus(A(load(a + t * bs0 + vh)) + dtb[vh]);
                delta_step(st, kn, qn, y + 2 * DK, std::exp(g), beta, DK, DV, o, mem);
                if (j + 1 == sq[5]) std::copy(state, state + DK * DV, snapshot);
                if (out != nullptr)
                    for (int64_t i = 0; i < DV; ++i) store(out + t * d.VH * DV + vh * DV + i, o[i]);
            }
        }
    }
    conv_states<T>(mixed, ms0, ptr<T>(convp), seqs, S, d, threads);   // after every task read the old windows
}

void delta_rule(int dtype, uintptr_t mixed, int64_t ms0, uintptr_t b, uintptr_t a, int64_t bs0, uintptr_t w,
                uintptr_t nega, uintptr_t dtb, uintptr_t conv, uintptr_t ssm, uintptr_t seqs, int64_t S, int64_t N,
                uintptr_t out, py::tuple shape, int threads) {
    DeltaShape d{shape[0].cast<int64_t>(), shape[1].cast<int64_t>(), shape[2].cast<int64_t>(),
                 shape[3].cast<int64_t>(), shape[4].cast<int64_t>(), 0};
    d.C = 2 * d.KH * d.DK + d.VH * d.DV;
    if (d.K < 1 || d.K > 17) throw std::invalid_argument("delta_rule: conv width must be in [1, 17]");
    py::gil_scoped_release release;
    if (dtype == 0) delta_rule_t<uint16_t>(mixed, ms0, b, a, bs0, w, nega, dtb, conv, ssm, seqs, S, N, out, d, threads);
    else if (dtype == 1) delta_rule_t<float>(mixed, ms0, b, a, bs0, w, nega, dtb, conv, ssm, seqs, S, N, out, d, threads);
    else delta_rule_t<double>(mixed, ms0, b, a, bs0, w, nega, dtb, conv, ssm, seqs, S, N, out, d, threads);
}

// The DeltaNet's gated RMS norm: each head's DV values of o [N, H * DV] normed (in A, rounded to
// T), times w [DV] (rounded), times SiLU of z (row stride zs0) -> out [N, H * DV] (Hugging Face's
// Qwen3_5RMSNormGated).
template <typename T>
void gated_norm_t(uintptr_t op, uintptr_t zp, int64_t zs0, uintptr_t wp, uintptr_t outp, int64_t n, int64_t H,
                  int64_t DV, double eps, int threads) {
    using A = typename Acc<T>::type;
    const T* o = ptr<const T>(op);
    const T* z = ptr<const T>(zp);
    const T* w = ptr<const T>(wp);
    T* out = ptr<T>(outp);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * H * DV > 32768)
    for (int64_t r = 0; r < n * H; ++r) {
        const int64_t t = r / H, h = r % H;
        const T* x = o + r * DV;
        A ss = A(0);
        for (int64_t i = 0; i < DV; ++i) ss += A(load(x + i)) * A(load(x + i));
        const A inv = A(1) / std::sqrt(ss / A(DV) + A(eps));
        const T* zt = z + t * zs0 + h * DV;
        for (int64_t i = 0; i < DV; ++i) {
            const A y = rounded<T>(rounded<T>(A(load(x + i)) * inv) * A(load(w + i)));
            store(out + r * DV + i, y * silu(A(load(zt + i))));
        }
    }
}

void gated_norm(int dtype, uintptr_t o, uintptr_t z, int64_t zs0, uintptr_t w, uintptr_t out, int64_t n, int64_t H,
                int64_t DV, double eps, int threads) {
    py::gil_scoped_release release;
    if (dtype == 0) gated_norm_t<uint16_t>(o, z, zs0, w, out, n, H, DV, eps, threads);
    else if (dtype == 1) gated_norm_t<float>(o, z, zs0, w, out, n, H, DV, eps, threads);
    else gated_norm_t<double>(o, z, zs0, w, out, n, H, DV, eps, threads);
}

}  // namespace

PYBIND11_MODULE(_attention, m) {
    m.doc() = "Row attention over a paged KV cache, and the fused steps around it (see tailrl/kernels/cpu.py)";
    m.def("attend", &attend, "dtype (0 bf16, 1 f32, 2 f64), q, k, v, out pointers, shape (N, H, KV, D), "
          "strides, visibility (row, prefix, extra start, extra count, extras, block table pointers; the "
          "table's row stride; origins or 0), scale, soft cap (0: none), sinks [H] in the accumulation type (0: none), "
          "threads");
    m.def("rope_attend", &rope_attend, "dtype, qkv pointer and row stride, cos, sin, positions, write slots, "
          "k, v, out, shape, strides, visibility, scale, soft cap, sinks, threads");
    m.def("rms_norm", &rms_norm, "dtype, x pointer and row stride, weight, out, rows, columns, eps, threads");
    m.def("act_mul", &act_mul, "dtype, kind (0 SiLU, 1 GELU tanh), [gate | up] pointer and row stride, out, "
          "rows, I, threads");
    m.def("swiglu_clamped", &swiglu_clamped, "dtype, [gate | up] pointer and row stride, out, rows, I, alpha, "
          "limit, threads (gpt-oss's activation)");
    m.def("delta_rule", &delta_rule, "dtype, mixed q|k|v pointer and row stride, b, a pointers and row stride, "
          "conv weight, -exp(A_log), dt_bias (accumulation type), conv states, delta-rule states, seqs [S, 6], S, "
          "tokens, out (0: none), shape (KH, VH, DK, DV, K), threads");
    m.def("gated_norm", &gated_norm, "dtype, o, z pointer and row stride, weight, out, tokens, heads, DV, eps, "
          "threads");
}
