// Block-quantized products: 4-bit affine blocks (llama.cpp's Q4_1) and 8-bit symmetric ones
// (Q8_0), a weight-only product on AVX-512 VNNI or AVX2.
//
//   ai.attnserve.BlockQ4MatMul(x (..., K), q (N/16, K/32, 256) uint8, d, m (N/16, K/32, 16)
//       float16) -> (..., N)
//   ai.attnserve.BlockQ8MatMul(x, q (N/16, K/32, 512) uint8, d) -> (..., N)
//
// W (K, N) in blocks of 32 along K per column: w = d * q + m, q in 0..15, d and m float16 per
// block and column. The activation x is quantized per block of 32 of a row, as RowQuantize
// quantizes a row (s = max |x| over the block, the same bytes, here read as signed: x ~
// (s / 127) xq), and the product is summed exactly in integers per block:
//   y = sum_b (s_b / 127) * (d_b * (q . xq)_b + m_b * sum(xq)_b)
// what llama.cpp's Q4_1 x Q8_1 dot product computes. The weight is stored as the kernel reads
// it, panels of 16 columns: q (N / 16, K / 32, 256) uint8, per block four groups of 64 bytes,
// byte [g][c][i] holding q[4 g + i][c] in its low nibble and q[16 + 4 g + i][c] in its high
// one; d and m (N / 16, K / 32, 16) float16. One vpdpbusd multiplies four k of 16 columns (the
// weights unsigned, the activations signed). A row's result depends on that row alone.
// BlockQ8MatMul is the same product with llama.cpp's Q8_0 blocks, w = d * (q - 128), q uint8
// (N / 16, K / 32, 512), byte [g][c][i] holding q[4 g + i][c]; d float16.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"
#include "ort_glue.h"
#include "rowquant.h"
#include "simd.h"

namespace attnserve::kernels {
namespace {

constexpr int64_t kQ4Block = 32;
constexpr int64_t kQ4Panel = 16;
constexpr int64_t kQ4PanelBytes = kQ4Block * kQ4Panel / 2;  // 256
constexpr int64_t kQ8PanelBytes = kQ4Block * kQ4Panel;  // 512: 8-bit blocks (BlockQ8MatMul)
constexpr int kQ4Rows = 4;  // rows per register block
constexpr int64_t kQ4TaskPanels = 4;  // panels per task
constexpr int64_t kQ4Prefetch = 16;  // blocks ahead

struct Q4Job {
  int bits;            // 4: BlockQ4MatMul; 8: BlockQ8MatMul (w = d * (q - 128), no m)
  const int8_t* xq;    // (rows, K) the activations' signed bytes
  const float* scale;  // (rows, K / 32) s_b / 127
  const float* sums;   // (rows, K / 32) sum(xq)_b
  const uint8_t* q;
  const Half* d;
  const Half* m;
  float* y;  // (rows, N)
  int64_t rows, k, n, blocks, panels, row_tasks;
};

// Per block of 32 of one row: its RowQuantize bytes read as signed, s_b / 127 and sum(xq)_b.
void q4_quantize_row(const Q4Job& job, const float* x, int64_t row,
                     float (*row_max)(const float*, int64_t),
                     void (*quantize)(const float*, int64_t, float, uint8_t*)) {
  int8_t* xq = const_cast<int8_t*>(job.xq) + row * job.k;
  float* scale = const_cast<float*>(job.scale) + row * job.blocks;
  float* sums = const_cast<float*>(job.sums) + row * job.blocks;
  for (int64_t b = 0; b < job.blocks; ++b) {
    const float* xb = x + b * kQ4Block;
    const float s = row_max(xb, kQ4Block);
    uint8_t bytes[kQ4Block];
    quantize(xb, kQ4Block, s, bytes);
    int32_t total = 0;
    for (int64_t i = 0; i < kQ4Block; ++i) {
      const int8_t v = static_cast<int8_t>(bytes[i] ^ 0x80u);  // zero point 128 -> signed
      xq[b * kQ4Block + i] = v;
      total += v;
    }
    scale[b] = s * kStep;
    sums[b] = static_cast<float>(total);
  }
}

#if ATTNSERVE_AVX512
// R rows (1..kQ4Rows) by one panel of 16 columns, over all of K. w[G] holds group G of a
// block (k = 4 G .. 4 G + 3) of the panel's 16 columns: from a 4-bit block's nibbles, or an
// 8-bit block's bytes (unsigned, zero point 128: the sums lose 128 sum(xq) after the products).
template <int R, int Bits>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void q4_block(const Q4Job& job,
                                                                     int64_t p, int64_t r) {
  constexpr int64_t kBytes = Bits == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  const uint8_t* q = job.q + p * job.blocks * kBytes;
  const Half* d = job.d + p * job.blocks * kQ4Panel;
  const Half* m = Bits == 4 ? job.m + p * job.blocks * kQ4Panel : nullptr;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  // blocks of the weight (its panels one after another) left after this panel's first
  const int64_t left = (job.panels - p) * job.blocks;
  for (int64_t b = 0; b < job.blocks; ++b, q += kBytes, d += kQ4Panel) {
    const bool ahead = b + kQ4Prefetch < left;  // prefetch only inside the weight
    for (int line = 0; ahead && line < kBytes / 64; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(q + kQ4Prefetch * kBytes + 64 * line),
                   _MM_HINT_T0);
    }
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(d + kQ4Prefetch * kQ4Panel), _MM_HINT_T0);
    }
    __m512i w[8];
    __m512 mb = _mm512_setzero_ps();
    if constexpr (Bits == 4) {
      if (ahead) {
        _mm_prefetch(reinterpret_cast<const char*>(m + kQ4Prefetch * kQ4Panel), _MM_HINT_T0);
      }
      for (int g = 0; g < 4; ++g) {
        const __m512i bytes = _mm512_loadu_si512(q + 64 * g);
        w[g] = _mm512_and_si512(bytes, low4);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      }
      mb = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m)));
      m += kQ4Panel;
    } else {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(q + 64 * g);
    }
    const __m512 db = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const int8_t* x = job.xq + row * job.k + b * kQ4Block;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        int32_t quad0, quad1;
        std::memcpy(&quad0, x + 4 * g, 4);
        std::memcpy(&quad1, x + 4 * g + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(quad0));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(quad1));
      }
      const int64_t at = row * job.blocks + b;
      __m512 t;
      if constexpr (Bits == 4) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        t = _mm512_fmadd_ps(dot, db, _mm512_mul_ps(mb, _mm512_set1_ps(job.sums[at])));
      } else {
        const __m512i offset = _mm512_set1_epi32(128 * static_cast<int32_t>(job.sums[at]));
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(s0, s1), offset)),
                          db);
      }
      acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(job.scale[at]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(job.y + (r + i) * job.n + p * kQ4Panel, acc[i]);
}

