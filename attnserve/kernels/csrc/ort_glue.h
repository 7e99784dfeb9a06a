// A kernel's side of ONNX Runtime's C ABI (ort_abi.h): its inputs and outputs as tensors, its
// errors as a Failure (returned to ONNX Runtime as a status by registration.cc), and the loop
// that runs its tasks on threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace attnserve::kernels {

struct Tensor {
  const void* raw = nullptr;
  std::vector<int64_t> dims;
  const float* data() const { return static_cast<const float*>(raw); }
  int64_t count() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

// An error inside a kernel: returned to ONNX Runtime as a status (it fails the session's run).
struct Failure {
  OrtErrorCode code;
  std::string message;
};

// Throws a Failure for a status that is not OK (`what` failed).
void check(const ort_abi::Fns& api, OrtStatus* status, const char* what);

// Input `index`: its data and its dimensions.
Tensor input(const ort_abi::Fns& api, OrtKernelContext* context, size_t index);

// Output `index`, allocated with `dims`: its data.
void* output(const ort_abi::Fns& api, OrtKernelContext* context, size_t index,
             const std::vector<int64_t>& dims);

// fn(job, i) for every i in [0, rows): on the kernels' own threads when the process asked for
// them and no other kernel holds them (pool.h), else in contiguous batches on the session's
// intra-op threads. Each i is one call, on whatever thread, so the split never changes a result.
void for_each_row(const ort_abi::Fns& api, OrtKernelContext* context, void (*fn)(void*, size_t),
                  size_t rows, void* job);

}  // namespace attnserve::kernels
