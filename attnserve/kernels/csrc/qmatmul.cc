// Per-row int8 products: MatMulIntegerToFloat with its per-row scale and the bias.
//
//   ai.attnserve.QMatMul(q (..., K) uint8, w (K, N) int8, scale (..., 1), w_scale (N,))
//   ai.attnserve.QMatMulBias(q, w, scale, w_scale, bias (N,)) -> (..., N)
//   ai.attnserve.PackedQMatMul[Bias]: w stored as the kernel reads it, (N / 64, K / 4, 64, 4)
//   ai.attnserve.RowQMatMul(x (..., K) float, w packed, w_scale): RowQuantize and PackedQMatMul
//
// y = (float(x_q @ w - 128 * colsum(w)) * w_scale) * x_scale (+ bias): what the per-row int8
// export writes as MatMulIntegerToFloat (the activation scale a (..., 1) tensor, applied after
// the GEMM's per-column scale) and the bias Add, in that arithmetic order, so the floats are
// the stock nodes' floats. The kernel reads the weight in panels of 64 columns, each 4
// consecutive k of a column adjacent as AVX-512 VNNI's vpdpbusd reads them: stored so by the
// export (PackedQMatMul), or packed into a copy at the node's first run (QMatMul; again only if
// its buffer moves); 128 x colsum is kept beside it. Each row's integer sums are exact and its
// epilogue is its own, so a row's result never depends on the other rows.
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "ops.h"
#include "ort_glue.h"
#include "rowquant.h"
#include "simd.h"

namespace attnserve::kernels {
namespace {

constexpr int64_t kPanel = 64;     // columns per packed panel: 4 registers of 16 int32 sums
constexpr int kRowBlock = 6;       // rows per register block: 24 sums + 4 weights + 1 row
constexpr int64_t kQuad = 4;  // panels a task reads side by side at one row
constexpr int64_t kMaxDepth = 65536;  // K: 255 x 127 x K (and 128 x 127 x K) fit in int32

}  // namespace

struct Packed {
  const void* source = nullptr;  // the weight buffer it was packed from (or is, packed)
  int64_t k = 0, n = 0, k4 = 0, panels = 0;
  std::vector<int8_t> storage;   // panels x k4 x 64 columns x 4, from `data` (64-byte aligned)
  const int8_t* data = nullptr;  // into `storage`, or the packed weight itself
  std::vector<int32_t> offsets;  // 128 x colsum, panels x 64
  const int8_t* panel(int64_t p) const { return data + p * k4 * kPanel * 4; }
};

namespace {

// A weight the export stored packed, (panels, k4, 64, 4): used where it is; only 128 x its
// column sums are computed, once.
void use_packed_weight(const int8_t* w, int64_t panels, int64_t k4, Packed& out) {
  out.k = 4 * k4, out.n = panels * kPanel, out.k4 = k4, out.panels = panels;
  out.data = w;
  out.offsets.assign(static_cast<size_t>(panels * kPanel), 0);
  for (int64_t p = 0; p < panels; ++p) {
    const int8_t* panel = out.panel(p);
    for (int64_t i = 0; i < k4 * kPanel * 4; ++i) {
      out.offsets[p * kPanel + (i / 4) % kPanel] += 128 * panel[i];
    }
  }
}

void pack_weight(const int8_t* w, int64_t k, int64_t n, Packed& out) {
  out.k = k, out.n = n, out.k4 = (k + 3) / 4, out.panels = (n + kPanel - 1) / kPanel;
  out.storage.assign(static_cast<size_t>(out.panels * out.k4 * kPanel * 4 + 64), 0);
  const uintptr_t start = reinterpret_cast<uintptr_t>(out.storage.data());
  int8_t* base = out.storage.data() + ((64 - start % 64) % 64);
  out.data = base;
  out.offsets.assign(static_cast<size_t>(out.panels * kPanel), 0);
  for (int64_t p = 0; p < out.panels; ++p) {
    int8_t* dst = base + p * out.k4 * kPanel * 4;
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const int8_t v = w[kk * n + p * kPanel + c];
        dst[(kk / 4) * kPanel * 4 + c * 4 + kk % 4] = v;
        out.offsets[p * kPanel + c] += 128 * v;
      }
    }
  }
}

struct QMatMulJob {
  const uint8_t* a;  // (rows, lda) uint8, lda >= 4 * k4 (padded)
  int64_t lda;
  const float* a_scale;  // (rows,)
  const Packed* w;
  const float* w_scale;  // (n,)
  const float* bias;     // (n,) or null
  float* y;              // (rows, n)
  int64_t rows, row_tasks;
};

