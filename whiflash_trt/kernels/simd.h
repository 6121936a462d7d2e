// The vector layer the engine's kernels are written over, one source for every instruction set they are built for
// (kernels/build.py compiles the library once per ISA): Vec is kLanes fp32 lanes, 16 in an AVX-512 build (zmm), 8
// in an AVX2 build (ymm); loads from fp32 and bf16 memory and stores back, with a tail count; lane-wise arithmetic,
// compares and selects (Mask), exp, and horizontal reductions in one fixed order per build.
//
// bf16 rounding: to nearest even as torch rounds fp32 -> bf16 (c10::BFloat16: a NaN stays a NaN), in integer ops,
// except in a build with AVX-512 BF16, where VCVTNEPS2BF16 does it (the same bits but for subnormals, which it
// flushes to zero of their sign).
//
// Every build compiles with -ffp-contract=off: a product and a sum written apart stay apart (rounded twice, as
// torch's ops round them); fma() is the one fused multiply-add.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace whiflash {

// The build this source is compiled as (kernels/build.py BUILD_FLAGS), as its compiler flags say
#if defined(__AVX512BF16__) && defined(__AMX_TILE__)
#define WHIFLASH_BUILD "avx512bf16"
#elif defined(__AVX512F__)
#define WHIFLASH_BUILD "avx512"
#else
#define WHIFLASH_BUILD "avx2"
#endif

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Native = __m512;
using NativeInt = __m512i;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Native = __m256;
using NativeInt = __m256i;
#else
#error "the kernels need AVX2 and FMA at least"
#endif

// Accumulators a GEMM loop keeps in registers beside its weights and broadcasts (32 zmm or 16 ymm)
constexpr int kAccumulators = kLanes == 16 ? 24 : 12;

// Which lanes of a step hold elements
struct Mask {
#if defined(__AVX512F__)
  __mmask16 m;
  unsigned bits() const { return m; }
  Mask operator&(Mask o) const { return {static_cast<__mmask16>(m & o.m)}; }
#else
  __m256 m;   // all ones in a lane that is set
  unsigned bits() const { return static_cast<unsigned>(_mm256_movemask_ps(m)); }
  Mask operator&(Mask o) const { return {_mm256_and_ps(m, o.m)}; }
#endif
  // lanes [0, n)
  static Mask first(int64_t n) {
    n = n < 0 ? 0 : n > kLanes ? kLanes : n;
#if defined(__AVX512F__)
    return {static_cast<__mmask16>((1u << n) - 1)};
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lane))};
#endif
  }
};

// bf16 bits of n fp32 lanes of `wide` ([kLanes] int32, each its bf16 in the low half) into p
inline void narrow_store(uint16_t* p, NativeInt wide, int64_t n) {
#if defined(__AVX512F__)
  const __m256i halves = _mm512_cvtepi32_epi16(wide);
#else
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
#endif
  if (n >= kLanes) {
    std::memcpy(p, &halves, sizeof(halves));
  } else if (n > 0) {
    std::memcpy(p, &halves, n * sizeof(uint16_t));
  }
}

struct Vec {
  Native v;

  static Vec zero() {
#if defined(__AVX512F__)
    return {_mm512_setzero_ps()};
#else
    return {_mm256_setzero_ps()};
#endif
  }
  static Vec all(float x) {
#if defined(__AVX512F__)
    return {_mm512_set1_ps(x)};
#else
    return {_mm256_set1_ps(x)};
#endif
  }
  static Vec load(const float* p) {
#if defined(__AVX512F__)
    return {_mm512_loadu_ps(p)};
#else
    return {_mm256_loadu_ps(p)};
#endif
  }
  static Vec load(const float* p, int64_t n) {   // lanes past n are zero and not read
    if (n >= kLanes) return load(p);
#if defined(__AVX512F__)
    return {_mm512_maskz_loadu_ps(Mask::first(n).m, p)};
#else
    return {_mm256_maskload_ps(p, _mm256_castps_si256(Mask::first(n).m))};
#endif
  }
  static Vec widen(NativeInt bits) {   // the low halves of int32 lanes as bf16 -> fp32 (exact)
#if defined(__AVX512F__)
    return {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))};
