// attnserve's ONNX Runtime kernels: the ops the library registers in the domain ai.attnserve
// (ops.h lists them and their files), each node's kernel, and the library's other exported
// functions (read by attnserve/kernels/library.py).
//
// The graph declares each op as an ONNX function whose body is stock nodes
// (attnserve/kernels/functions.py), so a runtime without this library runs the body instead.
// The per-row int8 products (QMatMul..., RowQMatMul) are registered only on a CPU with AVX-512
// VNNI: elsewhere ONNX Runtime's own GEMM, running their bodies, is the fast one. The block
// products (BlockQ4MatMul, BlockQ8MatMul) are registered on AVX-512 VNNI and on AVX2.
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>

#include "ops.h"
#include "ort_abi.h"
#include "ort_glue.h"
#include "pool.h"
#include "simd.h"

#define ATTNSERVE_EXPORT extern "C" __attribute__((visibility("default")))

namespace attnserve::kernels {
namespace {

constexpr const char* kDomain = "ai.attnserve";

// Whether to register integer products at all: unless ATTNSERVE_KERNELS_QMATMUL is 0, false,
// no or off.
bool products_allowed() {
  const char* switch_value = std::getenv("ATTNSERVE_KERNELS_QMATMUL");
  if (switch_value != nullptr) {
    std::string value(switch_value);
    for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  }
  return true;
}

// Whether to register QMatMul and its kin (per-row int8): a CPU with AVX-512 VNNI.
bool use_qmatmul() {
#if ATTNSERVE_AVX512
  return products_allowed() && cpu_has_vnni();
#else
  return false;
#endif
}

// Whether to register BlockQ4MatMul and BlockQ8MatMul: AVX-512 VNNI, or AVX2 (blockquant.cc's
// AVX2 loops: the same sums and floats).
bool use_block_products() {
#if ATTNSERVE_AVX512
  return products_allowed() && (cpu_has_vnni() || cpu_has_avx2());
#else
  return false;
#endif
}

enum class Kind {
  kScores,
  kMix,
  kScoresHalf,
  kMixHalf,
  kVocab,
  kRowQuantize,
  kQMatMul,
  kQMatMulBias,
  kPackedQMatMul,
  kPackedQMatMulBias,
  kBlockQ4MatMul,
  kBlockQ8MatMul,
  kCausal,
  kAddNorm,
  kSwiGlu,
  kRowQMatMul
};

constexpr bool is_qmatmul(Kind kind) {
  return kind == Kind::kQMatMul || kind == Kind::kQMatMulBias || kind == Kind::kPackedQMatMul ||
         kind == Kind::kPackedQMatMulBias || kind == Kind::kRowQMatMul;
}

struct Kernel {
  Kernel(const ort_abi::Fns& fns, Kind op) : api(fns), kind(op) {}
  ort_abi::Fns api;
  Kind kind;
  // QMatMul: the node's weight, packed at its first run (runs may be concurrent).
  mutable PackedWeight weight;
};

void run(const Kernel& kernel, OrtKernelContext* context) {
  const ort_abi::Fns& api = kernel.api;
  if (kernel.kind == Kind::kRowQMatMul) {
    return run_qmatmul(api, kernel.weight, context, false, true, true);
  }
  if (is_qmatmul(kernel.kind)) {
    const bool bias = kernel.kind == Kind::kQMatMulBias || kernel.kind == Kind::kPackedQMatMulBias;
    const bool packed =
        kernel.kind == Kind::kPackedQMatMul || kernel.kind == Kind::kPackedQMatMulBias;
    return run_qmatmul(api, kernel.weight, context, bias, packed);
  }
  if (kernel.kind == Kind::kVocab) return run_vocab(api, context);
  if (kernel.kind == Kind::kBlockQ4MatMul) return run_block_matmul(api, context, 4);
  if (kernel.kind == Kind::kBlockQ8MatMul) return run_block_matmul(api, context, 8);
  if (kernel.kind == Kind::kRowQuantize) return run_row_quantize(api, context);
  if (kernel.kind == Kind::kCausal) return run_causal(api, context);
  if (kernel.kind == Kind::kAddNorm) return run_add_norm(api, context);
  if (kernel.kind == Kind::kSwiGlu) return run_swiglu(api, context);
  const bool scores = kernel.kind == Kind::kScores || kernel.kind == Kind::kScoresHalf;
  const bool half = kernel.kind == Kind::kScoresHalf || kernel.kind == Kind::kMixHalf;
  run_attention(api, context, scores, half);
}

template <Kind kind>
struct Op {
  static const char* name(const OrtCustomOp*) {
    switch (kind) {
      case Kind::kScores: return "AttnScores";
      case Kind::kMix: return "AttnMix";
      case Kind::kScoresHalf: return "AttnScoresHalf";
      case Kind::kMixHalf: return "AttnMixHalf";
      case Kind::kVocab: return "LogSoftmaxTopK";
      case Kind::kRowQuantize: return "RowQuantize";
      case Kind::kQMatMul: return "QMatMul";
      case Kind::kQMatMulBias: return "QMatMulBias";
      case Kind::kPackedQMatMul: return "PackedQMatMul";
      case Kind::kPackedQMatMulBias: return "PackedQMatMulBias";
      case Kind::kBlockQ4MatMul: return "BlockQ4MatMul";
      case Kind::kBlockQ8MatMul: return "BlockQ8MatMul";
      case Kind::kCausal: return "CausalGroupAttention";
      case Kind::kAddNorm: return "AddRMSNorm";
      case Kind::kSwiGlu: return "SwiGLU";
      case Kind::kRowQMatMul: return "RowQMatMul";
    }
    return "";
  }
  static OrtStatus* create(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo*,
                           void** kernel) {
    *kernel = new Kernel(ort_abi::Fns(api), kind);
    return nullptr;
  }
  static size_t inputs(const OrtCustomOp*) {
    switch (kind) {
      case Kind::kVocab: return 3;
      case Kind::kRowQuantize: return 1;
      case Kind::kQMatMul: return 4;
      case Kind::kQMatMulBias: return 5;
      case Kind::kPackedQMatMul: return 4;
      case Kind::kPackedQMatMulBias: return 5;
      case Kind::kBlockQ4MatMul: return 4;
      case Kind::kBlockQ8MatMul: return 3;
      case Kind::kCausal: return 7;
      case Kind::kAddNorm: return 4;
      case Kind::kSwiGlu: return 1;
      case Kind::kRowQMatMul: return 3;
      default: return 2;
    }
  }
  static size_t outputs(const OrtCustomOp*) {
    if (kind == Kind::kVocab || kind == Kind::kCausal) return 3;
    return kind == Kind::kRowQuantize || kind == Kind::kAddNorm ? 2 : 1;
  }
  static OrtElementType input_type(const OrtCustomOp*, size_t index) {
    if (kind == Kind::kRowQMatMul) return index == 1 ? ORT_ELEMENT_INT8 : ORT_ELEMENT_FLOAT;
    if (is_qmatmul(kind)) {
      return index == 0 ? ORT_ELEMENT_UINT8 : index == 1 ? ORT_ELEMENT_INT8 : ORT_ELEMENT_FLOAT;
    }
    if (kind == Kind::kBlockQ4MatMul || kind == Kind::kBlockQ8MatMul) {
      return index == 0 ? ORT_ELEMENT_FLOAT : index == 1 ? ORT_ELEMENT_UINT8 : ORT_ELEMENT_FLOAT16;
    }
    if (kind == Kind::kCausal) {
      return index == 3 || index == 4 ? ORT_ELEMENT_INT32 : ORT_ELEMENT_FLOAT;
    }
    if ((kind == Kind::kScoresHalf || kind == Kind::kMixHalf) && index == 1) {
      return ORT_ELEMENT_FLOAT16;
    }
    return kind == Kind::kVocab && index > 0 ? ORT_ELEMENT_INT64 : ORT_ELEMENT_FLOAT;
  }
  static OrtElementType output_type(const OrtCustomOp*, size_t index) {
    if (kind == Kind::kVocab && index == 2) return ORT_ELEMENT_INT64;
    if (kind == Kind::kRowQuantize && index == 0) return ORT_ELEMENT_UINT8;
    return ORT_ELEMENT_FLOAT;
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
  op.GetInputType = Op<kind>::input_type;
  op.GetInputTypeCount = Op<kind>::inputs;
  op.GetOutputType = Op<kind>::output_type;
  op.GetOutputTypeCount = Op<kind>::outputs;
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
const OrtCustomOp kScoresHalf = make_op<Kind::kScoresHalf>();
const OrtCustomOp kMixHalf = make_op<Kind::kMixHalf>();
const OrtCustomOp kVocab = make_op<Kind::kVocab>();
const OrtCustomOp kRowQuantize = make_op<Kind::kRowQuantize>();
const OrtCustomOp kQMatMul = make_op<Kind::kQMatMul>();
const OrtCustomOp kQMatMulBias = make_op<Kind::kQMatMulBias>();
const OrtCustomOp kPackedQMatMul = make_op<Kind::kPackedQMatMul>();
const OrtCustomOp kPackedQMatMulBias = make_op<Kind::kPackedQMatMulBias>();
const OrtCustomOp kBlockQ4MatMul = make_op<Kind::kBlockQ4MatMul>();
const OrtCustomOp kBlockQ8MatMul = make_op<Kind::kBlockQ8MatMul>();
const OrtCustomOp kCausal = make_op<Kind::kCausal>();
const OrtCustomOp kAddNorm = make_op<Kind::kAddNorm>();
const OrtCustomOp kSwiGlu = make_op<Kind::kSwiGlu>();
const OrtCustomOp kRowQMatMul = make_op<Kind::kRowQMatMul>();

}  // namespace

// The exported functions (extern "C": their plain names, the only symbols the library shows).

// Called by ONNX Runtime's SessionOptions.register_custom_ops_library.
ATTNSERVE_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                              const OrtApiBase* base) {
  const OrtApi* table = base->GetApi(ort_abi::kApiVersion);
  if (table == nullptr) {  // an older runtime: its sessions fail to load the library
    const ort_abi::Fns any(base->GetApi(1));
    return any.CreateStatus(ORT_FAIL, "attnserve kernels need ONNX Runtime 1.18 or later");
  }
  const ort_abi::Fns api(table);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api.CreateCustomOpDomain(kDomain, &domain)) return status;
  for (const OrtCustomOp* op :
       {&kScores, &kMix, &kScoresHalf, &kMixHalf, &kVocab, &kRowQuantize, &kCausal, &kAddNorm,
        &kSwiGlu}) {
    if (OrtStatus* status = api.CustomOpDomainAdd(domain, op)) return status;
  }
  const bool products = use_qmatmul(), blocks = use_block_products();  // each all or none
  for (const OrtCustomOp* op :
       {&kQMatMul, &kQMatMulBias, &kPackedQMatMul, &kPackedQMatMulBias, &kRowQMatMul}) {
    if (!products) break;
    if (OrtStatus* status = api.CustomOpDomainAdd(domain, op)) return status;
  }
  for (const OrtCustomOp* op : {&kBlockQ4MatMul, &kBlockQ8MatMul}) {
    if (!blocks) break;
    if (OrtStatus* status = api.CustomOpDomainAdd(domain, op)) return status;
  }
  return api.AddCustomOpDomain(options, domain);
}

// Whether the integer products (QMatMul..., RowQMatMul) are registered on this CPU.
ATTNSERVE_EXPORT int attnserve_kernels_integer_products() { return use_qmatmul() ? 1 : 0; }

// Whether the block products (BlockQ4MatMul, BlockQ8MatMul) are registered on this CPU.
ATTNSERVE_EXPORT int attnserve_kernels_block_products() { return use_block_products() ? 1 : 0; }

// The kernels' own threads: `threads` in all with the caller's (1: none, ONNX Runtime's are
// used), spinning up to `spin_us` microseconds between calls.
ATTNSERVE_EXPORT void attnserve_kernels_threads(int threads, int spin_us) {
  pool().resize(threads, spin_us);
}

// How many kernel calls ran on those threads so far (observability, tests).
ATTNSERVE_EXPORT uint64_t attnserve_kernels_thread_runs() {
  return pool().runs_.load(std::memory_order_relaxed);
}

// The instruction sets the loops may use from now on (simd.h's Isa: 0 portable, 1 AVX2, 2
// AVX-512; a negative `cap` changes nothing), at most the CPU's; returns the set they use. Tests
// and benchmarks run one CPU's loops for another's. The integer products are registered or not
// when a session registers the library: below AVX-512, sessions registered from then on go
// without them (as on a CPU without VNNI); one registered before keeps them.
ATTNSERVE_EXPORT int attnserve_kernels_isa(int cap) {
  if (cap >= 0) isa_cap().store(cap, std::memory_order_relaxed);
  return isa();
}

// The library's own version, read by attnserve/kernels/library.py to refuse a stale build.
ATTNSERVE_EXPORT int attnserve_kernels_version() { return 13; }

}  // namespace attnserve::kernels