template <int Bits>
void q4_rows(const Q4Job& job, int64_t p, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kQ4Rows <= r1; r += kQ4Rows) q4_block<kQ4Rows, Bits>(job, p, r);
  switch (r1 - r) {
    case 3: return q4_block<3, Bits>(job, p, r);
    case 2: return q4_block<2, Bits>(job, p, r);
    case 1: return q4_block<1, Bits>(job, p, r);
    default: return;
  }
}

// The same products on AVX2 (a CPU without VNNI): the same integer sums, exact (a 4-bit weight
// times a signed byte, pairs added by vpmaddubsw, fit int16; 8-bit weights are widened to int16
// first, vpmaddwd), and the same float epilogue lane for lane (simd.h's F16: columns 0-7 in
// `lo`, 8-15 in `hi`): the AVX-512 kernel's results bit for bit.
constexpr int kQ4RowsAvx2 = 2;  // rows per register block (sixteen registers)

// Four signed bytes of x as one 32-bit value.
inline int32_t quad_of(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return quad;
}

// 8 columns' sums of 4 products each (w: the columns' 4 bytes side by side, 0..15).
ATTNSERVE_AVX2_INLINE __m256i nibble_dot_avx2(__m256i w, __m256i quad) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, quad), _mm256_set1_epi16(1));
}

// 4 columns' pairs of products (w: 16 bytes, 0..255, the columns' 4 bytes side by side):
// int32 lanes (c0: k0 + k1, c0: k2 + k3, c1: ..., c3: ...).
ATTNSERVE_AVX2_INLINE __m256i byte_pairs_avx2(__m128i w, __m256i quad16) {
  return _mm256_madd_epi16(_mm256_cvtepu8_epi16(w), quad16);
}

// Two registers of pairs (columns 0-3, 4-7) -> the 8 columns' sums in order.
ATTNSERVE_AVX2_INLINE __m256i pair_sums_avx2(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xd8);
}