#if ATTNSERVE_AVX512
// R rows (1..6) by one 64-column panel. The 24 sums are named variables, not an array: GCC
// keeps an array of vectors on the stack, storing every sum at every k.
#define ATTNSERVE_SUMS(i) __m512i s##i##0, s##i##1, s##i##2, s##i##3;
#define ATTNSERVE_ZERO(i)                                                             \
  if constexpr (R > i) {                                                              \
    s##i##0 = s##i##1 = s##i##2 = s##i##3 = _mm512_setzero_si512();                  \
  }
#define ATTNSERVE_ROW(i)                                                              \
  if constexpr (R > i) {                                                              \
    int32_t quad;                                                                     \
    std::memcpy(&quad, a + i * job.lda + 4 * k4, 4);                                  \
    const __m512i x = _mm512_set1_epi32(quad);                                        \
    s##i##0 = _mm512_dpbusd_epi32(s##i##0, x, b0);                                    \
    s##i##1 = _mm512_dpbusd_epi32(s##i##1, x, b1);                                    \
    s##i##2 = _mm512_dpbusd_epi32(s##i##2, x, b2);                                    \
    s##i##3 = _mm512_dpbusd_epi32(s##i##3, x, b3);                                    \
  }
#define ATTNSERVE_STORE(i, j)                                                         \
  if constexpr (R > i) out(i, j, s##i##j);
#define ATTNSERVE_STORE_ROW(i) \
  ATTNSERVE_STORE(i, 0) ATTNSERVE_STORE(i, 1) ATTNSERVE_STORE(i, 2) ATTNSERVE_STORE(i, 3)
#define ATTNSERVE_ALL(macro) macro(0) macro(1) macro(2) macro(3) macro(4) macro(5)

struct Epilogue {
  const QMatMulJob& job;
  int64_t c0, r;
  // Sums of row r + i, columns c0 + 16 j ..: (float(sum - offset) * w_scale) * x_scale + bias.
  __attribute__((target("avx512f,avx512bw"), always_inline)) inline void operator()(
      int i, int j, __m512i sums) const {
    const Packed& w = *job.w;
    const int64_t c = c0 + 16 * j;
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, w.n - c));
    if (left == 0) return;
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const __m512i offset = _mm512_loadu_si512(w.offsets.data() + c);
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset));
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, job.w_scale + c));
    v = _mm512_mul_ps(v, _mm512_set1_ps(job.a_scale[r + i]));
    if (job.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, job.bias + c));
    _mm512_mask_storeu_ps(job.y + (r + i) * w.n + c, mask, v);
  }
};

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void qmatmul_block(
    const QMatMulJob& job, int64_t p, int64_t r) {
  static_assert(R >= 1 && R <= kRowBlock, "rows per block");
  const Packed& w = *job.w;
  const int8_t* b = w.panel(p);
  const uint8_t* a = job.a + r * job.lda;
  ATTNSERVE_ALL(ATTNSERVE_SUMS)
  ATTNSERVE_ALL(ATTNSERVE_ZERO)
  for (int64_t k4 = 0; k4 < w.k4; ++k4, b += kPanel * 4) {
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
    const __m512i b2 = _mm512_loadu_si512(b + 128), b3 = _mm512_loadu_si512(b + 192);
    ATTNSERVE_ALL(ATTNSERVE_ROW)
  }
  const Epilogue out{job, p * kPanel, r};
  ATTNSERVE_ALL(ATTNSERVE_STORE_ROW)
}
#undef ATTNSERVE_SUMS
#undef ATTNSERVE_ZERO
#undef ATTNSERVE_ROW
#undef ATTNSERVE_STORE
#undef ATTNSERVE_STORE_ROW
#undef ATTNSERVE_ALL

// One row by four consecutive panels (256 columns), the four panels read side by side: at one
// row a product streams its weight from memory once, and four streams keep more of it in
// flight than one (16 sums in registers).
#define ATTNSERVE_QUAD_SUMS(q) __m512i t##q##0, t##q##1, t##q##2, t##q##3;
#define ATTNSERVE_QUAD_ZERO(q) t##q##0 = t##q##1 = t##q##2 = t##q##3 = _mm512_setzero_si512();
#define ATTNSERVE_QUAD_STEP(q)                                                    \
  {                                                                               \
    const int8_t* bq = b + q * stride;                                            \
    t##q##0 = _mm512_dpbusd_epi32(t##q##0, x, _mm512_loadu_si512(bq));            \
    t##q##1 = _mm512_dpbusd_epi32(t##q##1, x, _mm512_loadu_si512(bq + 64));       \
    t##q##2 = _mm512_dpbusd_epi32(t##q##2, x, _mm512_loadu_si512(bq + 128));      \
    t##q##3 = _mm512_dpbusd_epi32(t##q##3, x, _mm512_loadu_si512(bq + 192));      \
  }
