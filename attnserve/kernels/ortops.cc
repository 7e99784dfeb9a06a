// attnserve's ONNX Runtime kernels: the decoder step's attention products.
//
// A decoding step multiplies each row's one query by its own cached keys and values: per
// (row, head) a (1 x D) by (D x T) product and a (1 x T) by (T x D) one. ONNX Runtime's MatMul
// runs each as a GEMM call of its own (thousands a step at beam 4 x batch 32, ~0.3 us each
// before any arithmetic); these loops do the same products with no call per (row, head).
//
//   ai.attnserve.AttnScores(q (B, H, M, D), k (B, H, N, D)) -> (B, H, M, N) = q @ k^T
//   ai.attnserve.AttnMix(p (B, H, M, N), v (B, H, N, D))    -> (B, H, M, D) = p @ v
//
// The graph declares each as an ONNX function whose body is the stock Transpose + MatMul, so
// a runtime without this library runs the body instead (attnserve/kernels/__init__.py).
// Each (row, head) is computed on its own, in a fixed order, so a row's result does not depend
// on the other rows of the batch.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "ort_abi.h"

#define ATTNSERVE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr const char* kDomain = "ai.attnserve";
constexpr int kLanes = 16;  // floats in an AVX-512 register; the portable loops' partial sums

// Portable loops: q (M, D) against k (N, D) into out (M, N), each dot product kLanes partial
// sums added pairwise; p (M, N) times v (N, D) into out (M, D), summed over n in order.
void scores_portable(const float* q, const float* k, float* out, int64_t m_count,
                     int64_t n_count, int64_t depth) {
  const int64_t whole = depth - depth % kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    const float* qm = q + m * depth;
    for (int64_t n = 0; n < n_count; ++n) {
      const float* kn = k + n * depth;
      float acc[kLanes] = {0};
      for (int64_t d = 0; d < whole; d += kLanes) {
        for (int l = 0; l < kLanes; ++l) acc[l] += qm[d + l] * kn[d + l];
      }
      for (int64_t d = whole; d < depth; ++d) acc[d - whole] += qm[d] * kn[d];
      for (int width = kLanes / 2; width > 0; width /= 2) {
        for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
      }
      out[m * n_count + n] = acc[0];
    }
  }
}

void mix_portable(const float* p, const float* v, float* out, int64_t m_count, int64_t n_count,
                  int64_t depth) {
  for (int64_t m = 0; m < m_count; ++m) {
    float* om = out + m * depth;
    std::memset(om, 0, sizeof(float) * depth);
    const float* pm = p + m * n_count;
    for (int64_t n = 0; n < n_count; ++n) {
      const float weight = pm[n];
      const float* vn = v + n * depth;
      for (int64_t d = 0; d < depth; ++d) om[d] += weight * vn[d];
    }
  }
}

// AVX-512 for the head sizes transformers use (D a multiple of 16, at most 256): the query row
// and the output row stay in registers.
constexpr int64_t kMaxChunks = 16;

// q (M, D) against k (N, D): four keys at a time (independent chains of fused multiply-adds).
__attribute__((target("avx512f"))) void scores_avx512(const float* q, const float* k,
                                                      float* out, int64_t m_count,
                                                      int64_t n_count, int64_t depth) {
  const int64_t chunks = depth / kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    __m512 qm[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) qm[c] = _mm512_loadu_ps(q + m * depth + c * kLanes);
    float* om = out + m * n_count;
    int64_t n = 0;
    for (; n + 4 <= n_count; n += 4) {
      const float* kn = k + n * depth;
      __m512 a0 = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn));
      __m512 a1 = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn + depth));
      __m512 a2 = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn + 2 * depth));
      __m512 a3 = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn + 3 * depth));
      for (int64_t c = 1; c < chunks; ++c) {
        const int64_t o = c * kLanes;
        a0 = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + o), a0);
        a1 = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + depth + o), a1);
        a2 = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + 2 * depth + o), a2);
        a3 = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + 3 * depth + o), a3);
      }
      om[n] = _mm512_reduce_add_ps(a0);
      om[n + 1] = _mm512_reduce_add_ps(a1);
      om[n + 2] = _mm512_reduce_add_ps(a2);
      om[n + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; n < n_count; ++n) {
      const float* kn = k + n * depth;
      __m512 a = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn));
      for (int64_t c = 1; c < chunks; ++c) {
        a = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + c * kLanes), a);
      }
      om[n] = _mm512_reduce_add_ps(a);
    }
  }
}