template <int R, int Bits>
ATTNSERVE_AVX2 void q4_block_avx2(const Q4Job& job, int64_t p, int64_t r) {
  constexpr int64_t kBytes = Bits == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  const uint8_t* q = job.q + p * job.blocks * kBytes;
  const Half* d = job.d + p * job.blocks * kQ4Panel;
  const Half* m = Bits == 4 ? job.m + p * job.blocks * kQ4Panel : nullptr;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  F16 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zero16_avx2();
  for (int64_t b = 0; b < job.blocks; ++b, q += kBytes, d += kQ4Panel) {
    const F16 db = load16_avx2(d);
    F16 mb = zero16_avx2();
    if constexpr (Bits == 4) {
      mb = load16_avx2(m);
      m += kQ4Panel;
    }
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const int8_t* x = job.xq + row * job.k + b * kQ4Block;
      __m256i lo, hi;  // the 16 columns' exact sums over the block
      if constexpr (Bits == 4) {
        lo = hi = _mm256_setzero_si256();
        for (int g = 0; g < 4; ++g) {  // group g: k = 4 g .. (low nibbles), 16 + 4 g .. (high)
          const __m256i* group = reinterpret_cast<const __m256i*>(q + 64 * g);
          const __m256i bytes_lo = _mm256_loadu_si256(group);
          const __m256i bytes_hi = _mm256_loadu_si256(group + 1);
          const __m256i first = _mm256_set1_epi32(quad_of(x + 4 * g));
          const __m256i second = _mm256_set1_epi32(quad_of(x + 16 + 4 * g));
          const __m256i high_lo = _mm256_and_si256(_mm256_srli_epi16(bytes_lo, 4), low4);
          const __m256i high_hi = _mm256_and_si256(_mm256_srli_epi16(bytes_hi, 4), low4);
          lo = _mm256_add_epi32(lo, nibble_dot_avx2(_mm256_and_si256(bytes_lo, low4), first));
          hi = _mm256_add_epi32(hi, nibble_dot_avx2(_mm256_and_si256(bytes_hi, low4), first));
          lo = _mm256_add_epi32(lo, nibble_dot_avx2(high_lo, second));
          hi = _mm256_add_epi32(hi, nibble_dot_avx2(high_hi, second));
        }
      } else {
        __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256(), _mm256_setzero_si256()};  // columns by 4
        for (int g = 0; g < 8; ++g) {
          const __m256i quad16 = _mm256_cvtepi8_epi16(_mm_set1_epi32(quad_of(x + 4 * g)));
          const __m128i* group = reinterpret_cast<const __m128i*>(q + 64 * g);
          for (int part = 0; part < 4; ++part) {
            const __m256i products = byte_pairs_avx2(_mm_loadu_si128(group + part), quad16);
            pairs[part] = _mm256_add_epi32(pairs[part], products);
          }
        }
        const int32_t sum = static_cast<int32_t>(job.sums[row * job.blocks + b]);
        const __m256i offset = _mm256_set1_epi32(128 * sum);
        lo = _mm256_sub_epi32(pair_sums_avx2(pairs[0], pairs[1]), offset);
        hi = _mm256_sub_epi32(pair_sums_avx2(pairs[2], pairs[3]), offset);
      }
      const int64_t at = row * job.blocks + b;
      const F16 dot = {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
      F16 t;
      if constexpr (Bits == 4) {
        t = fmadd16(dot, db, mul16(mb, set16_avx2(job.sums[at])));
      } else {
        t = mul16(dot, db);
      }
      acc[i] = fmadd16(t, set16_avx2(job.scale[at]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store16_avx2(job.y + (r + i) * job.n + p * kQ4Panel, acc[i]);
}

template <int Bits>
void q4_rows_avx2(const Q4Job& job, int64_t p, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kQ4RowsAvx2 <= r1; r += kQ4RowsAvx2) q4_block_avx2<kQ4RowsAvx2, Bits>(job, p, r);
  if (r < r1) q4_block_avx2<1, Bits>(job, p, r);
}
#endif  // ATTNSERVE_AVX512

// One task: up to kQ4TaskPanels panels for up to kTaskRows rows: on AVX-512 VNNI, else on AVX2
// (the op is registered only on CPUs with one of them; a cap lowered after registration runs
// the AVX2 loops, which give the same floats).
void q4_task(void* data, size_t index) {
#if ATTNSERVE_AVX512
  const Q4Job& job = *static_cast<const Q4Job*>(data);
  const int64_t group = static_cast<int64_t>(index) / job.row_tasks;
  const int64_t t = static_cast<int64_t>(index) % job.row_tasks;
  const int64_t r0 = t * kTaskRows, r1 = std::min(job.rows, r0 + kTaskRows);
  const int64_t p1 = std::min(job.panels, (group + 1) * kQ4TaskPanels);
  const bool vnni = cpu_has_vnni();
  for (int64_t p = group * kQ4TaskPanels; p < p1; ++p) {
    if (vnni) {
      job.bits == 4 ? q4_rows<4>(job, p, r0, r1) : q4_rows<8>(job, p, r0, r1);
    } else {
      job.bits == 4 ? q4_rows_avx2<4>(job, p, r0, r1) : q4_rows_avx2<8>(job, p, r0, r1);
    }
  }
#else
  (void)data, (void)index;
#endif
}

struct Q4QuantJob {
  const Q4Job* job;
  const float* x;
};

void q4_quantize_task(void* data, size_t index) {
  const Q4QuantJob& quant = *static_cast<const Q4QuantJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) {
    return q4_quantize_row(*quant.job, quant.x + row * quant.job->k, row, row_max_avx512,
                           quantize_avx512);
  }
  if (cpu_has_avx2()) {
    return q4_quantize_row(*quant.job, quant.x + row * quant.job->k, row, row_max_avx2,
                           quantize_avx2);
  }
#endif
  q4_quantize_row(*quant.job, quant.x + row * quant.job->k, row, row_max_portable,
                  quantize_portable);
}

}  // namespace

