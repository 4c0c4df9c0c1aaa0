// A row-invariant bfloat16 matmul: Y[M, N] = X[M, K] W[N, K]^T (+ b[N]), float accumulation.
//
// Why: a token is identical with and without speculation only if a row's logits come out the
// same bits whatever else is in the step. oneDNN's bfloat16 GEMM is row-invariant on CPUs with
// native bfloat16 dot products (AVX512-BF16, AMX), but not on AVX512 CPUs without them, where
// its blocking over K changes with M (measured: rows differ at most M >= 2 for every shape of
// a 0.5B model). Here the arithmetic of one output element is fixed by construction:
//
//   Y[m, n] = bf16( reduce( acc ) + b[n] ),  acc[l] over 16 lanes:
//     for each chunk c of 32 positions of K, in order c = 0, 1, ...:
//       acc[l] = fma(w[n, 32c + 2l],     x[m, 32c + 2l],     acc[l])
//       acc[l] = fma(w[n, 32c + 2l + 1], x[m, 32c + 2l + 1], acc[l])
//     (positions past K read as 0), then a fixed pairwise reduction of the 16 lanes.
//
// Nothing in it depends on M, on the tile the element falls in, or on the thread that computes
// it. The even/odd split is what makes bfloat16 cheap to widen: 32 weights are one 64-byte
// load, the even ones a 16-bit shift away from float, the odd ones a mask away (as the
// attention kernel widens values). X is widened once, into the same even/odd order.
//
// Tiles: MR rows of X by NR rows of W in registers (MR x NR accumulators), all of K per tile;
// threads split N (the weight panel each reads once), then M. A portable path (no AVX512F/BW)
// computes the same definition lane by lane, to the same bits.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TAILRL_GEMM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TAILRL_GEMM_AVX2 1
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

namespace {

constexpr int LANES = 16;
constexpr int CHUNK = 2 * LANES;     // K positions per step of the reduction

inline float bf16_to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {        // round to nearest even (NaN stays NaN)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// The fixed reduction of N lanes: halves added pairwise (16 lanes: 8 + 8, 4 + 4, 2 + 2, 1 + 1).
template <typename T, int N = LANES>
inline T reduce_lanes(const T* a) {
    T t[N];
    for (int i = 0; i < N; ++i) t[i] = a[i];
    for (int w = N / 2; w > 0; w /= 2)
        for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
    return t[0];
}

// X rows widened to float in the kernel's order: per chunk, the 16 even positions, then the
// 16 odd ones; K padded with zeros to whole chunks. [M, chunks * CHUNK].
void widen_x(const uint16_t* x, int64_t xs, int64_t M, int64_t K, float* out, int64_t chunks) {
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = x + m * xs;
        float* o = out + m * chunks * CHUNK;
        for (int64_t c = 0; c < chunks; ++c)
            for (int l = 0; l < LANES; ++l) {
                const int64_t k = c * CHUNK + 2 * l;
                o[c * CHUNK + l] = k < K ? bf16_to_float(xr[k]) : 0.0f;
                o[c * CHUNK + LANES + l] = k + 1 < K ? bf16_to_float(xr[k + 1]) : 0.0f;
            }
    }
}

#ifdef TAILRL_GEMM_AVX512
// MR x NR outputs over all of K. xw: widened X rows (row stride xws floats); w: W rows (stride ws).
template <int MR, int NR>
inline void tile(const float* xw, int64_t xws, const uint16_t* w, int64_t ws, int64_t K, int64_t chunks,
                 float out[MR][NR]) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const int64_t full = K / CHUNK;
    for (int64_t c = 0; c < chunks; ++c) {
        __m512 we[NR], wo[NR];
        for (int j = 0; j < NR; ++j) {
            const uint16_t* p = w + j * ws + c * CHUNK;
            const __m512i v = c < full ? _mm512_loadu_si512(p)
                                       : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << (K - c * CHUNK)) - 1), p);
            we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int i = 0; i < MR; ++i) {
            const __m512 xe = _mm512_loadu_ps(xw + i * xws + c * CHUNK);
            const __m512 xo = _mm512_loadu_ps(xw + i * xws + c * CHUNK + LANES);
            for (int j = 0; j < NR; ++j) {
                acc[i][j] = _mm512_fmadd_ps(we[j], xe, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(wo[j], xo, acc[i][j]);
            }
        }
    }
    alignas(64) float lanes[LANES];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            _mm512_store_ps(lanes, acc[i][j]);
            out[i][j] = reduce_lanes<float>(lanes);
        }
}
#elif defined(TAILRL_GEMM_AVX2)
// The same definition on AVX2 + FMA: a lane set is two 8-float registers (lanes 0-7, 8-15), each
// lane's multiply-adds the same fused operations in the same order, so the same bits as the
// AVX512 path and the lane-by-lane one. A chunk's 32 weights are two 32-byte loads (a last,
// partial chunk is copied into zeros first: AVX2 has no 16-bit masked load). On an AVX2-only
// CPU 6-19x faster than the lane-by-lane path, which the compiler does not vectorise.
template <int MR, int NR>
inline void tile(const float* xw, int64_t xws, const uint16_t* w, int64_t ws, int64_t K, int64_t chunks,
                 float out[MR][NR]) {
    __m256 acc[MR][NR][2];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const int64_t full = K / CHUNK;
    alignas(32) uint16_t last[CHUNK];
    for (int64_t c = 0; c < chunks; ++c) {
        for (int j = 0; j < NR; ++j) {
            const uint16_t* p = w + j * ws + c * CHUNK;
            if (c >= full) {
                std::memset(last, 0, sizeof(last));
                std::memcpy(last, p, static_cast<size_t>(K - c * CHUNK) * 2);
                p = last;
            }
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + h * LANES));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int i = 0; i < MR; ++i) {
                    const float* xr = xw + i * xws + c * CHUNK + h * 8;
                    acc[i][j][h] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xr), acc[i][j][h]);
                    acc[i][j][h] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xr + LANES), acc[i][j][h]);
                }
            }
        }
    }
    alignas(32) float lanes[LANES];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            _mm256_store_ps(lanes, acc[i][j][0]);
            _mm256_store_ps(lanes + 8, acc[i][j][1]);
            out[i][j] = reduce_lanes<float>(lanes);
        }
}
#else
// The same definition, lane by lane (one multiply-add per step, never contracted differently:
// std::fma is the fused operation the AVX512 path uses).
template <int MR, int NR>
inline void tile(const float* xw, int64_t xws, const uint16_t* w, int64_t ws, int64_t K, int64_t chunks,
                 float out[MR][NR]) {
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            float acc[LANES] = {};
            const uint16_t* wr = w + j * ws;
            const float* xr = xw + i * xws;
            for (int64_t c = 0; c < chunks; ++c)
                for (int l = 0; l < LANES; ++l) {
                    const int64_t k = c * CHUNK + 2 * l;
                    const float we = k < K ? bf16_to_float(wr[k]) : 0.0f;
                    const float wo = k + 1 < K ? bf16_to_float(wr[k + 1]) : 0.0f;
                    acc[l] = std::fma(we, xr[c * CHUNK + l], acc[l]);
                    acc[l] = std::fma(wo, xr[c * CHUNK + LANES + l], acc[l]);
                }
            out[i][j] = reduce_lanes<float>(acc);
        }
}
#endif