#define ATTNSERVE_QUAD_STORE(q)                                                   \
  {                                                                               \
    const Epilogue out{job, (p + q) * kPanel, r};                                 \
    out(0, 0, t##q##0), out(0, 1, t##q##1), out(0, 2, t##q##2), out(0, 3, t##q##3); \
  }
#define ATTNSERVE_QUADS(macro) macro(0) macro(1) macro(2) macro(3)

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void qmatmul_row_quad(
    const QMatMulJob& job, int64_t p, int64_t r) {
  const Packed& w = *job.w;
  const int64_t stride = w.k4 * kPanel * 4;
  const int8_t* b = w.panel(p);
  const uint8_t* a = job.a + r * job.lda;
  ATTNSERVE_QUADS(ATTNSERVE_QUAD_SUMS)
  ATTNSERVE_QUADS(ATTNSERVE_QUAD_ZERO)
  for (int64_t k4 = 0; k4 < w.k4; ++k4, b += kPanel * 4) {
    int32_t quad;
    std::memcpy(&quad, a + 4 * k4, 4);
    const __m512i x = _mm512_set1_epi32(quad);
    ATTNSERVE_QUADS(ATTNSERVE_QUAD_STEP)
  }
  ATTNSERVE_QUADS(ATTNSERVE_QUAD_STORE)
}
#undef ATTNSERVE_QUAD_SUMS
#undef ATTNSERVE_QUAD_ZERO
#undef ATTNSERVE_QUAD_STEP
#undef ATTNSERVE_QUAD_STORE
#undef ATTNSERVE_QUADS

void qmatmul_avx512(const QMatMulJob& job, int64_t p, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kRowBlock <= r1; r += kRowBlock) qmatmul_block<kRowBlock>(job, p, r);
  switch (r1 - r) {
    case 5: return qmatmul_block<5>(job, p, r);
    case 4: return qmatmul_block<4>(job, p, r);
    case 3: return qmatmul_block<3>(job, p, r);
    case 2: return qmatmul_block<2>(job, p, r);
    case 1: return qmatmul_block<1>(job, p, r);
    default: return;
  }
}
#endif  // ATTNSERVE_AVX512

// One task: a panel of 64 columns for up to kTaskRows rows. The ops are registered only on a
// CPU with AVX-512 VNNI (elsewhere the graph runs the functions' stock bodies: ONNX Runtime's
// own GEMM is the fast one there).
void qmatmul_task(void* data, size_t index) {
#if ATTNSERVE_AVX512
  const QMatMulJob& job = *static_cast<const QMatMulJob*>(data);
  if (job.rows == 1) {  // a task is four panels, read side by side (or what is left of them)
    const int64_t p = static_cast<int64_t>(index) * kQuad;
    if (p + kQuad <= job.w->panels) return qmatmul_row_quad(job, p, 0);
    for (int64_t q = p; q < job.w->panels; ++q) qmatmul_avx512(job, q, 0, 1);
    return;
  }
  const int64_t p = static_cast<int64_t>(index) / job.row_tasks;
  const int64_t t = static_cast<int64_t>(index) % job.row_tasks;
  const int64_t r0 = t * kTaskRows, r1 = std::min(job.rows, r0 + kTaskRows);
  qmatmul_avx512(job, p, r0, r1);
#else
  (void)data, (void)index;
#endif
}

// The node's weight packed (once, and again if its buffer moves): a (K, N) weight into the
// kernel's own copy, a packed one where it is. The weight must be a constant (an initializer,
// as the graph rewrite makes it): the copy and the column sums are kept by buffer address.
std::shared_ptr<const Packed> packed_weight(PackedWeight& cache, const Tensor& w) {
  std::lock_guard<std::mutex> lock(cache.mutex);
  const bool packed = w.dims.size() == 4;
  const int64_t k = packed ? 4 * w.dims[1] : w.dims[0];
  const int64_t n = packed ? kPanel * w.dims[0] : w.dims[1];
  const std::shared_ptr<const Packed>& have = cache.packed;
  if (!have || have->source != w.raw || have->k != k || have->n != n) {
    auto fresh = std::make_shared<Packed>();
    const int8_t* data = static_cast<const int8_t*>(w.raw);
    if (packed) {
      use_packed_weight(data, w.dims[0], w.dims[1], *fresh);
    } else {
      pack_weight(data, k, n, *fresh);
    }
    fresh->source = w.raw;
    cache.packed = std::move(fresh);
  }
  return cache.packed;
}

}  // namespace

