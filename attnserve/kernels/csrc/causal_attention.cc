// The language model's attention: GroupQueryAttention's decoding cases, in place.
//
//   ai.attnserve.CausalGroupAttention(qkv (B, S, (H + 2 Hkv) D), past_key, past_value
//       (B, Hkv, W, D), seqlens_k (B,) int32, total_sequence_length () int32, cos, sin (P, D/2))
//     -> out (B, S, H D), present_key, present_value (B, Hkv, max(W, total), D)
//
// ONNX Runtime's GroupQueryAttention (com.microsoft; do_rotary, rotate-half, scale 1/sqrt(D),
// no separate key and value inputs) for the calls a language model's step makes: a first
// prompt (S == total: each row's tokens from column 0, right-padded; seqlens_k + 1 real ones),
// or S new tokens after seqlens_k + 1 - S cached ones in every row. Query t of a row sits at
// position past + t and attends keys 0 .. past + t. The new keys (rotated) and values go to
// columns past .. past + S - 1 of present, which is past's own memory when the caller binds
// both to one buffer (else past is copied first). The H query heads are Hkv groups of G: a kv
// head's keys and values are read once for its G queries, and each (row, kv head, chunk of
// tokens) is computed alone, in a fixed order, so a row's result does not depend on the batch.
// A padding query of a first prompt (after its row's real tokens) gets zeros.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "ops.h"
#include "ort_glue.h"
#include "pool.h"
#include "simd.h"

namespace attnserve::kernels {
namespace {

// softmax of a row of n scores, in place.
using SoftmaxFn = void (*)(float* x, int64_t n);

void softmax_portable(float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - top));
  const float inverse = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) x[i] *= inverse;
}

#if ATTNSERVE_AVX512
__attribute__((target("avx512f"))) void softmax_avx512(float* x, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = lowest;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
  top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, tail, x + i));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), shift));
  _mm512_mask_storeu_ps(x + i, tail, e);
  sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (i = 0; i + kLanes <= n; i += kLanes) {
    _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inverse));
  }
  _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), inverse));
}

// The language model's scores and mix for a kv head's G queries at once, D = 16 C: keys in
// blocks of 16, each query's 16 dot products summed across lanes by one transposing tree (15
// shuffle-and-add steps for 16 scores instead of a reduction each); each value row read once
// for all G queries.
__attribute__((target("avx512f"), always_inline)) inline __m512 pair_sum(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 quad_sum(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 block_sum(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}

// lane i = the sum of a[i]'s lanes
__attribute__((target("avx512f"), always_inline)) inline __m512 lane_sums(const __m512* a) {
  const __m512 c0 = quad_sum(pair_sum(a[0], a[1]), pair_sum(a[2], a[3]));
  const __m512 c1 = quad_sum(pair_sum(a[4], a[5]), pair_sum(a[6], a[7]));
  const __m512 c2 = quad_sum(pair_sum(a[8], a[9]), pair_sum(a[10], a[11]));
  const __m512 c3 = quad_sum(pair_sum(a[12], a[13]), pair_sum(a[14], a[15]));
  return block_sum(block_sum(c0, c1), block_sum(c2, c3));
}

template <int C>
__attribute__((target("avx512f"))) void group_scores(const float* q, const float* k, float* out,
                                                     int64_t m_count, int64_t n_count) {
  constexpr int64_t depth = C * kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    __m512 qm[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) qm[c] = _mm512_loadu_ps(q + m * depth + c * kLanes);
    float* om = out + m * n_count;
    int64_t n = 0;
    for (; n + kLanes <= n_count; n += kLanes) {
      __m512 a[kLanes];
      const float* kn = k + n * depth;
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) {
        a[i] = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn + i * depth));
#pragma GCC unroll 8
        for (int c = 1; c < C; ++c) {
          a[i] = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + i * depth + c * kLanes), a[i]);
        }
      }
      _mm512_storeu_ps(om + n, lane_sums(a));
    }
    for (; n < n_count; ++n) {
      const float* kn = k + n * depth;
      __m512 a = _mm512_mul_ps(qm[0], _mm512_loadu_ps(kn));
#pragma GCC unroll 8
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qm[c], _mm512_loadu_ps(kn + c * kLanes), a);
      om[n] = _mm512_reduce_add_ps(a);
    }
  }
}

