// A language model's element-wise steps: the residual add with its norm, SwiGLU.
//
//   ai.attnserve.AddRMSNorm(x, y (..., C), weight (C,), epsilon ()) -> x + y, RMSNorm(x + y)
//   ai.attnserve.SwiGLU(gate_up (..., 2F)) -> silu(gate_up[..., :F]) * gate_up[..., F:]
//
// A decoding step of a small model runs hundreds of these on rows of a few hundred values,
// where ONNX Runtime's cost per node is most of their time: one node for the residual Add and
// the RMSNormalization after it, one for Split, the SiLU and the product. Each row alone, in a
// fixed order (RMSNorm: the mean square summed in kLanes partial sums, float32 as
// RMSNormalization's stash type 1).
#include <cmath>
#include <vector>

#include "ops.h"
#include "ort_glue.h"
#include "simd.h"

namespace attnserve::kernels {
namespace {

struct NormJob {
  const float* x;
  const float* y;
  const float* weight;
  float* sum;
  float* normed;
  int64_t columns;
  float epsilon;
};

void add_norm_row(void* data, size_t index) {
  const NormJob& job = *static_cast<const NormJob*>(data);
  const int64_t c = job.columns, offset = static_cast<int64_t>(index) * c;
  const float *x = job.x + offset, *y = job.y + offset;
  float *sum = job.sum + offset, *normed = job.normed + offset;
  float partial[kLanes] = {0};
  for (int64_t i = 0; i < c; ++i) {
    sum[i] = x[i] + y[i];
    partial[i % kLanes] += sum[i] * sum[i];
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  }
  const float inverse = 1.0f / std::sqrt(partial[0] / static_cast<float>(c) + job.epsilon);
  for (int64_t i = 0; i < c; ++i) normed[i] = sum[i] * inverse * job.weight[i];
}

struct SwiGluJob {
  const float* x;
  float* out;
  int64_t half;
};

void swiglu_row_portable(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

#if ATTNSERVE_AVX512
__attribute__((target("avx512f"))) void swiglu_row_avx512(const float* gate, const float* up,
                                                          float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                            _mm512_loadu_ps(up + i)));
  }
  swiglu_row_portable(gate + i, up + i, out + i, n - i);
}

ATTNSERVE_AVX2 void swiglu_row_avx2(const float* gate, const float* up, float* out, int64_t n) {
  const F16 one = set16_avx2(1.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F16 g = load16_avx2(gate + i);
    const F16 e = exp16_avx2(sub16(zero16_avx2(), g));
    store16_avx2(out + i, mul16(div16(g, add16(one, e)), load16_avx2(up + i)));
  }
  swiglu_row_portable(gate + i, up + i, out + i, n - i);
}
#endif

void swiglu_row(void* data, size_t index) {
  const SwiGluJob& job = *static_cast<const SwiGluJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
  const float* gate = job.x + row * 2 * job.half;
  float* out = job.out + row * job.half;
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) return swiglu_row_avx512(gate, gate + job.half, out, job.half);
  if (cpu_has_avx2()) return swiglu_row_avx2(gate, gate + job.half, out, job.half);
#endif
  swiglu_row_portable(gate, gate + job.half, out, job.half);
}

// Rows of at most this many values in all run on the calling thread.
constexpr int64_t kElementInline = 1 << 15;

}  // namespace

void run_add_norm(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0), y = input(api, context, 1);
  const Tensor weight = input(api, context, 2), epsilon = input(api, context, 3);
  if (x.dims.empty() || x.dims != y.dims || weight.dims != std::vector<int64_t>{x.dims.back()} ||
      epsilon.count() != 1) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  "AddRMSNorm wants x and y (..., C) alike, weight (C,) and one epsilon"};
  }
  NormJob job{x.data(), y.data(), weight.data(), nullptr, nullptr, x.dims.back(),
              *epsilon.data()};
  job.sum = static_cast<float*>(output(api, context, 0, x.dims));
  job.normed = static_cast<float*>(output(api, context, 1, x.dims));
  const int64_t rows = job.columns == 0 ? 0 : x.count() / job.columns;
  if (x.count() <= kElementInline) {
    for (int64_t r = 0; r < rows; ++r) add_norm_row(&job, static_cast<size_t>(r));
  } else {
    for_each_row(api, context, add_norm_row, static_cast<size_t>(rows), &job);
  }
}

void run_swiglu(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0);
  if (x.dims.empty() || x.dims.back() % 2 != 0) {
    throw Failure{ORT_INVALID_ARGUMENT, "SwiGLU wants gate_up (..., 2F)"};
  }
  std::vector<int64_t> dims = x.dims;
  dims.back() /= 2;
  SwiGluJob job{x.data(), static_cast<float*>(output(api, context, 0, dims)), dims.back()};
  const int64_t rows = job.half == 0 ? 0 : x.count() / x.dims.back();
  if (x.count() <= kElementInline) {
    for (int64_t r = 0; r < rows; ++r) swiglu_row(&job, static_cast<size_t>(r));
  } else {
    for_each_row(api, context, swiglu_row, static_cast<size_t>(rows), &job);
  }
}

}  // namespace attnserve::kernels
