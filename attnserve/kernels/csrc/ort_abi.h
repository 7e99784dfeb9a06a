// The part of ONNX Runtime's C ABI that attnserve's kernels use, declared here so that the
// library builds with a C++ compiler alone (the onnxruntime wheel ships no headers).
//
// ONNX Runtime's C API is a table of function pointers (OrtApi) that only ever grows at its end:
// an entry keeps its index in every release, and `OrtApiBase::GetApi(v)` answers the table of
// any version v up to the runtime's own (null above it). The indices below are the entries'
// positions in that table; the library asks for version 18 (ONNX Runtime 1.18 and later). The custom-op struct is laid out as ONNX Runtime reads it at version 18.
// Everything that crosses the boundary is C: errors go back as an OrtStatus, never an exception.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;
struct OrtApi;  // opaque: reached through OrtFns below

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };

enum OrtElementType {
  ORT_ELEMENT_UNDEFINED = 0,
  ORT_ELEMENT_FLOAT = 1,
  ORT_ELEMENT_UINT8 = 2,
  ORT_ELEMENT_INT8 = 3,
  ORT_ELEMENT_INT32 = 6,
  ORT_ELEMENT_INT64 = 7,
  ORT_ELEMENT_FLOAT16 = 10,
};

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum OrtIoCharacteristic { ORT_IO_REQUIRED = 0 };

// The custom-op description ONNX Runtime reads from a library, as of its version 18 (the
// version a library states in `version`; ONNX Runtime reads no field added after it).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);  // null: the CPU provider
  OrtElementType (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  OrtElementType (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  // version 8
  OrtIoCharacteristic (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtIoCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  // version 11
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);  // 0: the provider's default
  // version 14
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  // version 16: a kernel that returns its errors as a status
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api,
                               const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  // version 17
  void* InferOutputShapeFn;  // optional; null
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
  // version 18: optional; null
  void* GetMayInplace;
  void* ReleaseMayInplace;
  void* GetAliasMap;
  void* ReleaseAliasMap;
};

}  // extern "C"

namespace ort_abi {

constexpr uint32_t kApiVersion = 18;

// Positions in the OrtApi table (all in version 1's table, but KernelContext_ParallelFor).
enum Entry : size_t {
  kCreateStatus = 0,
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelContextGetInputCount = 88,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextParallelFor = 274,  // since version 17: the session's intra-op thread pool
};

// Typed access to the entries the kernels call.
class Fns {
 public:
  explicit Fns(const OrtApi* api) : table_(reinterpret_cast<void* const*>(api)) {}

  OrtStatus* CreateStatus(OrtErrorCode code, const char* msg) const {
    return call<OrtStatus* (*)(OrtErrorCode, const char*)>(kCreateStatus)(code, msg);
  }
  OrtStatus* CreateCustomOpDomain(const char* domain, OrtCustomOpDomain** out) const {
    return call<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)(domain,
                                                                                          out);
  }
  OrtStatus* CustomOpDomainAdd(OrtCustomOpDomain* domain, const OrtCustomOp* op) const {
    return call<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(
        domain, op);
  }
  OrtStatus* AddCustomOpDomain(OrtSessionOptions* options, OrtCustomOpDomain* domain) const {
    return call<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(
        options, domain);
  }
  OrtStatus* GetTensorMutableData(OrtValue* value, void** out) const {
    return call<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(value, out);
  }
  OrtStatus* GetTensorElementType(const OrtTensorTypeAndShapeInfo* info,
                                  OrtElementType* out) const {
    return call<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, OrtElementType*)>(
        kGetTensorElementType)(info, out);
  }
  OrtStatus* GetDimensionsCount(const OrtTensorTypeAndShapeInfo* info, size_t* out) const {
    return call<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(
        info, out);
  }
  OrtStatus* GetDimensions(const OrtTensorTypeAndShapeInfo* info, int64_t* dims,
                           size_t count) const {
    return call<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(
        kGetDimensions)(info, dims, count);
  }
  OrtStatus* GetTensorTypeAndShape(const OrtValue* value, OrtTensorTypeAndShapeInfo** out) const {
    return call<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(
        kGetTensorTypeAndShape)(value, out);
  }
  OrtStatus* KernelContextGetInputCount(const OrtKernelContext* context, size_t* out) const {
    return call<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(kKernelContextGetInputCount)(
        context, out);
  }
  OrtStatus* KernelContextGetInput(const OrtKernelContext* context, size_t index,
                                   const OrtValue** out) const {
    return call<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
        kKernelContextGetInput)(context, index, out);
  }
  OrtStatus* KernelContextGetOutput(OrtKernelContext* context, size_t index, const int64_t* dims,
                                    size_t count, OrtValue** out) const {
    return call<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
        kKernelContextGetOutput)(context, index, dims, count, out);
  }
  // Calls fn(data, i) for i in [0, total), in `batches` contiguous batches on the session's
  // intra-op threads (on the calling thread when the session has one thread).
  OrtStatus* KernelContextParallelFor(const OrtKernelContext* context, void (*fn)(void*, size_t),
                                      size_t total, size_t batches, void* data) const {
    return call<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t,
                               void*)>(kKernelContextParallelFor)(context, fn, total, batches,
                                                                  data);
  }
  const char* GetErrorMessage(const OrtStatus* status) const {
    return call<const char* (*)(const OrtStatus*)>(kGetErrorMessage)(status);
  }
  void ReleaseStatus(OrtStatus* status) const {
    call<void (*)(OrtStatus*)>(kReleaseStatus)(status);
  }
  void ReleaseTensorTypeAndShapeInfo(OrtTensorTypeAndShapeInfo* info) const {
    call<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  }

 private:
  template <typename F>
  F call(Entry entry) const {
    return reinterpret_cast<F>(table_[entry]);
  }
  void* const* table_;
};

}  // namespace ort_abi
