// AVX-512 helpers shared by the engine's kernels: 16 fp32 lanes from fp32 or bf16 memory and back, tail masks, exp.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace whiflash {

// 16 elements from p (masked past the end) as fp32
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {   // bf16 bits
  __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::BFloat16* p, __mmask16 m) { return load16(reinterpret_cast<const uint16_t*>(p), m); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {   // rounded to bf16 (nearest even)
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) { store16(reinterpret_cast<uint16_t*>(p), v, m); }
// v rounded to bf16 (nearest even), as fp32
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
// the lanes of a 16-wide step with `left` elements to go
inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

// n elements of `buffer` from a 64-byte boundary, so that a tile's rows start cache lines (a heap block is only
// 16-byte aligned, and AMX tile loads of rows split across lines are slower: a 16-row verify step of SmolLM2 took
// 1.23-1.31x a decode step from process to process, 1.22-1.26x with its GEMM's buffer aligned; linear_bf16.cpp)
template <typename T>
inline T* aligned64(std::vector<T>& buffer, size_t n) {
  buffer.resize(n + 64 / sizeof(T));
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (64 - at % 64) % 64 / sizeof(T);
}

// exp of 16 lanes (Cephes' expf polynomial, ~1 ulp; lanes below -87 give 0): p * 2^n, x = n ln2 + r, |r| <= ln2/2.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace whiflash
