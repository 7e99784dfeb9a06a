// Per-row int8 activations (rowquant.h):
//
//   ai.attnserve.RowQuantize(x (..., K)) -> q (..., K) uint8, m (..., 1)
#include "rowquant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "ort_glue.h"

namespace attnserve::kernels {
namespace {

inline uint8_t quantize_one(float x, float m) {
  float v = (x / m) / kStep;
  v = v > -128.0f ? v : -128.0f;  // as maxps / minps: a NaN becomes the bound
  v = v < 127.0f ? v : 127.0f;
  return static_cast<uint8_t>(static_cast<int>(std::nearbyint(v)) + 128);
}

}  // namespace

// max |x| of a row, NaN when it holds one (as ReduceMax: the row's bytes are then all 0).
float row_max_portable(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    m = std::max(m, std::fabs(x[i]));
  }
  return m;
}

void quantize_portable(const float* x, int64_t n, float m, uint8_t* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = quantize_one(x[i], m);
}

#if ATTNSERVE_AVX512
__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float top = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, std::fabs(x[i]));
  }
  return top;
}

__attribute__((target("avx512f"))) void quantize_avx512(const float* x, int64_t n, float m,
                                                        uint8_t* q) {
  const __m512 scale = _mm512_set1_ps(m), step = _mm512_set1_ps(kStep);
  const __m512 low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
  const __m512i zero_point = _mm512_set1_epi32(128);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    __m512 v = _mm512_div_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), scale), step);
    v = _mm512_min_ps(_mm512_max_ps(v, low), high);  // max(v, low): a NaN becomes low
    const __m512i r = _mm512_add_epi32(
        _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zero_point);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
  }
  for (; i < n; ++i) q[i] = quantize_one(x[i], m);
}

// The same on AVX2 (simd.h's F16): the same maximum and bytes.
ATTNSERVE_AVX2 float row_max_avx2(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  F16 m = zero16_avx2();
  unsigned nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F16 v = load16_avx2(x + i);
    nan |= compare16<_CMP_UNORD_Q>(v, v);
    m = max16(m, {_mm256_and_ps(v.lo, magnitude), _mm256_and_ps(v.hi, magnitude)});
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float top = reduce_max16(m);
  for (; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, std::fabs(x[i]));
  }
  return top;
}

ATTNSERVE_AVX2_INLINE __m128i bytes8_avx2(__m256 v, __m256 scale, __m256 step) {
  v = _mm256_div_ps(_mm256_div_ps(v, scale), step);
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
  v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // ties to even
  const __m256i r = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(128));
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  return _mm_packus_epi16(words, words);  // 0..255: exact
}

ATTNSERVE_AVX2 void quantize_avx2(const float* x, int64_t n, float m, uint8_t* q) {
  const __m256 scale = _mm256_set1_ps(m), step = _mm256_set1_ps(kStep);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m128i low = bytes8_avx2(_mm256_loadu_ps(x + i), scale, step);
    const __m128i high = bytes8_avx2(_mm256_loadu_ps(x + i + 8), scale, step);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_unpacklo_epi64(low, high));
  }
  for (; i < n; ++i) q[i] = quantize_one(x[i], m);
}
#endif  // ATTNSERVE_AVX512

RowQuantJob row_quant_job(const float* x, uint8_t* q, float* scales, int64_t columns) {
  RowQuantJob job{row_max_portable, quantize_portable, x, q, scales, columns};
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) {
    job.row_max = row_max_avx512, job.quantize = quantize_avx512;
  } else if (cpu_has_avx2()) {
    job.row_max = row_max_avx2, job.quantize = quantize_avx2;
  }
#endif
  return job;
}

void row_quantize_one(void* data, size_t index) {
  const RowQuantJob& job = *static_cast<const RowQuantJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
  const float* x = job.x + row * job.columns;
  const float m = job.row_max(x, job.columns);
  job.scales[row] = m;
  job.quantize(x, job.columns, m, job.q + row * job.columns);
}

// x (..., K) -> q (..., K) uint8, m (..., 1): each row's max |x| and its values quantized.
void run_row_quantize(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0);
  if (x.dims.empty()) throw Failure{ORT_INVALID_ARGUMENT, "RowQuantize wants rank >= 1"};
  RowQuantJob job = row_quant_job(x.data(), nullptr, nullptr, x.dims.back());
  job.q = static_cast<uint8_t*>(output(api, context, 0, x.dims));
  std::vector<int64_t> dims = x.dims;
  dims.back() = 1;
  job.scales = static_cast<float*>(output(api, context, 1, dims));
  const size_t rows = static_cast<size_t>(x.count() / std::max<int64_t>(job.columns, 1));
  if (rows == 0 || job.columns == 0) {
    for (size_t r = 0; r < rows; ++r) job.scales[r] = 0.0f;
    return;
  }
  for_each_row(api, context, row_quantize_one, rows, &job);
}

}  // namespace attnserve::kernels