// p (M, N) times v (N, D), R query rows at a time (R C accumulators), each value row read once
// for the R rows.
template <int C, int R>
__attribute__((target("avx512f"))) void group_mix_rows(const float* p, const float* v, float* out,
                                                       int64_t n_count) {
  constexpr int64_t depth = C * kLanes;
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t n = 0; n < n_count; ++n) {
    __m512 row[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) row[c] = _mm512_loadu_ps(v + n * depth + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 weight = _mm512_set1_ps(p[r * n_count + n]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(weight, row[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * depth + c * kLanes, acc[r][c]);
  }
}

template <int C>
__attribute__((target("avx512f"))) void group_mix(const float* p, const float* v, float* out,
                                                  int64_t m_count, int64_t n_count) {
  constexpr int kRows = C <= 4 ? 4 : 2;  // at most 16 accumulators, besides a row's C
  constexpr int64_t depth = C * kLanes;
  int64_t m = 0;
  for (; m + kRows <= m_count; m += kRows) {
    group_mix_rows<C, kRows>(p + m * n_count, v, out + m * depth, n_count);
  }
  const float* pm = p + m * n_count;
  float* om = out + m * depth;
  switch (m_count - m) {
    case 3: return group_mix_rows<C, 3>(pm, v, om, n_count);
    case 2: return group_mix_rows<C, 2>(pm, v, om, n_count);
    case 1: return group_mix_rows<C, 1>(pm, v, om, n_count);
    default: return;
  }
}

template <int C>
void group_scores_block(const float* q, const void* k, float* out, int64_t m_count,
                        int64_t n_count, int64_t) {
  group_scores<C>(q, static_cast<const float*>(k), out, m_count, n_count);
}

// The same softmax and grouped scores on AVX2 (simd.h's F16), the same floats: the transposing
// tree's steps on each half (the in-lane unpacks) and across the halves (the block shuffles).
// The grouped mix is attention.cc's AVX2 mix (one chain of fused multiply-adds per output
// element in the order of n, as group_mix).
ATTNSERVE_AVX2_INLINE F16 tail_load16(const float* x, int64_t count, float fill) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = l < count ? x[l] : fill;
  return load16_avx2(lanes);
}

ATTNSERVE_AVX2 void softmax_avx2(float* x, int64_t n) {
  const float lowest_value = -std::numeric_limits<float>::infinity();
  F16 top = set16_avx2(lowest_value);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = max16(top, load16_avx2(x + i));
  const int64_t rest = n - i;
  top = max16(top, tail_load16(x + i, rest, lowest_value));
  const F16 shift = set16_avx2(reduce_max16(top));
  F16 sum = zero16_avx2();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const F16 e = exp16_avx2(sub16(load16_avx2(x + i), shift));
    store16_avx2(x + i, e);
    sum = add16(sum, e);
  }
  float lanes[kLanes];
  store16_avx2(lanes, exp16_avx2(sub16(tail_load16(x + i, rest, 0.0f), shift)));
  for (int l = rest; l < kLanes; ++l) lanes[l] = 0.0f;  // as the masked move
  for (int l = 0; l < rest; ++l) x[i + l] = lanes[l];
  sum = add16(sum, load16_avx2(lanes));
  const float inverse = 1.0f / reduce_add16(sum);
  for (i = 0; i < n; ++i) x[i] *= inverse;
}

