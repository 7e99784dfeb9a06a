// The vocabulary: each row's log-softmax and its k best tokens, in three passes.
//
// ONNX Runtime's LogSoftmax writes the whole (B, V) row (three passes over it) and TopK reads
// it again; a beam search that takes its candidates from TopK never reads that row. This
// kernel finds the row's maximum in one pass, sums exp(x - max) in a second (in double
// precision), and in a third computes each log-prob (x - max) - log(sum), keeping the k best
// (ties to the lower id, as ONNX's TopK) and writing the row only when asked. The candidates
// are chosen among the very values the row holds, so a step that reads candidates and one that
// reads the row choose alike (two logits can round to one log-prob: the lower id wins both
// ways). A row holding a NaN comes out all NaN, its candidates the first k ids.
//
//   ai.attnserve.LogSoftmaxTopK(x (..., V), k (1,), full (1,))
//     -> log_probs (..., V) or (..., 0), top values (..., k), top ids (..., k)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ops.h"
#include "ort_glue.h"
#include "simd.h"

namespace attnserve::kernels {
namespace {

// exp(x) for x <= 0 (the argument is x - max): Cephes' single-precision polynomial after
// x = n ln2 + r, |r| <= ln2 / 2; below -87.3 the result is 0.
inline float exp_nonpositive(float x) {
  if (x != x) return x;  // NaN
  if (x < -87.33654f) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return std::ldexp(p * r * r + r + 1.0f, static_cast<int>(n));
}

// The k best (value, index) of a row so far, best first, ties to the lower index.
struct Best {
  float* values;
  int64_t* ids;
  int64_t k;
  int64_t count = 0;

  float threshold() const {
    if (k == 0) return std::numeric_limits<float>::infinity();
    return count < k ? -std::numeric_limits<float>::infinity() : values[k - 1];
  }
  void offer(float value, int64_t id) {  // ids arrive in increasing order
    if (k == 0 || (count == k && !(value > values[k - 1]))) return;
    int64_t at = count < k ? count++ : k - 1;
    while (at > 0 && values[at - 1] < value) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = value;
    ids[at] = id;
  }
};

// The row's maximum, or NaN when it holds one.
float max_portable(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, x[i]);
  }
  return top;
}

// The third pass: each log-prob (x - top) - log_sum, offered to `best` (and written to `out`
// when it is not null).
void select_portable(const float* x, int64_t n, float top, float log_sum, Best& best,
                     float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    if (best.count < best.k || value > best.threshold()) best.offer(value, i);
  }
}

double exp_sum_portable(const float* x, int64_t n, float top) {
  double lanes[kLanes] = {0};
  const int64_t whole = n - n % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += exp_nonpositive(x[i + l] - top);
  }
  for (int64_t i = whole; i < n; ++i) lanes[i - whole] += exp_nonpositive(x[i] - top);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

#if ATTNSERVE_AVX512
// The same polynomial, sixteen at a time.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
                                 _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(e, n));
}

__attribute__((target("avx512f"))) float max_avx512(const float* x, int64_t n) {
  __m512 tops = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, v);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float top = _mm512_reduce_max_ps(tops);
  for (; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, x[i]);
  }
  return top;
}

__attribute__((target("avx512f"))) void select_avx512(const float* x, int64_t n, float top,
                                                      float log_sum, Best& best, float* out) {
  int64_t i = 0;
  for (; i < n && best.count < best.k; ++i) {  // the first k fill the list
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    best.offer(value, i);
  }
  const __m512 tops = _mm512_set1_ps(top), sums = _mm512_set1_ps(log_sum);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 values = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), tops), sums);
    if (out != nullptr) _mm512_storeu_ps(out + i, values);
    __mmask16 above = _mm512_cmp_ps_mask(values, _mm512_set1_ps(best.threshold()), _CMP_GT_OQ);
    if (!above) continue;  // the common case once the list holds good values
    float lanes[kLanes];
    _mm512_storeu_ps(lanes, values);
    while (above) {
      const int l = __builtin_ctz(above);
      best.offer(lanes[l], i + l);  // offer re-checks against the risen threshold
      above &= static_cast<__mmask16>(above - 1);
    }
  }
  for (; i < n; ++i) {
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    best.offer(value, i);
  }
}