template <int MR, int NR>
inline void store_tile(const float t[MR][NR], const uint16_t* b, uint16_t* y, int64_t ys, int64_t m0, int64_t n0) {
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            const float v = b ? t[i][j] + bf16_to_float(b[n0 + j]) : t[i][j];
            y[(m0 + i) * ys + n0 + j] = float_to_bf16(v);
        }
}

#ifdef TAILRL_GEMM_AVX2
// 4 rows of X by 1 of W: 8 accumulator registers of AVX2's 16 (4 x 4 needs 32 and spills);
// measured fastest of 4x1, 2x2, 3x2 and 4x2 on an AVX2-only EPYC (2026-11-28)
constexpr int MR = 4;
constexpr int NR = 1;
#else
constexpr int MR = 4;
constexpr int NR = 4;
#endif

// Rows [m0, m1) against W rows [n0, n1): full MR x NR tiles, then the edges.
template <int R>
inline void rows_block(const float* xw, int64_t xws, const uint16_t* w, int64_t ws, const uint16_t* b, uint16_t* y,
                       int64_t ys, int64_t K, int64_t chunks, int64_t m0, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
        float t[R][NR];
        tile<R, NR>(xw + m0 * xws, xws, w + n * ws, ws, K, chunks, t);
        store_tile<R, NR>(t, b, y, ys, m0, n);
    }
    for (; n < n1; ++n) {
        float t[R][1];
        tile<R, 1>(xw + m0 * xws, xws, w + n * ws, ws, K, chunks, t);
        store_tile<R, 1>(t, b, y, ys, m0, n);
    }
}

void block(const float* xw, int64_t xws, const uint16_t* w, int64_t ws, const uint16_t* b, uint16_t* y, int64_t ys,
           int64_t K, int64_t chunks, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) rows_block<MR>(xw, xws, w, ws, b, y, ys, K, chunks, m, n0, n1);
    for (; m < m1; ++m) rows_block<1>(xw, xws, w, ws, b, y, ys, K, chunks, m, n0, n1);
}

