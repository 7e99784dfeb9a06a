// ONNX Runtime's C ABI for the kernels: tensors in and out, failures, the threads (ort_glue.h).
#include "ort_glue.h"

#include <algorithm>

#include "pool.h"

namespace attnserve::kernels {

void check(const ort_abi::Fns& api, OrtStatus* status, const char* what) {
  if (status != nullptr) {
    const std::string message = std::string(what) + " failed: " + api.GetErrorMessage(status);
    api.ReleaseStatus(status);
    throw Failure{ORT_FAIL, message};
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
  tensor.raw = data;
  return tensor;
}

void* output(const ort_abi::Fns& api, OrtKernelContext* context, size_t index,
             const std::vector<int64_t>& dims) {
  OrtValue* value = nullptr;
  check(api, api.KernelContextGetOutput(context, index, dims.data(), dims.size(), &value),
        "allocating an output");
  void* data = nullptr;
  check(api, api.GetTensorMutableData(value, &data), "writing an output");
  return data;
}

namespace {

// Work is split into contiguous batches of (row, head) for the session's threads; each
// (row, head) is one call, on whatever thread, so the split never changes a result.
constexpr size_t kBatches = 32;

}  // namespace

void for_each_row(const ort_abi::Fns& api, OrtKernelContext* context, void (*fn)(void*, size_t),
                  size_t rows, void* job) {
  if (rows > 1 && pool().run(fn, rows, job)) return;
  check(api, api.KernelContextParallelFor(context, fn, rows, std::min(rows, kBatches), job),
        "running on the session's threads");
}

}  // namespace attnserve::kernels
