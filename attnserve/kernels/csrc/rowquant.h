// Per-row int8 activations: a row's scale and its uint8 values in two passes. RowQuantize's
// loops, and what the integer products share with it (qmatmul.cc quantizes RowQMatMul's rows
// with them, blockquant.cc each block of 32 of a row).
//
// What the per-row int8 export writes as four nodes (Abs, ReduceMax, Div, QuantizeLinear: four
// passes over the activation, three written): m = max |x| over the row, and
// q = saturate(round(x / m / (1/127))) + 128, with ONNX Runtime's own arithmetic (two IEEE
// divisions, the clamp to [-128, 127] before rounding half to even; 0/0 becomes 0), so the
// kernel's bytes are the stock nodes' bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd.h"

namespace attnserve::kernels {

inline constexpr float kStep = 1.0f / 127.0f;

// Rows per task of an integer product on the session's threads.
inline constexpr int64_t kTaskRows = 96;
// Activations of at most this many values are quantized on the calling thread (a few rows: not
// worth waking the threads).
inline constexpr int64_t kInlineQuantize = 1 << 14;

// max |x| of a row, NaN when it holds one (as ReduceMax: the row's bytes are then all 0).
float row_max_portable(const float* x, int64_t n);
// The row's bytes for its max |x| m.
void quantize_portable(const float* x, int64_t n, float m, uint8_t* q);
#if ATTNSERVE_AVX512
__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t n);
__attribute__((target("avx512f"))) void quantize_avx512(const float* x, int64_t n, float m,
                                                        uint8_t* q);
ATTNSERVE_AVX2 float row_max_avx2(const float* x, int64_t n);
ATTNSERVE_AVX2 void quantize_avx2(const float* x, int64_t n, float m, uint8_t* q);
#endif

struct RowQuantJob {
  float (*row_max)(const float*, int64_t);
  void (*quantize)(const float*, int64_t, float, uint8_t*);
  const float* x;
  uint8_t* q;
  float* scales;
  int64_t columns;
};

// A job quantizing the rows of x (columns each) into q and scales, on this CPU's loops.
RowQuantJob row_quant_job(const float* x, uint8_t* q, float* scales, int64_t columns);

// Row `index` of the job (a RowQuantJob): its scale and its bytes.
void row_quantize_one(void* data, size_t index);

}  // namespace attnserve::kernels