// p (M, N) times v (N, D): the output row in registers, the value rows summed in order.
__attribute__((target("avx512f"))) void mix_avx512(const float* p, const float* v, float* out,
                                                   int64_t m_count, int64_t n_count,
                                                   int64_t depth) {
  const int64_t chunks = depth / kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    __m512 acc[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    const float* pm = p + m * n_count;
    for (int64_t n = 0; n < n_count; ++n) {
      const __m512 weight = _mm512_set1_ps(pm[n]);
      const float* vn = v + n * depth;
      for (int64_t c = 0; c < chunks; ++c) {
        acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(vn + c * kLanes), acc[c]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + m * depth + c * kLanes, acc[c]);
  }
}

using Block = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t);

// The loop for this CPU and head size, chosen once per kernel.
Block pick(bool scores, int64_t depth) {
  static const bool avx512 = [] {
    __builtin_cpu_init();  // a library loaded by dlopen may run before libgcc's own init
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  if (avx512 && depth % kLanes == 0 && depth / kLanes <= kMaxChunks) {
    return scores ? scores_avx512 : mix_avx512;
  }
  return scores ? scores_portable : mix_portable;
}

struct Tensor {
  const float* data = nullptr;
  std::vector<int64_t> dims;
};

// An error inside a kernel: returned to ONNX Runtime as a status (it fails the session's run).
struct Failure {
  OrtErrorCode code;
  std::string message;
};

void check(const ort_abi::Fns& api, OrtStatus* status, const char* what) {
  if (status != nullptr) {
    api.ReleaseStatus(status);
    throw Failure{ORT_FAIL, std::string(what) + " failed"};
  }
}

Tensor input(const ort_abi::Fns& api, OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  check(api, api.KernelContextGetInput(context, index, &value), "reading an input");
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api, api.GetTensorTypeAndShape(value, &info), "reading an input's shape");
  size_t rank = 0;
  OrtStatus* status = api.GetDimensionsCount(info, &rank);
  Tensor tensor;
  if (status == nullptr) {
    tensor.dims.resize(rank);
    status = api.GetDimensions(info, tensor.dims.data(), rank);
  }
  api.ReleaseTensorTypeAndShapeInfo(info);
  check(api, status, "reading an input's dimensions");
  void* data = nullptr;
  check(api, api.GetTensorMutableData(const_cast<OrtValue*>(value), &data), "reading an input");
  tensor.data = static_cast<const float*>(data);
  return tensor;
}

float* output(const ort_abi::Fns& api, OrtKernelContext* context,
              const std::vector<int64_t>& dims) {
  OrtValue* value = nullptr;
  check(api, api.KernelContextGetOutput(context, 0, dims.data(), dims.size(), &value),
        "allocating the output");
  void* data = nullptr;
  check(api, api.GetTensorMutableData(value, &data), "writing the output");
  return static_cast<float*>(data);
}

// Both inputs rank 4 with equal (B, H) and equal inner sizes: what the graph rewrite builds.
void check_pair(const Tensor& a, const Tensor& b, int inner_a, int inner_b, const char* op) {
  if (a.dims.size() != 4 || b.dims.size() != 4 || a.dims[0] != b.dims[0] ||
      a.dims[1] != b.dims[1] || a.dims[inner_a] != b.dims[inner_b]) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  std::string(op) + " wants rank-4 inputs with equal (B, H) and inner sizes"};
  }
}

enum class Kind { kScores, kMix };

struct Kernel {
  ort_abi::Fns api;
  Kind kind;
};