// Lane l sums the elements l, l + 16, ... in double precision; the lanes are then added
// pairwise, as the portable loop does (the same order: a row's sum never depends on the batch,
// nor on the CPU's instruction set: the AVX2 loop below sums alike).
__attribute__((target("avx512f"))) double exp_sum_avx512(const float* x, int64_t n, float top) {
  const int64_t whole = n - n % kLanes;
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  const __m512 tops = _mm512_set1_ps(top);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i), tops));
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    high = _mm512_add_pd(
        high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  double lanes[kLanes];
  _mm512_storeu_pd(lanes, low);
  _mm512_storeu_pd(lanes + 8, high);
  for (int64_t i = whole; i < n; ++i) lanes[i - whole] += exp_nonpositive(x[i] - top);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// The same three passes on AVX2 (simd.h's F16), the same floats and doubles.
ATTNSERVE_AVX2_INLINE F16 exp_nonpositive16_avx2(F16 x) {
  const F16 low = set16_avx2(-87.33654f);
  const __m256 zero_lo = _mm256_cmp_ps(x.lo, low.lo, _CMP_LT_OQ);
  const __m256 zero_hi = _mm256_cmp_ps(x.hi, low.hi, _CMP_LT_OQ);
  const F16 n = {_mm256_round_ps(_mm256_mul_ps(x.lo, _mm256_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 _mm256_round_ps(_mm256_mul_ps(x.hi, _mm256_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  const F16 r = add16(sub16(x, mul16(n, set16_avx2(0.693359375f))),
                      mul16(n, set16_avx2(2.12194440e-4f)));
  F16 p = set16_avx2(1.9875691500e-4f);
  p = add16(mul16(p, r), set16_avx2(1.3981999507e-3f));
  p = add16(mul16(p, r), set16_avx2(8.3334519073e-3f));
  p = add16(mul16(p, r), set16_avx2(4.1665795894e-2f));
  p = add16(mul16(p, r), set16_avx2(1.6666665459e-1f));
  p = add16(mul16(p, r), set16_avx2(5.0000001201e-1f));
  const F16 e = add16(add16(mul16(mul16(p, r), r), r), set16_avx2(1.0f));
  return {_mm256_andnot_ps(zero_lo, scale_pow2(e.lo, n.lo)),
          _mm256_andnot_ps(zero_hi, scale_pow2(e.hi, n.hi))};
}

ATTNSERVE_AVX2 float max_avx2(const float* x, int64_t n) {
  F16 tops = set16_avx2(-std::numeric_limits<float>::infinity());
  unsigned nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F16 v = load16_avx2(x + i);
    nan |= compare16<_CMP_UNORD_Q>(v, v);
    tops = max16(tops, v);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float top = reduce_max16(tops);
  for (; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, x[i]);
  }
  return top;
}

ATTNSERVE_AVX2 void select_avx2(const float* x, int64_t n, float top, float log_sum, Best& best,
                                float* out) {
  int64_t i = 0;
  for (; i < n && best.count < best.k; ++i) {
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    best.offer(value, i);
  }
  const F16 tops = set16_avx2(top), sums = set16_avx2(log_sum);
  for (; i + kLanes <= n; i += kLanes) {
    const F16 values = sub16(sub16(load16_avx2(x + i), tops), sums);
    if (out != nullptr) store16_avx2(out + i, values);
    unsigned above = compare16<_CMP_GT_OQ>(values, set16_avx2(best.threshold()));
    if (!above) continue;
    float lanes[kLanes];
    store16_avx2(lanes, values);
    while (above) {
      const int l = __builtin_ctz(above);
      best.offer(lanes[l], i + l);
      above &= above - 1;
    }
  }
  for (; i < n; ++i) {
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    best.offer(value, i);
  }
}

ATTNSERVE_AVX2 double exp_sum_avx2(const float* x, int64_t n, float top) {
  const int64_t whole = n - n % kLanes;
  __m256d sums[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                     _mm256_setzero_pd()};  // lanes 0-3, 4-7, 8-11, 12-15
  const F16 tops = set16_avx2(top);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const F16 e = exp_nonpositive16_avx2(sub16(load16_avx2(x + i), tops));
    sums[0] = _mm256_add_pd(sums[0], _mm256_cvtps_pd(_mm256_castps256_ps128(e.lo)));
    sums[1] = _mm256_add_pd(sums[1], _mm256_cvtps_pd(_mm256_extractf128_ps(e.lo, 1)));
    sums[2] = _mm256_add_pd(sums[2], _mm256_cvtps_pd(_mm256_castps256_ps128(e.hi)));
    sums[3] = _mm256_add_pd(sums[3], _mm256_cvtps_pd(_mm256_extractf128_ps(e.hi, 1)));
  }
  double lanes[kLanes];
  for (int part = 0; part < 4; ++part) _mm256_storeu_pd(lanes + 4 * part, sums[part]);
  for (int64_t i = whole; i < n; ++i) lanes[i - whole] += exp_nonpositive(x[i] - top);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}
#endif  // ATTNSERVE_AVX512

struct RowFns {
  float (*max)(const float*, int64_t);
  double (*exp_sum)(const float*, int64_t, float);
  void (*select)(const float*, int64_t, float, float, Best&, float*);
};

RowFns pick_row_fns() {
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) return {max_avx512, exp_sum_avx512, select_avx512};
  if (cpu_has_avx2()) return {max_avx2, exp_sum_avx2, select_avx2};
#endif
  return {max_portable, exp_sum_portable, select_portable};
}

// One row of the vocabulary kernel per index.
struct VocabJob {
  RowFns fns;
  const float* x;
  float* log_probs;  // null: not asked for
  float* top_values;
  int64_t* top_ids;
  int64_t columns, k;
};

void vocab_row(void* data, size_t index) {
  const VocabJob& job = *static_cast<const VocabJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
  const float* x = job.x + row * job.columns;
  Best best{job.top_values + row * job.k, job.top_ids + row * job.k, job.k};
  float* out = job.log_probs == nullptr ? nullptr : job.log_probs + row * job.columns;
  const float top = job.fns.max(x, job.columns);
  if (top != top) {  // a NaN in the row: all NaN, the first k ids
    for (int64_t i = 0; out != nullptr && i < job.columns; ++i) out[i] = top;
    for (int64_t j = 0; j < job.k; ++j) best.values[j] = top, best.ids[j] = j;
    return;
  }
  const float log_sum = static_cast<float>(std::log(job.fns.exp_sum(x, job.columns, top)));
  job.fns.select(x, job.columns, top, log_sum, best, out);
}

int64_t scalar_input(const ort_abi::Fns& api, OrtKernelContext* context, size_t index,
                     const char* what) {
  const Tensor t = input(api, context, index);
  if (t.count() != 1) throw Failure{ORT_INVALID_ARGUMENT, std::string(what) + " wants one value"};
  return *static_cast<const int64_t*>(t.raw);
}

}  // namespace

// x (..., V), k (1,), full (1,) -> log-probs (..., V), or (..., 0) when full is 0; the k best
// log-probs (..., k) and their ids (..., k), best first, ties to the lower id.
void run_vocab(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0);
  const int64_t k = scalar_input(api, context, 1, "LogSoftmaxTopK's k");
  const bool full = scalar_input(api, context, 2, "LogSoftmaxTopK's full") != 0;
  if (x.dims.empty()) throw Failure{ORT_INVALID_ARGUMENT, "LogSoftmaxTopK wants rank >= 1"};
  VocabJob job{};
  job.fns = pick_row_fns();
  job.x = x.data();
  job.columns = x.dims.back();
  job.k = k;
  if (k < 0 || k > job.columns) {
    throw Failure{ORT_INVALID_ARGUMENT, "LogSoftmaxTopK's k must be within [0, V]"};
  }
  std::vector<int64_t> dims = x.dims;
  dims.back() = full ? job.columns : 0;
  void* log_probs = output(api, context, 0, dims);
  job.log_probs = full ? static_cast<float*>(log_probs) : nullptr;
  dims.back() = k;
  job.top_values = static_cast<float*>(output(api, context, 1, dims));
  job.top_ids = static_cast<int64_t*>(output(api, context, 2, dims));
  const size_t rows = static_cast<size_t>(x.count() / std::max<int64_t>(job.columns, 1));
  if (rows == 0 || job.columns == 0) return;
  for_each_row(api, context, vocab_row, rows, &job);
}

}  // namespace attnserve::kernels