// BlockQ4MatMul: x (..., K) float, q (N / 16, K / 32, 256) uint8, d and m (N / 16, K / 32, 16)
// float16 -> (..., N). BlockQ8MatMul (bits 8): q (N / 16, K / 32, 512), d, no m.
void run_block_matmul(const ort_abi::Fns& api, OrtKernelContext* context, int bits) {
  const Tensor x = input(api, context, 0);
  const Tensor q = input(api, context, 1);
  const Tensor d = input(api, context, 2);
  const Tensor m = bits == 4 ? input(api, context, 3) : d;
  const int64_t panel_bytes = bits == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  const bool shaped = !x.dims.empty() && q.dims.size() == 3 && q.dims[2] == panel_bytes &&
                      d.dims == std::vector<int64_t>{q.dims[0], q.dims[1], kQ4Panel} &&
                      m.dims == d.dims && x.dims.back() == q.dims[1] * kQ4Block;
  if (!shaped) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  bits == 4 ? "BlockQ4MatMul wants x (..., K), q (N/16, K/32, 256), d and m "
                              "(N/16, K/32, 16)"
                            : "BlockQ8MatMul wants x (..., K), q (N/16, K/32, 512), d (N/16, "
                              "K/32, 16)"};
  }
  Q4Job job{};
  job.bits = bits;
  job.k = x.dims.back(), job.blocks = q.dims[1], job.panels = q.dims[0];
  job.n = job.panels * kQ4Panel;
  job.rows = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) job.rows *= x.dims[i];
  std::vector<int64_t> dims = x.dims;
  dims.back() = job.n;
  job.y = static_cast<float*>(output(api, context, 0, dims));
  if (job.rows == 0 || job.n == 0) return;
  if (job.k == 0) {
    std::fill(job.y, job.y + job.rows * job.n, 0.0f);
    return;
  }
  // The quantized activations, in buffers of the calling thread kept between calls (every
  // element is written before it is read): no allocation per product of a decoding step.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scale, sums;
  xq.resize(static_cast<size_t>(job.rows * job.k));
  scale.resize(static_cast<size_t>(job.rows * job.blocks));
  sums.resize(scale.size());
  job.xq = xq.data(), job.scale = scale.data(), job.sums = sums.data();
  job.q = static_cast<const uint8_t*>(q.raw);
  job.d = static_cast<const Half*>(d.raw), job.m = static_cast<const Half*>(m.raw);
  Q4QuantJob quant{&job, x.data()};
  if (job.rows * job.k <= kInlineQuantize) {  // a few rows: not worth waking the threads
    for (int64_t row = 0; row < job.rows; ++row) q4_quantize_task(&quant, static_cast<size_t>(row));
  } else {
    for_each_row(api, context, q4_quantize_task, static_cast<size_t>(job.rows), &quant);
  }
  job.row_tasks = (job.rows + kTaskRows - 1) / kTaskRows;
  const int64_t groups = (job.panels + kQ4TaskPanels - 1) / kQ4TaskPanels;
  for_each_row(api, context, q4_task, static_cast<size_t>(groups * job.row_tasks), &job);
}

}  // namespace attnserve::kernels
