// The op families' entry points, one per file, called by registration.cc for a node's run:
// each reads its inputs, allocates its outputs and throws a Failure (ort_glue.h) on bad input.
//
//   attention.cc         AttnScores, AttnMix, AttnScoresHalf, AttnMixHalf
//   vocab.cc             LogSoftmaxTopK
//   rowquant.cc          RowQuantize (its loops shared with the integer products)
//   qmatmul.cc           QMatMul, QMatMulBias, PackedQMatMul[Bias], RowQMatMul
//   blockquant.cc        BlockQ4MatMul, BlockQ8MatMul
//   causal_attention.cc  CausalGroupAttention
//   elementwise.cc       AddRMSNorm, SwiGLU
#pragma once

#include <memory>
#include <mutex>

#include "ort_abi.h"

namespace attnserve::kernels {

void run_attention(const ort_abi::Fns& api, OrtKernelContext* context, bool scores, bool half);

void run_vocab(const ort_abi::Fns& api, OrtKernelContext* context);

void run_row_quantize(const ort_abi::Fns& api, OrtKernelContext* context);

struct Packed;  // a QMatMul weight as the kernel reads it (qmatmul.cc)

// A QMatMul node's weight, packed at its first run (runs may be concurrent).
struct PackedWeight {
  std::mutex mutex;
  std::shared_ptr<const Packed> packed;
};

void run_qmatmul(const ort_abi::Fns& api, PackedWeight& cache, OrtKernelContext* context,
                 bool with_bias, bool packed, bool quantize = false);

// bits 4: BlockQ4MatMul; 8: BlockQ8MatMul.
void run_block_matmul(const ort_abi::Fns& api, OrtKernelContext* context, int bits);

void run_causal(const ort_abi::Fns& api, OrtKernelContext* context);

void run_add_norm(const ort_abi::Fns& api, OrtKernelContext* context);

void run_swiglu(const ort_abi::Fns& api, OrtKernelContext* context);

}  // namespace attnserve::kernels