ATTNSERVE_AVX2_INLINE F16 pair_sum_avx2(F16 a, F16 b) {
  return {_mm256_add_ps(_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.lo, b.lo)),
          _mm256_add_ps(_mm256_unpacklo_ps(a.hi, b.hi), _mm256_unpackhi_ps(a.hi, b.hi))};
}
ATTNSERVE_AVX2_INLINE __m256 quad_sum8(__m256 a, __m256 b) {
  const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
ATTNSERVE_AVX2_INLINE F16 quad_sum_avx2(F16 a, F16 b) {
  return {quad_sum8(a.lo, b.lo), quad_sum8(a.hi, b.hi)};
}
// _mm512_shuffle_f32x4(a, b, 0x88) holds the 128-bit blocks (a0, a2, b0, b2), 0xdd (a1, a3,
// b1, b3); a.lo holds a's blocks 0 and 1, a.hi 2 and 3.
ATTNSERVE_AVX2_INLINE F16 block_sum_avx2(F16 a, F16 b) {
  return {_mm256_add_ps(_mm256_permute2f128_ps(a.lo, a.hi, 0x20),
                        _mm256_permute2f128_ps(a.lo, a.hi, 0x31)),
          _mm256_add_ps(_mm256_permute2f128_ps(b.lo, b.hi, 0x20),
                        _mm256_permute2f128_ps(b.lo, b.hi, 0x31))};
}
ATTNSERVE_AVX2_INLINE F16 lane_sums_avx2(const F16* a) {
  const F16 c0 = quad_sum_avx2(pair_sum_avx2(a[0], a[1]), pair_sum_avx2(a[2], a[3]));
  const F16 c1 = quad_sum_avx2(pair_sum_avx2(a[4], a[5]), pair_sum_avx2(a[6], a[7]));
  const F16 c2 = quad_sum_avx2(pair_sum_avx2(a[8], a[9]), pair_sum_avx2(a[10], a[11]));
  const F16 c3 = quad_sum_avx2(pair_sum_avx2(a[12], a[13]), pair_sum_avx2(a[14], a[15]));
  return block_sum_avx2(block_sum_avx2(c0, c1), block_sum_avx2(c2, c3));
}

template <int C>
ATTNSERVE_AVX2 void group_scores_avx2(const float* q, const void* keys, float* out,
                                      int64_t m_count, int64_t n_count, int64_t) {
  constexpr int64_t depth = C * kLanes;
  const float* k = static_cast<const float*>(keys);
  for (int64_t m = 0; m < m_count; ++m) {
    const float* qm = q + m * depth;
    float* om = out + m * n_count;
    int64_t n = 0;
    for (; n + kLanes <= n_count; n += kLanes) {
      F16 a[kLanes];
      const float* kn = k + n * depth;
      for (int i = 0; i < kLanes; ++i) {
        a[i] = mul16(load16_avx2(qm), load16_avx2(kn + i * depth));
        for (int c = 1; c < C; ++c) {
          a[i] = fmadd16(load16_avx2(qm + c * kLanes), load16_avx2(kn + i * depth + c * kLanes),
                         a[i]);
        }
      }
      store16_avx2(om + n, lane_sums_avx2(a));
    }
    for (; n < n_count; ++n) {
      const float* kn = k + n * depth;
      F16 a = mul16(load16_avx2(qm), load16_avx2(kn));
      for (int c = 1; c < C; ++c) {
        a = fmadd16(load16_avx2(qm + c * kLanes), load16_avx2(kn + c * kLanes), a);
      }
      om[n] = reduce_add16(a);
    }
  }
}

template <int C>
void group_mix_block(const float* p, const void* v, float* out, int64_t m_count, int64_t n_count,
                     int64_t) {
  group_mix<C>(p, static_cast<const float*>(v), out, m_count, n_count);
}
#endif

// The grouped loops for head sizes 16, 32, 64 and 128 on AVX-512 (AVX2: the grouped scores),
// else the attention's loops.
Block pick_group(bool scores, int64_t depth) {
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) {
    switch (depth) {
      case 16: return scores ? group_scores_block<1> : group_mix_block<1>;
      case 32: return scores ? group_scores_block<2> : group_mix_block<2>;
      case 64: return scores ? group_scores_block<4> : group_mix_block<4>;
      case 128: return scores ? group_scores_block<8> : group_mix_block<8>;
      default: break;
    }
  }
  if (cpu_has_avx2() && scores) {  // the mix: attention.cc's, below
    switch (depth) {
      case 16: return group_scores_avx2<1>;
      case 32: return group_scores_avx2<2>;
      case 64: return group_scores_avx2<4>;
      case 128: return group_scores_avx2<8>;
      default: break;
    }
  }
#endif
  return pick<float>(scores, depth);
}

SoftmaxFn pick_softmax() {
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) return softmax_avx512;
  if (cpu_has_avx2()) return softmax_avx2;
#endif
  return softmax_portable;
}

struct CausalJob {
  const float* qkv;
  float* keys;    // present (B, Hkv, width, D)
  float* values;
  const int32_t* seqlens;
  const float* cos;  // (positions, D / 2)
  const float* sin;
  float* out;
  int64_t batch, seq, heads, kv_heads, depth, width;
  bool first;
  float scale;
  int64_t chunk, chunks;  // query tokens per task, tasks per (row, kv head)
  Block scores, mix;
  SoftmaxFn softmax;

