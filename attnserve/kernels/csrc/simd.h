// What the op families share of the CPU: which instruction sets it has (asked once), the
// portable loops' lane count, float16 as stored, and exp on AVX-512.
//
// The AVX-512 loops are compiled for their instruction set one function at a time
// (__attribute__((target(...)))), and chosen at run time only where the CPU has it, so the
// library builds for any x86-64 and runs anywhere; elsewhere the portable loops run. Every file
// is compiled with -ffp-contract=off: a multiply-add is fused only where the code says so.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#define ATTNSERVE_AVX512 1
#endif

namespace attnserve::kernels {

// Floats in an AVX-512 register; the portable loops' partial sums.
inline constexpr int kLanes = 16;

// IEEE binary16 as stored: a half cache's keys and values, the block products' scales.
using Half = uint16_t;

#if ATTNSERVE_AVX512
inline bool cpu_has_avx512() {
  static const bool avx512 = [] {
    __builtin_cpu_init();  // a library loaded by dlopen may run before libgcc's own init
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return avx512;
}

inline bool cpu_has_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
}

// exp(x), sixteen at a time: exp_nonpositive's polynomial (vocab.cc), 2^n by vscalefps (below
// -87.3: ~1e-38, not 0; large x: inf). Written for x <= 0 (a softmax's x - max); SwiGLU's -x
// works too.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);  // a NaN stays NaN (the second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif  // ATTNSERVE_AVX512

}  // namespace attnserve::kernels