#else
    return {_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16))};
#endif
  }
  static Vec load(const uint16_t* p) {   // bf16 bits
#if defined(__AVX512F__)
    return widen(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
    return widen(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  }
  static Vec load(const uint16_t* p, int64_t n) {
    if (n >= kLanes) return load(p);
#if defined(__AVX512F__)
    return widen(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(Mask::first(n).m, p)));
#else
    uint16_t part[kLanes] = {};
    if (n > 0) std::memcpy(part, p, n * sizeof(uint16_t));
    return load(part);
#endif
  }
  static Vec load(const at::BFloat16* p) { return load(reinterpret_cast<const uint16_t*>(p)); }
  static Vec load(const at::BFloat16* p, int64_t n) { return load(reinterpret_cast<const uint16_t*>(p), n); }

  void store(float* p) const {
#if defined(__AVX512F__)
    _mm512_storeu_ps(p, v);
#else
    _mm256_storeu_ps(p, v);
#endif
  }
  void store(float* p, int64_t n) const {   // lanes [0, n) only
    if (n >= kLanes) return store(p);
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, Mask::first(n).m, v);
#else
    _mm256_maskstore_ps(p, _mm256_castps_si256(Mask::first(n).m), v);
#endif
  }
  // each lane's bf16 (nearest even) in the low half of an int32 lane
  NativeInt bf16_bits() const {
#if defined(__AVX512BF16__)
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
#elif defined(__AVX512F__)
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
#else
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
#endif
  }
  void store(uint16_t* p, int64_t n = kLanes) const { narrow_store(p, bf16_bits(), n); }   // rounded to bf16
  void store(at::BFloat16* p, int64_t n = kLanes) const { store(reinterpret_cast<uint16_t*>(p), n); }
};

#if defined(__AVX512F__)
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a b + c, rounded once
inline Vec fnma(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }   // c - a b, rounded once
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec negate(Vec a) {
  return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}
inline Mask greater(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }   // false with a NaN
inline Mask ordered(Vec a) { return {_mm512_cmp_ps_mask(a.v, a.v, _CMP_ORD_Q)}; }          // not NaN
inline Vec select(Mask m, Vec a, Vec b) { return {_mm512_mask_mov_ps(b.v, m.m, a.v)}; }     // m ? a : b
inline Vec round_nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT)}; }
inline Vec times_power_of_two(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }   // p 2^n, n integral
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
extern "C" __m512 Sleef_expf16_u10(__m512);   // in libtorch_cpu: the exp of at::vec::Vectorized<float>
inline Vec torch_exp(Vec a) { return {Sleef_expf16_u10(a.v)}; }
#else
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec fnma(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec negate(Vec a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }
inline Mask greater(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)}; }
inline Mask ordered(Vec a) { return {_mm256_cmp_ps(a.v, a.v, _CMP_ORD_Q)}; }
inline Vec select(Mask m, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, m.m)}; }
inline Vec round_nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec times_power_of_two(Vec p, Vec n) {   // n in [-126, 127]: 2^n built in the exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(e))};
}
// (lane 0 + lane 4) ... (lane 3 + lane 7), then (0 + 2) and (1 + 3), then their sum: one fixed tree
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
extern "C" __m256 Sleef_expf8_u10(__m256);    // in libtorch_cpu: the exp of at::vec::Vectorized<float> (AVX2)
inline Vec torch_exp(Vec a) { return {Sleef_expf8_u10(a.v)}; }
#endif