  int64_t past(int64_t b) const { return first ? 0 : seqlens[b] + 1 - seq; }
  const float* token(int64_t b, int64_t t) const {
    return qkv + (b * seq + t) * (heads + 2 * kv_heads) * depth;
  }
  int64_t column(int64_t b, int64_t j, int64_t c) const {
    return ((b * kv_heads + j) * width + c) * depth;
  }
};

// y = rotate_half(x) at `position`, times `scale`: (x1 c - x2 s, x2 c + x1 s) per half.
void rotate(const CausalJob& job, const float* x, int64_t position, float scale, float* y) {
  const int64_t half = job.depth / 2;
  const float* c = job.cos + position * half;
  const float* s = job.sin + position * half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    y[i] = (x1 * c[i] - x2 * s[i]) * scale;
    y[i + half] = (x2 * c[i] + x1 * s[i]) * scale;
  }
}

// Task (row, kv head): its new tokens' rotated keys and values into the cache.
void causal_write(void* data, size_t index) {
  const CausalJob& job = *static_cast<const CausalJob*>(data);
  const int64_t b = static_cast<int64_t>(index) / job.kv_heads;
  const int64_t j = static_cast<int64_t>(index) % job.kv_heads;
  const int64_t past = job.past(b), d = job.depth;
  for (int64_t t = 0; t < job.seq; ++t) {
    const float* x = job.token(b, t) + (job.heads + j) * d;
    rotate(job, x, past + t, 1.0f, job.keys + job.column(b, j, past + t));
    std::memcpy(job.values + job.column(b, j, past + t), x + job.kv_heads * d,
                sizeof(float) * d);
  }
}

// Task (row, kv head, chunk of tokens): the G query heads of each token against the row's keys.
void causal_attend(void* data, size_t index) {
  const CausalJob& job = *static_cast<const CausalJob*>(data);
  const int64_t i = static_cast<int64_t>(index);
  const int64_t c = i % job.chunks, j = (i / job.chunks) % job.kv_heads;
  const int64_t b = i / job.chunks / job.kv_heads;
  const int64_t groups = job.heads / job.kv_heads, d = job.depth, past = job.past(b);
  const int64_t last = job.first ? job.seqlens[b] : job.seq - 1;  // the row's last real token
  const float* keys = job.keys + job.column(b, j, 0);
  const float* values = job.values + job.column(b, j, 0);
  thread_local std::vector<float> q, p;
  q.resize(static_cast<size_t>(groups * d));
  for (int64_t t = c * job.chunk; t < std::min(job.seq, (c + 1) * job.chunk); ++t) {
    float* out = job.out + ((b * job.seq + t) * job.heads + j * groups) * d;
    if (t > last) {
      std::memset(out, 0, sizeof(float) * groups * d);
      continue;
    }
    const int64_t n = past + t + 1;
    p.resize(static_cast<size_t>(groups * n));
    for (int64_t g = 0; g < groups; ++g) {
      rotate(job, job.token(b, t) + (j * groups + g) * d, past + t, job.scale, q.data() + g * d);
    }
    job.scores(q.data(), keys, p.data(), groups, n, d);
    for (int64_t g = 0; g < groups; ++g) job.softmax(p.data() + g * n, n);
    job.mix(p.data(), values, out, groups, n, d);
  }
}

// Below this many multiply-adds a call runs on the calling thread (a decoding step of one row
// attends in microseconds, about what handing work to ONNX Runtime's threads costs); on the
// kernels' own threads, whose hand-over is cheaper, from a few dozen cached tokens a row the
// kv heads run side by side (their keys and values come from memory: SmolLM2 int4's step at
// two threads with 100 cached tokens 3.5 against 4.4 ms).
constexpr int64_t kCausalInline = 1 << 19;
constexpr int64_t kCausalInlineOwnThreads = 1 << 14;
constexpr int64_t kCausalChunk = 16;  // query tokens per task of a prompt

int32_t int32_scalar(const Tensor& t, const char* what) {
  if (t.count() != 1) throw Failure{ORT_INVALID_ARGUMENT, std::string(what) + " wants one value"};
  return *static_cast<const int32_t*>(t.raw);
}


}  // namespace

