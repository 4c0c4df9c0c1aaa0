// The bfloat16 fast path of _attention.cpp: block kernels on AVX512-BF16 pair dot products.
// Included by _attention.cpp inside its anonymous namespace, after BLOCK, Query and
// softmax_block; without AVX512-BF16 it defines the stubs the generic path never calls.
#pragma once
#ifdef __AVX512BF16__
constexpr bool HAVE_BF16_DOT = true;
// GCC 12's headers leave an "undefined" operand of the shift intrinsic uninitialised on purpose
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Scores of one bfloat16 block in the cache's own layout ([D/2][BLOCK][2]): per pair of
// dimensions, one dot-product-of-pairs per 16 keys, in two chains (even and odd pairs).
inline void block_scores_bf16(const uint32_t* qp, const uint16_t* kb, int64_t D, float* s) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t i = 0; i < D / 2; i += 2) {
        const __m512bh q0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i]));
        const __m512bh q1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i + 1]));
        const uint16_t* k0 = kb + i * 2 * BLOCK;
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(k0), q0);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(k0 + 32), q0);
        b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(k0 + 2 * BLOCK), q1);
        b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(k0 + 2 * BLOCK + 32), q1);
    }
    _mm512_store_ps(s, _mm512_add_ps(a0, b0));
    _mm512_store_ps(s + 16, _mm512_add_ps(a1, b1));
}

// acc = acc * c + sum_j p[j] v[j] for bfloat16 value rows v[j], 32 dimensions per load: the even
// ones widened by a shift, the odd ones by a mask (acc holds them in that order), two chains.
inline void weigh_values_bf16(float* acc, float c, const float* p, const uint16_t* const* v, int64_t nb,
                              int64_t D) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 cc = _mm512_set1_ps(c);
    for (int64_t g = 0; g < D; g += 32) {
        __m512 e0 = _mm512_setzero_ps(), o0 = e0, e1 = e0, o1 = e0;
        int64_t j = 0;
        for (; j + 2 <= nb; j += 2) {
            const __m512i x0 = _mm512_loadu_si512(v[j] + g);
            const __m512i x1 = _mm512_loadu_si512(v[j + 1] + g);
            const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
            e0 = _mm512_fmadd_ps(p0, _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)), e0);
            o0 = _mm512_fmadd_ps(p0, _mm512_castsi512_ps(_mm512_and_si512(x0, high)), o0);
            e1 = _mm512_fmadd_ps(p1, _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)), e1);
            o1 = _mm512_fmadd_ps(p1, _mm512_castsi512_ps(_mm512_and_si512(x1, high)), o1);
        }
        if (j < nb) {
            const __m512i x0 = _mm512_loadu_si512(v[j] + g);
            const __m512 p0 = _mm512_set1_ps(p[j]);
            e0 = _mm512_fmadd_ps(p0, _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)), e0);
            o0 = _mm512_fmadd_ps(p0, _mm512_castsi512_ps(_mm512_and_si512(x0, high)), o0);
        }
        float* a = acc + g;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), cc, _mm512_add_ps(e0, e1)));
        _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16), cc, _mm512_add_ps(o0, o1)));
    }
}

inline void block_update_bf16(Query<float>& st, const uint16_t* kb, const uint16_t* const* v, int64_t lo,
                              int64_t nb, int64_t D) {
    alignas(64) float s[BLOCK];
    alignas(64) float p[BLOCK];
    block_scores_bf16(st.qp, kb, D, s);
    const float c = softmax_block(st, s, lo, nb, p);
    weigh_values_bf16(st.acc, c, p + lo, v + lo, nb - lo, D);
}
#else
constexpr bool HAVE_BF16_DOT = false;
inline void block_update_bf16(Query<float>&, const uint16_t*, const uint16_t* const*, int64_t, int64_t,
                              int64_t) {}
#endif