void run(const Kernel& kernel, OrtKernelContext* context) {
  const ort_abi::Fns& api = kernel.api;
  const Tensor a = input(api, context, 0);
  const Tensor b = input(api, context, 1);
  if (kernel.kind == Kind::kScores) {
    check_pair(a, b, 3, 3, "AttnScores");  // q (B, H, M, D), k (B, H, N, D)
    const int64_t rows = a.dims[0] * a.dims[1], m = a.dims[2], depth = a.dims[3], n = b.dims[2];
    float* out = output(api, context, {a.dims[0], a.dims[1], m, n});
    const Block block = pick(true, depth);
    for (int64_t bh = 0; bh < rows; ++bh) {
      block(a.data + bh * m * depth, b.data + bh * n * depth, out + bh * m * n, m, n, depth);
    }
  } else {
    check_pair(a, b, 3, 2, "AttnMix");  // p (B, H, M, N), v (B, H, N, D)
    const int64_t rows = a.dims[0] * a.dims[1], m = a.dims[2], n = a.dims[3], depth = b.dims[3];
    float* out = output(api, context, {a.dims[0], a.dims[1], m, depth});
    const Block block = pick(false, depth);
    for (int64_t bh = 0; bh < rows; ++bh) {
      block(a.data + bh * m * n, b.data + bh * n * depth, out + bh * m * depth, m, n, depth);
    }
  }
}

template <Kind kind>
struct Op {
  static const char* name(const OrtCustomOp*) {
    return kind == Kind::kScores ? "AttnScores" : "AttnMix";
  }
  static OrtStatus* create(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo*,
                           void** kernel) {
    *kernel = new Kernel{ort_abi::Fns(api), kind};
    return nullptr;
  }
};

OrtStatus* compute(void* raw, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<Kernel*>(raw);
  try {
    run(kernel, context);
    return nullptr;
  } catch (const Failure& failure) {
    return kernel.api.CreateStatus(failure.code, ("attnserve kernels: " + failure.message).c_str());
  } catch (const std::exception& error) {
    return kernel.api.CreateStatus(ORT_FAIL, error.what());
  }
}

void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* cpu_provider(const OrtCustomOp*) { return nullptr; }
OrtElementType float_type(const OrtCustomOp*, size_t) { return ORT_ELEMENT_FLOAT; }
size_t two(const OrtCustomOp*) { return 2; }
size_t one(const OrtCustomOp*) { return 1; }
OrtIoCharacteristic required(const OrtCustomOp*, size_t) { return ORT_IO_REQUIRED; }
int default_memory(const OrtCustomOp*, size_t) { return 0; }
int one_int(const OrtCustomOp*) { return 1; }
int since_opset_1(const OrtCustomOp*) { return 1; }
int any_later_opset(const OrtCustomOp*) { return std::numeric_limits<int>::max(); }

template <Kind kind>
constexpr OrtCustomOp make_op() {
  OrtCustomOp op{};
  op.version = 18;
  op.GetName = Op<kind>::name;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputType = float_type;
  op.GetInputTypeCount = two;
  op.GetOutputType = float_type;
  op.GetOutputTypeCount = one;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = one_int;
  op.GetVariadicInputHomogeneity = one_int;
  op.GetVariadicOutputMinArity = one_int;
  op.GetVariadicOutputHomogeneity = one_int;
  op.CreateKernelV2 = Op<kind>::create;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = since_opset_1;
  op.GetEndVersion = any_later_opset;
  return op;
}

const OrtCustomOp kScores = make_op<Kind::kScores>();
const OrtCustomOp kMix = make_op<Kind::kMix>();

}  // namespace

// Called by ONNX Runtime's SessionOptions.register_custom_ops_library.
ATTNSERVE_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                              const OrtApiBase* base) {
  const OrtApi* table = base->GetApi(1);
  if (table == nullptr) return nullptr;  // cannot happen: every runtime answers version 1
  const ort_abi::Fns api(table);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api.CreateCustomOpDomain(kDomain, &domain)) return status;
  for (const OrtCustomOp* op : {&kScores, &kMix}) {
    if (OrtStatus* status = api.CustomOpDomainAdd(domain, op)) return status;
  }
  return api.AddCustomOpDomain(options, domain);
}

// The library's own version, read by attnserve/kernels/__init__.py to refuse a stale build.
ATTNSERVE_EXPORT int attnserve_kernels_version() { return 1; }