void run_causal(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor qkv = input(api, context, 0), past_k = input(api, context, 1);
  const Tensor past_v = input(api, context, 2), seqlens = input(api, context, 3);
  const int32_t total = int32_scalar(input(api, context, 4), "total_sequence_length");
  const Tensor cos = input(api, context, 5), sin = input(api, context, 6);
  const auto invalid = [](const std::string& what) {
    return Failure{ORT_INVALID_ARGUMENT, "CausalGroupAttention: " + what};
  };
  if (qkv.dims.size() != 3 || past_k.dims.size() != 4 || past_k.dims != past_v.dims) {
    throw invalid("wants qkv (B, S, (H + 2 Hkv) D) and past key/value (B, Hkv, W, D) alike");
  }
  CausalJob job{};
  job.batch = qkv.dims[0], job.seq = qkv.dims[1];
  job.kv_heads = past_k.dims[1], job.depth = past_k.dims[3];
  const int64_t width = past_k.dims[2];
  if (job.kv_heads <= 0 || job.depth <= 0 || job.depth % 2 != 0 || past_k.dims[0] != job.batch ||
      qkv.dims[2] % job.depth != 0 || qkv.dims[2] / job.depth <= 2 * job.kv_heads ||
      (qkv.dims[2] / job.depth - 2 * job.kv_heads) % job.kv_heads != 0) {
    throw invalid("qkv's width is not (H + 2 Hkv) D for the cache's Hkv and D");
  }
  job.heads = qkv.dims[2] / job.depth - 2 * job.kv_heads;
  if (seqlens.dims != std::vector<int64_t>{job.batch}) throw invalid("seqlens_k is not (B,)");
  if (cos.dims.size() != 2 || cos.dims != sin.dims || cos.dims[1] * 2 != job.depth) {
    throw invalid("cos and sin are not (positions, D / 2)");
  }
  job.first = job.seq == total;
  job.width = std::max<int64_t>(width, total);
  job.seqlens = static_cast<const int32_t*>(seqlens.raw);
  int64_t work = 0;
  for (int64_t b = 0; b < job.batch; ++b) {
    const int64_t past = job.past(b), length = job.seqlens[b] + int64_t{1};
    if (past < 0 || past > width || length > total || length < (job.first ? 1 : job.seq) ||
        past + job.seq > std::min(job.width, cos.dims[0])) {
      throw invalid("a row's seqlens_k does not fit total_sequence_length, the new tokens, the "
                    "cache or the rotary table");
    }
    work += job.seq * (past + job.seq) * job.heads * job.depth;
  }
  const std::vector<int64_t> present{job.batch, job.kv_heads, job.width, job.depth};
  job.out = static_cast<float*>(
      output(api, context, 0, {job.batch, job.seq, job.heads * job.depth}));
  job.keys = static_cast<float*>(output(api, context, 1, present));
  job.values = static_cast<float*>(output(api, context, 2, present));
  const int64_t slab = width * job.depth;  // one (row, kv head) of past
  for (auto [to, from] : {std::pair{job.keys, past_k.data()}, {job.values, past_v.data()}}) {
    if (to == from || slab == 0) continue;  // bound to one buffer: in place
    for (int64_t s = 0; s < job.batch * job.kv_heads; ++s) {
      std::memcpy(to + s * job.width * job.depth, from + s * slab, sizeof(float) * slab);
    }
  }
  job.qkv = qkv.data(), job.cos = cos.data(), job.sin = sin.data();
  job.scale = 1.0f / std::sqrt(static_cast<float>(job.depth));
  job.scores = pick_group(true, job.depth), job.mix = pick_group(false, job.depth);
  job.softmax = pick_softmax();
  job.chunk = std::min<int64_t>(std::max<int64_t>(job.seq, 1), kCausalChunk);
  job.chunks = (job.seq + job.chunk - 1) / job.chunk;
  const size_t writes = static_cast<size_t>(job.batch * job.kv_heads);
  const size_t tasks = writes * static_cast<size_t>(job.chunks);
  if (tasks == 0) return;
  if (work < (pool().threads() > 1 ? kCausalInlineOwnThreads : kCausalInline)) {
    for (size_t i = 0; i < writes; ++i) causal_write(&job, i);
    for (size_t i = 0; i < tasks; ++i) causal_attend(&job, i);
    return;
  }
  for_each_row(api, context, causal_write, writes, &job);
  for_each_row(api, context, causal_attend, tasks, &job);
}

}  // namespace attnserve::kernels
