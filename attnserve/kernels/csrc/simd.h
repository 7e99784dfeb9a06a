// What the op families share of the CPU: which instruction sets it has (asked once) and which
// the loops may use, the portable loops' lane count, float16 as stored, exp on AVX-512, and
// AVX2's sixteen-lane vectors.
//
// The AVX-512 and AVX2 loops are compiled for their instruction set one function at a time
// (__attribute__((target(...)))), and chosen at run time only where the CPU has it, so the
// library builds for any x86-64 and runs anywhere; elsewhere the portable loops run. Every file
// is compiled with -ffp-contract=off: a multiply-add is fused only where the code says so.
//
// The AVX2 loops (AVX2 with FMA and F16C: the desktop and server x86-64 CPUs of the last decade
// that lack AVX-512) hold each of AVX-512's sixteen-float vectors as two halves (`F16`) and do per lane what the
// AVX-512 loops do, in the same order, down to the reductions' tree: their results are the
// AVX-512 loops' results bit for bit (tests/kernels compare them where a CPU runs both).
//
// `isa()` is the set the loops use: the CPU's best, at most ATTNSERVE_KERNELS_ISA (avx512, avx2
// or portable) and at most what `attnserve_kernels_isa` (registration.cc) was last told: tests
// and benchmarks run one CPU's loops for another's (below AVX-512, sessions registered from then
// on leave out the integer products, as on a CPU without VNNI; a registered one keeps them).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <strings.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define ATTNSERVE_AVX512 1
#endif

namespace attnserve::kernels {

// Floats in an AVX-512 register; the portable loops' partial sums.
inline constexpr int kLanes = 16;

// IEEE binary16 as stored: a half cache's keys and values, the block products' scales.
using Half = uint16_t;

// The instruction sets the loops choose between, best last.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The best the CPU has (AVX-512 counted only with the AVX2 set beside it).
inline int cpu_isa() {
#if ATTNSERVE_AVX512
  static const int best = [] {
    __builtin_cpu_init();  // a library loaded by dlopen may run before libgcc's own init
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c")) {
      return static_cast<int>(kPortable);
    }
    return static_cast<int>(__builtin_cpu_supports("avx512f") ? kAvx512 : kAvx2);
  }();
  return best;
#else
  return kPortable;
#endif
}

// The most the loops may use: ATTNSERVE_KERNELS_ISA's set at load, then what the library's
// caller sets (attnserve_kernels_isa).
inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{[] {
    const char* value = std::getenv("ATTNSERVE_KERNELS_ISA");  // any case; else no cap
    if (value == nullptr) return static_cast<int>(kAvx512);
    if (strcasecmp(value, "portable") == 0) return static_cast<int>(kPortable);
    if (strcasecmp(value, "avx2") == 0) return static_cast<int>(kAvx2);
    return static_cast<int>(kAvx512);
  }()};
  return cap;
}

// The set the loops use now.
inline int isa() {
  const int cap = isa_cap().load(std::memory_order_relaxed);
  return cap < cpu_isa() ? cap : cpu_isa();
}

#if ATTNSERVE_AVX512
inline bool cpu_has_avx512() { return isa() >= kAvx512; }
inline bool cpu_has_avx2() { return isa() >= kAvx2; }

// The integer products' kernels: AVX-512 with VNNI, and the loops allowed AVX-512 (asked when a
// session registers the library: a cap below AVX-512 registers them no more, as on a CPU
// without VNNI).
inline bool cpu_has_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return vnni && isa() >= kAvx512;
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

// AVX2 with FMA and F16C, one function at a time.
#define ATTNSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ATTNSERVE_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

// Sixteen floats as one AVX-512 register holds them: lanes 0-7 in `lo`, 8-15 in `hi`.
struct F16 {
  __m256 lo, hi;
};

ATTNSERVE_AVX2_INLINE F16 load16_avx2(const float* x) {
  return {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)};
}
ATTNSERVE_AVX2_INLINE F16 load16_avx2(const Half* x) {  // widened exactly, as vcvtph2ps
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)))};
}
ATTNSERVE_AVX2_INLINE void store16_avx2(float* x, F16 a) {
  _mm256_storeu_ps(x, a.lo);
  _mm256_storeu_ps(x + 8, a.hi);
}
ATTNSERVE_AVX2_INLINE F16 set16_avx2(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
ATTNSERVE_AVX2_INLINE F16 zero16_avx2() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ATTNSERVE_AVX2_INLINE F16 add16(F16 a, F16 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
ATTNSERVE_AVX2_INLINE F16 sub16(F16 a, F16 b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
ATTNSERVE_AVX2_INLINE F16 mul16(F16 a, F16 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
ATTNSERVE_AVX2_INLINE F16 div16(F16 a, F16 b) {
  return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
ATTNSERVE_AVX2_INLINE F16 fmadd16(F16 a, F16 b, F16 c) {  // a * b + c, one rounding
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
ATTNSERVE_AVX2_INLINE F16 max16(F16 a, F16 b) {  // as vmaxps: b where either is NaN
  return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
ATTNSERVE_AVX2_INLINE F16 min16(F16 a, F16 b) {
  return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
}
// The lanes a comparison holds for, bit l for lane l (as an AVX-512 mask).
template <int kCompare>
ATTNSERVE_AVX2_INLINE unsigned compare16(F16 a, F16 b) {
  return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kCompare))) |
         static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kCompare))) << 8;
}

// _mm512_reduce_add_ps's tree (GCC's): the halves, then the quarters, then pairs, then two.
ATTNSERVE_AVX2_INLINE float reduce_add16(F16 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}

// _mm512_reduce_max_ps's tree.
ATTNSERVE_AVX2_INLINE float reduce_max16(F16 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(t10);
}

// y * 2^n for integral n, one rounding (vscalefps for the n the callers give: n >= -126, or y
// NaN; n above 127 gives inf): 2^n as two normal powers when it is not one.
ATTNSERVE_AVX2_INLINE __m256 scale_pow2(__m256 y, __m256 n) {
  const __m256 high = _mm256_set1_ps(127.0f);
  const __m256 first = _mm256_min_ps(n, high);  // 2^first is normal; n - first in [0, 129]
  const __m256i e1 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(first),
                                                        _mm256_set1_epi32(127)), 23);
  const __m256i e2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_sub_ps(n, first), high)),
                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e1)), _mm256_castsi256_ps(e2));
}

// exp16's polynomial on the two halves: the same floats lane for lane.
ATTNSERVE_AVX2_INLINE __m256 exp8_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y =
      _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  return scale_pow2(y, n);
}
ATTNSERVE_AVX2_INLINE F16 exp16_avx2(F16 x) { return {exp8_avx2(x.lo), exp8_avx2(x.hi)}; }
#endif  // ATTNSERVE_AVX512

}  // namespace attnserve::kernels