// x_q (..., K) uint8, w (K, N) int8 or packed (N / 64, K / 4, 64, 4), x_scale (..., 1),
// w_scale (N,) [, bias (N,)] -> (..., N).
//
// With `quantize` (RowQMatMul: x (..., K) float, w packed, w_scale): x's rows are quantized
// first, as RowQuantize quantizes them (the same bytes and scales, into buffers of the calling
// thread), one node where the graph had two.
void run_qmatmul(const ort_abi::Fns& api, PackedWeight& cache, OrtKernelContext* context,
                 bool with_bias, bool packed, bool quantize) {
  Tensor a = input(api, context, 0);
  const Tensor w = input(api, context, 1);
  Tensor a_scale;
  const Tensor w_scale = input(api, context, quantize ? 2 : 3);
  if (quantize) {
    if (a.dims.empty()) throw Failure{ORT_INVALID_ARGUMENT, "RowQMatMul wants x (..., K)"};
    const int64_t columns = a.dims.back();
    const int64_t count = a.count(), rows = count / std::max<int64_t>(columns, 1);
    thread_local std::vector<uint8_t> bytes;  // every element written before it is read
    thread_local std::vector<float> scales;
    bytes.resize(static_cast<size_t>(count));
    scales.resize(static_cast<size_t>(rows));
    RowQuantJob job = row_quant_job(a.data(), bytes.data(), scales.data(), columns);
    if (columns == 0) {
      std::fill(scales.begin(), scales.end(), 0.0f);
    } else if (count <= kInlineQuantize) {  // a few rows: not worth waking the threads
      for (int64_t r = 0; r < rows; ++r) row_quantize_one(&job, static_cast<size_t>(r));
    } else {
      for_each_row(api, context, row_quantize_one, static_cast<size_t>(rows), &job);
    }
    a.raw = bytes.data();
    a_scale.raw = scales.data();
    a_scale.dims = {rows};
  } else {
    a_scale = input(api, context, 2);
  }
  const bool shaped = packed ? w.dims.size() == 4 && w.dims[2] == kPanel && w.dims[3] == 4
                             : w.dims.size() == 2;
  const int64_t k = !shaped ? -1 : packed ? 4 * w.dims[1] : w.dims[0];
  if (a.dims.empty() || !shaped || a.dims.back() != k) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  packed ? "PackedQMatMul wants x (..., K) and a (N / 64, K / 4, 64, 4) weight"
                         : "QMatMul wants x (..., K) and a (K, N) weight"};
  }
  const int64_t n = packed ? kPanel * w.dims[0] : w.dims[1];
  if (k > kMaxDepth) {
    throw Failure{ORT_INVALID_ARGUMENT, "QMatMul's int32 sums hold K up to 65536"};
  }
  const int64_t rows = a.count() / std::max<int64_t>(k, 1);
  if (a_scale.count() != rows || w_scale.count() != n) {
    throw Failure{ORT_INVALID_ARGUMENT, "QMatMul wants a scale per row of x and per column of w"};
  }
  const float* bias = nullptr;
  if (with_bias) {
    const Tensor b = input(api, context, quantize ? 3 : 4);
    if (b.count() != n) throw Failure{ORT_INVALID_ARGUMENT, "QMatMul wants a bias per column"};
    bias = b.data();
  }
  std::vector<int64_t> dims = a.dims;
  dims.back() = n;
  float* y = static_cast<float*>(output(api, context, 0, dims));
  if (rows == 0 || n == 0) return;
  const std::shared_ptr<const Packed> weight = packed_weight(cache, w);
  QMatMulJob job{static_cast<const uint8_t*>(a.raw), k, a_scale.data(), weight.get(),
                 w_scale.data(), bias, y, rows, (rows + kTaskRows - 1) / kTaskRows};
  std::vector<uint8_t> padded;  // rows padded to 4 k: the packed weight's k beyond K are 0
  if (k % 4 != 0) {
    job.lda = weight->k4 * 4;
    padded.assign(static_cast<size_t>(rows * job.lda), 128);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(&padded[r * job.lda], job.a + r * k, k);
    job.a = padded.data();
  }
  const int64_t tasks = rows == 1 ? (weight->panels + kQuad - 1) / kQuad
                                  : weight->panels * job.row_tasks;
  for_each_row(api, context, qmatmul_task, static_cast<size_t>(tasks), &job);
}

}  // namespace attnserve::kernels