// kLanes int32 from p (a packed weight's bf16 pairs), and each pair's two bf16 as fp32 (exact)
inline NativeInt load_int(const int32_t* p) {
#if defined(__AVX512F__)
  return _mm512_loadu_si512(p);
#else
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#endif
}
inline Vec low_bf16(NativeInt pairs) { return Vec::widen(pairs); }
inline Vec high_bf16(NativeInt pairs) {
#if defined(__AVX512F__)
  return {_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
#else
  return {_mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
#endif
}
// kLanes int8 from p as fp32 (exact)
inline Vec load_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
#endif
}

inline Vec round_bf16(Vec a) { return Vec::widen(a.bf16_bits()); }   // a rounded to bf16 (nearest even), as fp32

// exp of each lane (Cephes' expf polynomial, ~1 ulp; lanes below -87.3 give 0, above 88.3 are taken as 88.3):
// p 2^n with x = n ln2 + r, |r| <= ln2/2
inline Vec exp(Vec x) {
  x = min(max(x, Vec::all(-87.3f)), Vec::all(88.3f));
  const Vec n = round_nearest(x * Vec::all(1.44269504f));
  Vec r = fnma(n, Vec::all(0.693359375f), x);
  r = fnma(n, Vec::all(-2.12194440e-4f), r);
  Vec p = Vec::all(1.9875691500e-4f);
  p = fma(p, r, Vec::all(1.3981999507e-3f));
  p = fma(p, r, Vec::all(8.3334519073e-3f));
  p = fma(p, r, Vec::all(4.1665795894e-2f));
  p = fma(p, r, Vec::all(1.6666665459e-1f));
  p = fma(p, r, Vec::all(5.0000001201e-1f));
  p = fma(p * r, r, r + Vec::all(1.f));
  return times_power_of_two(p, n);
}

// Lane j of the result is the sum of d[j]'s lanes, every d[j] reduced by the same tree (kLanes sums in kLanes - 1
// vector adds, where one reduce_add per vector costs a chain of log2(kLanes)).
inline Vec sum_lanes(const Vec (&d)[kLanes]) {
#if defined(__AVX512F__)
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)   // quarter lanes [a0+a2, b0+b2, a1+a3, b1+b3] of a = d[2i], b = d[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i].v, d[2 * i + 1].v),
                         _mm512_unpackhi_ps(d[2 * i].v, d[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {  // each quarter: the quarter sums of d[4i .. 4i+3], in order
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)   // [u.Q0 + u.Q1, u.Q2 + u.Q3] of u[2i], then of u[2i+1]
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD))};
#else
  // per 128-bit half: pairs (x0 + x1, x2 + x3), then the half's sum of d[j] in lane j; then the halves added
  __m256 t[4];
  for (int i = 0; i < 4; ++i) t[i] = _mm256_hadd_ps(d[2 * i].v, d[2 * i + 1].v);
  const __m256 u0 = _mm256_hadd_ps(t[0], t[1]), u1 = _mm256_hadd_ps(t[2], t[3]);
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
#endif
}

// Lane indices (int32) for arg-reductions: begin + lane, stepped by kLanes
struct Index {
  NativeInt v;
  static Index iota(int32_t begin) {
#if defined(__AVX512F__)
    return {_mm512_add_epi32(_mm512_set1_epi32(begin),
                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
#else
    return {_mm256_add_epi32(_mm256_set1_epi32(begin), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
#endif
  }
  Index next() const {
#if defined(__AVX512F__)
    return {_mm512_add_epi32(v, _mm512_set1_epi32(kLanes))};
#else
    return {_mm256_add_epi32(v, _mm256_set1_epi32(kLanes))};
#endif
  }
  Index where(Mask m, Index other) const {   // m ? other : this
#if defined(__AVX512F__)
    return {_mm512_mask_mov_epi32(v, m.m, other.v)};
#else
    return {_mm256_blendv_epi8(v, other.v, _mm256_castps_si256(m.m))};
#endif
  }
  void store(int32_t* p) const { std::memcpy(p, &v, sizeof(v)); }
};

// n elements of `buffer` from a 64-byte boundary, so that a tile's rows start cache lines (a heap block is only
// 16-byte aligned, and AMX tile loads of rows split across lines are slower; docs/measurements.md, "Kernels")
template <typename T>
inline T* aligned64(std::vector<T>& buffer, size_t n) {
  buffer.resize(n + 64 / sizeof(T));
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (64 - at % 64) % 64 / sizeof(T);
}

#if defined(__AVX512F__)
// The 16-lane forms attention_amx.cpp is written in (AVX-512 builds only)
inline __mmask16 lanes(int64_t left) { return Mask::first(left).m; }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 exp16(__m512 x) { return exp(Vec{x}).v; }
#endif

}  // namespace whiflash