// pointers as integers (torch tensors' data_ptr); the Python side checks shapes and dtypes
void linear(uintptr_t x, int64_t xs, uintptr_t w, int64_t ws, uintptr_t bias, uintptr_t y, int64_t ys, int64_t M,
            int64_t N, int64_t K, int threads) {
    const int64_t chunks = (K + CHUNK - 1) / CHUNK;
    py::gil_scoped_release release;
    std::vector<float> xw(static_cast<size_t>(std::max<int64_t>(M, 1) * chunks * CHUNK));
    widen_x(reinterpret_cast<const uint16_t*>(x), xs, M, K, xw.data(), chunks);
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    // Work items: panels of N (a panel's weights, ~256 KB, stay in L2 while every row block
    // of X passes over them) by blocks of M rows. The split changes no output's arithmetic.
    const int64_t panel = std::max<int64_t>(NR, (256 * 1024 / std::max<int64_t>(2 * K, 1)) / NR * NR);
    const int64_t mblock = 64;
    const int64_t np = (N + panel - 1) / panel, mb = (M + mblock - 1) / mblock;
    const int64_t xws = chunks * CHUNK;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) collapse(2) if (np * mb > 1)
    for (int64_t p = 0; p < np; ++p)
        for (int64_t q = 0; q < mb; ++q)
            block(xw.data(), xws, wp, ws, bp, yp, ys, K, chunks, q * mblock, std::min(M, (q + 1) * mblock),
                  p * panel, std::min(N, (p + 1) * panel));
}

// ---- float64: the same idea in double, for exactness checks --------------------------------
//
//   Y[m, n] = reduce( acc ) + b[n],  acc[l] over 8 lanes:
//     for each chunk c of 8 positions of K, in order: acc[l] = fma(w[n, 8c + l], x[m, 8c + l], acc[l])
//     (positions past K read as 0), then halves added pairwise, 4 + 4, 2 + 2, 1 + 1.
//
// PyTorch's float64 product (MKL's dgemm on this machine) changes a row's bits with the number
// of rows (from one row to two and beyond, at K = 896) and with the number of threads; this one
// depends on neither. Written lane by lane with std::fma: the compiler may vectorise the lanes,
// never reorder a lane's sum.
constexpr int DLANES = 8;

template <int R>
inline void dtile(const double* xp, int64_t xps, const double* w, int64_t ws, const double* b, double* y, int64_t ys,
                  int64_t K, int64_t chunks, int64_t m0, int64_t n) {
    double acc[R][DLANES] = {};
    const double* wr = w + n * ws;
    const int64_t full = K / DLANES;
    for (int64_t c = 0; c < chunks; ++c) {
        double wl[DLANES];
        for (int l = 0; l < DLANES; ++l) {
            const int64_t k = c * DLANES + l;
            wl[l] = (c < full || k < K) ? wr[k] : 0.0;
        }
        for (int i = 0; i < R; ++i) {
            const double* xr = xp + (m0 + i) * xps + c * DLANES;
            for (int l = 0; l < DLANES; ++l) acc[i][l] = std::fma(wl[l], xr[l], acc[i][l]);
        }
    }
    for (int i = 0; i < R; ++i) {
        const double v = reduce_lanes<double, DLANES>(acc[i]);
        y[(m0 + i) * ys + n] = b ? v + b[n] : v;
    }
}

void linear_f64(uintptr_t x, int64_t xs, uintptr_t w, int64_t ws, uintptr_t bias, uintptr_t y, int64_t ys,
                int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t chunks = (K + DLANES - 1) / DLANES, xps = chunks * DLANES;
    py::gil_scoped_release release;
    std::vector<double> xp(static_cast<size_t>(std::max<int64_t>(M, 1) * xps), 0.0);   // X, K padded with zeros
    const auto* xr = reinterpret_cast<const double*>(x);
    for (int64_t m = 0; m < M; ++m) std::memcpy(xp.data() + m * xps, xr + m * xs, static_cast<size_t>(K) * 8);
    const auto* wp = reinterpret_cast<const double*>(w);
    const auto* bp = reinterpret_cast<const double*>(bias);
    auto* yp = reinterpret_cast<double*>(y);
#pragma omp parallel for num_threads(threads) schedule(static) if (N > 1)
    for (int64_t n = 0; n < N; ++n) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) dtile<4>(xp.data(), xps, wp, ws, bp, yp, ys, K, chunks, m, n);
        for (; m < M; ++m) dtile<1>(xp.data(), xps, wp, ws, bp, yp, ys, K, chunks, m, n);
    }
}

}  // namespace

PYBIND11_MODULE(_gemm, m) {
    m.doc() = "Row-invariant bfloat16 and float64 matmuls (see _gemm.cpp)";
    m.def("linear", &linear, "x, x row stride, w, w row stride, bias (bfloat16, 0 = none), y, y row stride, M, N, K, "
          "threads: y = x w^T + bias in bfloat16 with float accumulation in a fixed order");
    m.def("linear_f64", &linear_f64, "the same arguments, float64: y = x w^T + bias, each element's sum in a fixed order");
}
