// attnserve's ONNX Runtime kernels: the decoder step's attention products, its log-softmax
// and TopK, per-row int8's activation quantization and its products.
//
// A decoding step multiplies each row's one query by its own cached keys and values: per
// (row, head) a (1 x D) by (D x T) product and a (1 x T) by (T x D) one. ONNX Runtime's MatMul
// runs each as a GEMM call of its own (thousands a step at beam 4 x batch 32, ~0.2 us each
// before any arithmetic); these loops do the same products with no call per (row, head).
//
//   ai.attnserve.AttnScores(q (B, H, M, D), k (B, H, N, D)) -> (B, H, M, N) = q @ k^T
//   ai.attnserve.AttnMix(p (B, H, M, N), v (B, H, N, D))    -> (B, H, M, D) = p @ v
//   ai.attnserve.AttnScoresHalf / AttnMixHalf: the same with k / v float16 (a half cache)
//   ai.attnserve.BlockQ4MatMul(x, q, d, m): a product with a weight in 4-bit affine blocks
//   ai.attnserve.BlockQ8MatMul(x, q, d): the same with 8-bit symmetric blocks (Q8_0)
//   ai.attnserve.CausalGroupAttention, AddRMSNorm, SwiGLU: a language model's attention
//   (GroupQueryAttention's cases, the cache written in place) and element-wise steps
//   (and a pool of the library's own threads the kernels run on when asked: see Pool)
//   (and LogSoftmaxTopK, RowQuantize, QMatMul / QMatMulBias: see their sections below)
//
// The graph declares each as an ONNX function whose body is the stock Transpose + MatMul, so
// a runtime without this library runs the body instead (attnserve/kernels/__init__.py).
// Each (row, head) is computed on its own, in a fixed order, so a row's result does not depend
// on the other rows of the batch.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cctype>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <utility>
#include <limits>
#include <pthread.h>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "ort_abi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define ATTNSERVE_AVX512 1
#endif

#define ATTNSERVE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr const char* kDomain = "ai.attnserve";
constexpr int kLanes = 16;  // floats in an AVX-512 register; the portable loops' partial sums

// The keys and values are float32, or float16 (a cache stored in half precision: half the
// bytes to read at every step). A half is widened to a float exactly before any arithmetic, so
// a half cache's products are the float loops' products of the widened values.
using Half = uint16_t;

inline float widen(Half h) {  // IEEE binary16 -> binary32, exact (subnormals, inf, NaN)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    while (!(mantissa & 0x400u)) mantissa <<= 1, ++shift;
    bits = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Portable loops: q (M, D) against k (N, D) into out (M, N), each dot product kLanes partial
// sums added pairwise; p (M, N) times v (N, D) into out (M, D), summed over n in order.
void scores_portable(const float* q, const void* keys, float* out, int64_t m_count,
                     int64_t n_count, int64_t depth) {
  const float* k = static_cast<const float*>(keys);
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

void mix_portable(const float* p, const void* values, float* out, int64_t m_count,
                  int64_t n_count, int64_t depth) {
  const float* v = static_cast<const float*>(values);
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

// The same on a half block, widened once into a float copy (per thread): the loops would
// otherwise widen every element again for every query row.
const float* widened(const void* halves, int64_t count) {
  thread_local std::vector<float> wide;
  wide.resize(static_cast<size_t>(count));
  const Half* h = static_cast<const Half*>(halves);
  for (int64_t i = 0; i < count; ++i) wide[static_cast<size_t>(i)] = widen(h[i]);
  return wide.data();
}

void scores_portable_half(const float* q, const void* keys, float* out, int64_t m_count,
                          int64_t n_count, int64_t depth) {
  scores_portable(q, widened(keys, n_count * depth), out, m_count, n_count, depth);
}

void mix_portable_half(const float* p, const void* values, float* out, int64_t m_count,
                       int64_t n_count, int64_t depth) {
  mix_portable(p, widened(values, n_count * depth), out, m_count, n_count, depth);
}

#if ATTNSERVE_AVX512
// AVX-512 for the head sizes transformers use (D a multiple of 16, at most 256): the query row
// and the output row stay in registers.
constexpr int64_t kMaxChunks = 16;

// Sixteen keys' or values' elements as floats.
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const float* x) {
  return _mm512_loadu_ps(x);
}
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// q (M, D) against k (N, D): four keys at a time (independent chains of fused multiply-adds).
template <typename T>
__attribute__((target("avx512f"))) void scores_avx512(const float* q, const void* keys,
                                                      float* out, int64_t m_count,
                                                      int64_t n_count, int64_t depth) {
  const T* k = static_cast<const T*>(keys);
  const int64_t chunks = depth / kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    __m512 qm[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) qm[c] = _mm512_loadu_ps(q + m * depth + c * kLanes);
    float* om = out + m * n_count;
    int64_t n = 0;
    for (; n + 4 <= n_count; n += 4) {
      const T* kn = k + n * depth;
      __m512 a0 = _mm512_mul_ps(qm[0], load16(kn));
      __m512 a1 = _mm512_mul_ps(qm[0], load16(kn + depth));
      __m512 a2 = _mm512_mul_ps(qm[0], load16(kn + 2 * depth));
      __m512 a3 = _mm512_mul_ps(qm[0], load16(kn + 3 * depth));
      for (int64_t c = 1; c < chunks; ++c) {
        const int64_t o = c * kLanes;
        a0 = _mm512_fmadd_ps(qm[c], load16(kn + o), a0);
        a1 = _mm512_fmadd_ps(qm[c], load16(kn + depth + o), a1);
        a2 = _mm512_fmadd_ps(qm[c], load16(kn + 2 * depth + o), a2);
        a3 = _mm512_fmadd_ps(qm[c], load16(kn + 3 * depth + o), a3);
      }
      om[n] = _mm512_reduce_add_ps(a0);
      om[n + 1] = _mm512_reduce_add_ps(a1);
      om[n + 2] = _mm512_reduce_add_ps(a2);
      om[n + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; n < n_count; ++n) {
      const T* kn = k + n * depth;
      __m512 a = _mm512_mul_ps(qm[0], load16(kn));
      for (int64_t c = 1; c < chunks; ++c) {
        a = _mm512_fmadd_ps(qm[c], load16(kn + c * kLanes), a);
      }
      om[n] = _mm512_reduce_add_ps(a);
    }
  }
}

// p (M, N) times v (N, D): the output row in registers, the value rows summed in order.
template <typename T>
__attribute__((target("avx512f"))) void mix_avx512(const float* p, const void* values,
                                                   float* out, int64_t m_count,
                                                   int64_t n_count, int64_t depth) {
  const T* v = static_cast<const T*>(values);
  const int64_t chunks = depth / kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    __m512 acc[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    const float* pm = p + m * n_count;
    for (int64_t n = 0; n < n_count; ++n) {
      const __m512 weight = _mm512_set1_ps(pm[n]);
      const T* vn = v + n * depth;
      for (int64_t c = 0; c < chunks; ++c) {
        acc[c] = _mm512_fmadd_ps(weight, load16(vn + c * kLanes), acc[c]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + m * depth + c * kLanes, acc[c]);
  }
}

#endif  // ATTNSERVE_AVX512

using Block = void (*)(const float*, const void*, float*, int64_t, int64_t, int64_t);

// The loop for this CPU and head size, chosen once per kernel.
#if ATTNSERVE_AVX512
bool cpu_has_avx512() {
  static const bool avx512 = [] {
    __builtin_cpu_init();  // a library loaded by dlopen may run before libgcc's own init
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return avx512;
}
#endif

template <typename T>
Block pick(bool scores, int64_t depth) {
#if ATTNSERVE_AVX512
  if (cpu_has_avx512() && depth > 0 && depth % kLanes == 0 && depth / kLanes <= kMaxChunks) {
    return scores ? scores_avx512<T> : mix_avx512<T>;
  }
#endif
  if constexpr (std::is_same_v<T, Half>) return scores ? scores_portable_half : mix_portable_half;
  return scores ? scores_portable : mix_portable;
}

// ---- The vocabulary: each row's log-softmax and its k best tokens, in two passes ----------
//
// ONNX Runtime's LogSoftmax writes the whole (B, V) row (three passes over it) and TopK reads
// it again; a beam search that takes its candidates from TopK never reads that row. This
// kernel finds the row's maximum in one pass, sums exp(x - max) in a second (in double
// precision), and in a third computes each log-prob (x - max) - log(sum), keeping the k best
// (ties to the lower id, as ONNX's TopK) and writing the row only when asked. The candidates
// are chosen among the very values the row holds, so a step that reads candidates and one that
// reads the row choose alike (two logits can round to one log-prob: the lower id wins both
// ways). A row holding a NaN comes out all NaN, its candidates the first k ids.

// exp(x) for x <= 0 (the argument is x - max): Cephes' single-precision polynomial after
// x = n ln2 + r, |r| <= ln2 / 2; below -87.3 the result is 0.
inline float exp_nonpositive(float x) {
  if (x != x) return x;  // NaN
  if (x < -87.33654f) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return std::ldexp(p * r * r + r + 1.0f, static_cast<int>(n));
}

// The k best (value, index) of a row so far, best first, ties to the lower index.
struct Best {
  float* values;
  int64_t* ids;
  int64_t k;
  int64_t count = 0;

  float threshold() const {
    if (k == 0) return std::numeric_limits<float>::infinity();
    return count < k ? -std::numeric_limits<float>::infinity() : values[k - 1];
  }
  void offer(float value, int64_t id) {  // ids arrive in increasing order
    if (k == 0 || (count == k && !(value > values[k - 1]))) return;
    int64_t at = count < k ? count++ : k - 1;
    while (at > 0 && values[at - 1] < value) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = value;
    ids[at] = id;
  }
};

// The row's maximum, or NaN when it holds one.
float max_portable(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, x[i]);
  }
  return top;
}

// The third pass: each log-prob (x - top) - log_sum, offered to `best` (and written to `out`
// when it is not null).
void select_portable(const float* x, int64_t n, float top, float log_sum, Best& best,
                     float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    if (best.count < best.k || value > best.threshold()) best.offer(value, i);
  }
}

double exp_sum_portable(const float* x, int64_t n, float top) {
  double lanes[kLanes] = {0};
  const int64_t whole = n - n % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += exp_nonpositive(x[i + l] - top);
  }
  for (int64_t i = whole; i < n; ++i) lanes[i - whole] += exp_nonpositive(x[i] - top);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

#if ATTNSERVE_AVX512
// The same polynomial, sixteen at a time.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
                                 _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(e, n));
}

__attribute__((target("avx512f"))) float max_avx512(const float* x, int64_t n) {
  __m512 tops = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, v);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float top = _mm512_reduce_max_ps(tops);
  for (; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, x[i]);
  }
  return top;
}

__attribute__((target("avx512f"))) void select_avx512(const float* x, int64_t n, float top,
                                                      float log_sum, Best& best, float* out) {
  int64_t i = 0;
  for (; i < n && best.count < best.k; ++i) {  // the first k fill the list
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    best.offer(value, i);
  }
  const __m512 tops = _mm512_set1_ps(top), sums = _mm512_set1_ps(log_sum);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 values = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), tops), sums);
    if (out != nullptr) _mm512_storeu_ps(out + i, values);
    __mmask16 above = _mm512_cmp_ps_mask(values, _mm512_set1_ps(best.threshold()), _CMP_GT_OQ);
    if (!above) continue;  // the common case once the list holds good values
    float lanes[kLanes];
    _mm512_storeu_ps(lanes, values);
    while (above) {
      const int l = __builtin_ctz(above);
      best.offer(lanes[l], i + l);  // offer re-checks against the risen threshold
      above &= static_cast<__mmask16>(above - 1);
    }
  }
  for (; i < n; ++i) {
    const float value = (x[i] - top) - log_sum;
    if (out != nullptr) out[i] = value;
    best.offer(value, i);
  }
}

// Lane l sums the elements l, l + 16, ... in double precision; the lanes are then added
// pairwise, as the portable loop does (the same order: a row's sum never depends on the batch,
// nor on the CPU's instruction set).
__attribute__((target("avx512f"))) double exp_sum_avx512(const float* x, int64_t n, float top) {
  const int64_t whole = n - n % kLanes;
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  const __m512 tops = _mm512_set1_ps(top);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i), tops));
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    high = _mm512_add_pd(
        high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  double lanes[kLanes];
  _mm512_storeu_pd(lanes, low);
  _mm512_storeu_pd(lanes + 8, high);
  for (int64_t i = whole; i < n; ++i) lanes[i - whole] += exp_nonpositive(x[i] - top);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}
#endif  // ATTNSERVE_AVX512

struct RowFns {
  float (*max)(const float*, int64_t);
  double (*exp_sum)(const float*, int64_t, float);
  void (*select)(const float*, int64_t, float, float, Best&, float*);
};

RowFns pick_row_fns() {
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) return {max_avx512, exp_sum_avx512, select_avx512};
#endif
  return {max_portable, exp_sum_portable, select_portable};
}

// ---- Per-row int8 activations: a row's scale and its uint8 values in two passes -----------
//
// What the per-row int8 export writes as four nodes (Abs, ReduceMax, Div, QuantizeLinear: four
// passes over the activation, three written): m = max |x| over the row, and
// q = saturate(round(x / m / (1/127))) + 128, with ONNX Runtime's own arithmetic (two IEEE
// divisions, the clamp to [-128, 127] before rounding half to even; 0/0 becomes 0), so the
// kernel's bytes are the stock nodes' bytes.
constexpr float kStep = 1.0f / 127.0f;

inline uint8_t quantize_one(float x, float m) {
  float v = (x / m) / kStep;
  v = v > -128.0f ? v : -128.0f;  // as maxps / minps: a NaN becomes the bound
  v = v < 127.0f ? v : 127.0f;
  return static_cast<uint8_t>(static_cast<int>(std::nearbyint(v)) + 128);
}

// max |x| of a row, NaN when it holds one (as ReduceMax: the row's bytes are then all 0).
float row_max_portable(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    m = std::max(m, std::fabs(x[i]));
  }
  return m;
}

void quantize_portable(const float* x, int64_t n, float m, uint8_t* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = quantize_one(x[i], m);
}

#if ATTNSERVE_AVX512
__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float top = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    top = std::max(top, std::fabs(x[i]));
  }
  return top;
}

__attribute__((target("avx512f"))) void quantize_avx512(const float* x, int64_t n, float m,
                                                        uint8_t* q) {
  const __m512 scale = _mm512_set1_ps(m), step = _mm512_set1_ps(kStep);
  const __m512 low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
  const __m512i zero_point = _mm512_set1_epi32(128);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    __m512 v = _mm512_div_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), scale), step);
    v = _mm512_min_ps(_mm512_max_ps(v, low), high);  // max(v, low): a NaN becomes low
    const __m512i r = _mm512_add_epi32(
        _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zero_point);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
  }
  for (; i < n; ++i) q[i] = quantize_one(x[i], m);
}
#endif  // ATTNSERVE_AVX512

struct RowQuantJob {
  float (*row_max)(const float*, int64_t);
  void (*quantize)(const float*, int64_t, float, uint8_t*);
  const float* x;
  uint8_t* q;
  float* scales;
  int64_t columns;
};

// A job quantizing the rows of x (columns each) into q and scales, on this CPU's loops.
RowQuantJob row_quant_job(const float* x, uint8_t* q, float* scales, int64_t columns) {
  RowQuantJob job{row_max_portable, quantize_portable, x, q, scales, columns};
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) job.row_max = row_max_avx512, job.quantize = quantize_avx512;
#endif
  return job;
}

void row_quantize_one(void* data, size_t index) {
  const RowQuantJob& job = *static_cast<const RowQuantJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
  const float* x = job.x + row * job.columns;
  const float m = job.row_max(x, job.columns);
  job.scales[row] = m;
  job.quantize(x, job.columns, m, job.q + row * job.columns);
}

// ---- Per-row int8 products: MatMulIntegerToFloat with its per-row scale and the bias -------
//
// y = (float(x_q @ w - 128 * colsum(w)) * w_scale) * x_scale (+ bias): what the per-row int8
// export writes as MatMulIntegerToFloat (the activation scale a (..., 1) tensor, applied after
// the GEMM's per-column scale) and the bias Add, in that arithmetic order, so the floats are
// the stock nodes' floats. The kernel reads the weight in panels of 64 columns, each 4
// consecutive k of a column adjacent as AVX-512 VNNI's vpdpbusd reads them: stored so by the
// export (PackedQMatMul), or packed into a copy at the node's first run (QMatMul; again only if
// its buffer moves); 128 x colsum is kept beside it. Each row's integer sums are exact and its
// epilogue is its own, so a row's result never depends on the other rows.
constexpr int64_t kPanel = 64;     // columns per packed panel: 4 registers of 16 int32 sums
constexpr int kRowBlock = 6;       // rows per register block: 24 sums + 4 weights + 1 row
constexpr int64_t kTaskRows = 96;  // rows per task on the session's threads
constexpr int64_t kQuad = 4;  // panels a task reads side by side at one row
constexpr int64_t kMaxDepth = 65536;  // K: 255 x 127 x K (and 128 x 127 x K) fit in int32

struct Packed {
  const void* source = nullptr;  // the weight buffer it was packed from (or is, packed)
  int64_t k = 0, n = 0, k4 = 0, panels = 0;
  std::vector<int8_t> storage;   // panels x k4 x 64 columns x 4, from `data` (64-byte aligned)
  const int8_t* data = nullptr;  // into `storage`, or the packed weight itself
  std::vector<int32_t> offsets;  // 128 x colsum, panels x 64
  const int8_t* panel(int64_t p) const { return data + p * k4 * kPanel * 4; }
};

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
bool cpu_has_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
}

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

// ---- 4-bit affine blocks (llama.cpp's Q4_1): a weight-only product on AVX-512 VNNI ---------
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
constexpr int64_t kQ4Block = 32;
constexpr int64_t kQ4Panel = 16;
constexpr int64_t kQ4PanelBytes = kQ4Block * kQ4Panel / 2;  // 256
constexpr int64_t kQ8PanelBytes = kQ4Block * kQ4Panel;  // 512: 8-bit blocks (BlockQ8MatMul)
constexpr int kQ4Rows = 4;  // rows per register block
constexpr int64_t kQ4TaskPanels = 4;  // panels per task
constexpr int64_t kQ4Prefetch = 16;  // blocks ahead
constexpr int64_t kQ4InlineQuantize = 1 << 14;  // activations quantized on the calling thread

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
#endif  // ATTNSERVE_AVX512

// One task: up to kQ4TaskPanels panels for up to kTaskRows rows.
void q4_task(void* data, size_t index) {
#if ATTNSERVE_AVX512
  const Q4Job& job = *static_cast<const Q4Job*>(data);
  const int64_t group = static_cast<int64_t>(index) / job.row_tasks;
  const int64_t t = static_cast<int64_t>(index) % job.row_tasks;
  const int64_t r0 = t * kTaskRows, r1 = std::min(job.rows, r0 + kTaskRows);
  const int64_t p1 = std::min(job.panels, (group + 1) * kQ4TaskPanels);
  for (int64_t p = group * kQ4TaskPanels; p < p1; ++p) {
    if (job.bits == 4) {
      q4_rows<4>(job, p, r0, r1);
    } else {
      q4_rows<8>(job, p, r0, r1);
    }
  }
#else
  (void)data, (void)index;
#endif
}

// Whether to register QMatMul: a CPU with AVX-512 VNNI, unless ATTNSERVE_KERNELS_QMATMUL is
// 0, false, no or off.
bool use_qmatmul() {
  const char* switch_value = std::getenv("ATTNSERVE_KERNELS_QMATMUL");
  if (switch_value != nullptr) {
    std::string value(switch_value);
    for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  }
#if ATTNSERVE_AVX512
  return cpu_has_vnni();
#else
  return false;
#endif
}

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

// Both inputs rank 4 with equal (B, H) and equal inner sizes: what the graph rewrite builds.
void check_pair(const Tensor& a, const Tensor& b, int inner_a, int inner_b, const char* op) {
  if (a.dims.size() != 4 || b.dims.size() != 4 || a.dims[0] != b.dims[0] ||
      a.dims[1] != b.dims[1] || a.dims[inner_a] != b.dims[inner_b]) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  std::string(op) + " wants rank-4 inputs with equal (B, H) and inner sizes"};
  }
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
  mutable std::mutex mutex;
  mutable std::shared_ptr<const Packed> packed;
};

// One product per (row, head): the job ONNX Runtime's threads share.
struct Job {
  Block block;
  const float* a;
  const char* b;  // float or Half
  float* out;
  int64_t a_size, b_bytes, out_size;  // one (row, head)'s elements in a and out, bytes in b
  int64_t m, n, depth;
};

void run_one(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t i = static_cast<int64_t>(index);
  job.block(job.a + i * job.a_size, job.b + i * job.b_bytes, job.out + i * job.out_size, job.m,
            job.n, job.depth);
}

// ---- The kernels' own threads --------------------------------------------------------------
//
// A language model's decoding step at one row is ~120 products of 0.2-2 MB each: split over
// ONNX Runtime's threads, each product pays the hand-over to the other threads and the wait for
// them (several microseconds with spinning threads on a 2-core VM, a quarter of a product's
// time). When the process asks for it (attnserve_kernels_threads(n), n > 1: the language
// model's backend, whose session then runs ONNX Runtime's own nodes on one thread), the kernels
// run their tasks on n - 1 threads of their own and the calling thread instead: a task index
// taken from an atomic counter, the workers spinning between products (for up to spin_us, then
// asleep on a condition variable until the next). One caller at a time: a kernel called while
// another holds the pool uses ONNX Runtime's threads.
class Pool {
 public:
  ~Pool() { resize(1, 0); }

  // Waits for a kernel running on the pool to finish; the same size and spin again is a no-op.
  void resize(int threads, int spin_us) {
    std::lock_guard<std::mutex> owner(owner_);
    threads = std::min(std::max(threads, 1), kMaxThreads);
    const auto spin = std::chrono::microseconds(std::max(spin_us, 0));
    if (threads == static_cast<int>(workers_.size()) + 1 && spin == spin_) return;
    while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
    if (!workers_.empty()) {
      {
        std::lock_guard<std::mutex> lock(sleep_);
        stop_.store(true);
      }
      wake_.notify_all();
      for (std::thread& worker : workers_) worker.join();
      workers_.clear();
      stop_.store(false);
    }
    spin_ = spin;
    // each worker waits for the epoch after this one (read here, while the pool is held: a
    // worker that read it itself once started could miss a call made before then)
    const uint64_t epoch = epoch_.load();
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this, i, epoch] { work_loop(static_cast<size_t>(i), epoch); });
    }
    size_.store(threads, std::memory_order_relaxed);
    busy_.store(false, std::memory_order_release);
  }

  // A fork: the parent holds owner_ across it (no resize half done), and the child, which has
  // none of the parent's threads, starts over with none (the parent's thread objects are left
  // alone, never joined; its locks and counters as a fresh pool's): its kernels run on ONNX
  // Runtime's threads until it asks for threads of its own.
  void before_fork() { owner_.lock(); }
  void after_fork_in_parent() { owner_.unlock(); }
  void after_fork_in_child() {
    static auto* orphans = new std::vector<std::thread>();
    for (std::thread& worker : workers_) orphans->push_back(std::move(worker));
    workers_.clear();
    size_.store(1);
    new (&owner_) std::mutex();
    new (&sleep_) std::mutex();
    new (&wake_) std::condition_variable();
    busy_.store(false), stop_.store(false), pending_.store(0), sleepers_.store(0);
    error_ = nullptr;
  }

  // Threads in all, the caller's with the workers (a hint: it may change while read).
  int threads() const { return size_.load(std::memory_order_relaxed); }

  // fn(data, i) for every i in [0, total) on the pool and the calling thread; false (nothing
  // run) when the pool has no workers or another caller holds it.
  bool run(void (*fn)(void*, size_t), size_t total, void* data) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    if (workers_.empty()) {
      busy_.store(false, std::memory_order_release);
      return false;
    }
    const size_t shards = workers_.size() + 1;
    runs_.fetch_add(1, std::memory_order_relaxed);
    fn_ = fn, data_ = data, shards_ = shards;
    for (size_t s = 0; s < shards; ++s) {
      shard_[s].next.store(total * s / shards, std::memory_order_relaxed);
      shard_[s].end = total * (s + 1) / shards;
    }
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    epoch_.fetch_add(1);  // sequentially consistent: ordered before the read of sleepers_
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    take_tasks(0);
    while (pending_.load(std::memory_order_acquire) > 0) pause();
    std::exception_ptr error = std::exchange(error_, nullptr);
    busy_.store(false, std::memory_order_release);
    if (error) std::rethrow_exception(error);
    return true;
  }

 private:
  static constexpr int kMaxThreads = 64;

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  // Thread `home`'s own contiguous share of the tasks first (a stream of weights the CPU's
  // prefetchers follow), then what is left of the others'.
  void take_tasks(size_t home) {
    void (*fn)(void*, size_t) = fn_;
    void* data = data_;
    try {
      for (size_t k = 0; k < shards_; ++k) {
        Shard& shard = shard_[(home + k) % shards_];
        for (size_t i; (i = shard.next.fetch_add(1, std::memory_order_relaxed)) < shard.end;) {
          fn(data, i);
        }
      }
    } catch (...) {  // (an allocation failing) the caller rethrows the first
      std::lock_guard<std::mutex> lock(sleep_);
      if (!error_) error_ = std::current_exception();
      for (size_t k = 0; k < shards_; ++k) shard_[k].next.store(shard_[k].end);  // stop
    }
  }

  void work_loop(size_t home, uint64_t seen) {
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (unsigned spins = 0; epoch_.load(std::memory_order_acquire) == seen && !stop_.load();) {
        pause();
        if (++spins % 256 != 0 || std::chrono::steady_clock::now() - start < spin_) continue;
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return epoch_.load() != seen || stop_.load(); });
        sleepers_.fetch_sub(1);
        start = std::chrono::steady_clock::now();
      }
      if (stop_.load()) return;
      seen = epoch_.load(std::memory_order_acquire);
      take_tasks(home);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  struct alignas(64) Shard {  // a cache line each: threads take tasks from their own
    std::atomic<size_t> next{0};
    size_t end = 0;
  };

  std::mutex owner_;  // resize
  std::vector<std::thread> workers_;
  std::chrono::microseconds spin_{0};
  void (*fn_)(void*, size_t) = nullptr;
  void* data_ = nullptr;
  size_t shards_ = 1;
  Shard shard_[kMaxThreads];
  // each on a cache line of its own: the workers spin on epoch_ while tasks are taken
  std::atomic<int> size_{1};
  alignas(64) std::atomic<bool> busy_{false};
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<uint64_t> epoch_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::mutex sleep_;  // the sleepers' wake-ups, and error_
  std::condition_variable wake_;
  std::exception_ptr error_;

 public:
  std::atomic<uint64_t> runs_{0};  // calls run on the pool (observability, tests)
};

Pool& pool() {
  static Pool* instance = [] {  // never destroyed: its threads may outlive static exit
    pthread_atfork([] { pool().before_fork(); }, [] { pool().after_fork_in_parent(); },
                   [] { pool().after_fork_in_child(); });
    return new Pool();
  }();
  return *instance;
}

// Work is split into contiguous batches of (row, head) for the session's threads; each
// (row, head) is one call, on whatever thread, so the split never changes a result.
constexpr size_t kBatches = 32;

// fn(job, i) for every row i in [0, rows), the rows in contiguous batches on the session's threads.
void for_each_row(const ort_abi::Fns& api, OrtKernelContext* context, void (*fn)(void*, size_t),
                  size_t rows, void* job) {
  if (rows > 1 && pool().run(fn, rows, job)) return;
  check(api, api.KernelContextParallelFor(context, fn, rows, std::min(rows, kBatches), job),
        "running on the session's threads");
}

// One row of the vocabulary kernel per index.
struct VocabJob {
  RowFns fns;
  const float* x;
  float* log_probs;  // null: not asked for
  float* top_values;
  int64_t* top_ids;
  int64_t columns, k;
};

void vocab_row(void* data, size_t index) {
  const VocabJob& job = *static_cast<const VocabJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
  const float* x = job.x + row * job.columns;
  Best best{job.top_values + row * job.k, job.top_ids + row * job.k, job.k};
  float* out = job.log_probs == nullptr ? nullptr : job.log_probs + row * job.columns;
  const float top = job.fns.max(x, job.columns);
  if (top != top) {  // a NaN in the row: all NaN, the first k ids
    for (int64_t i = 0; out != nullptr && i < job.columns; ++i) out[i] = top;
    for (int64_t j = 0; j < job.k; ++j) best.values[j] = top, best.ids[j] = j;
    return;
  }
  const float log_sum = static_cast<float>(std::log(job.fns.exp_sum(x, job.columns, top)));
  job.fns.select(x, job.columns, top, log_sum, best, out);
}

int64_t scalar_input(const ort_abi::Fns& api, OrtKernelContext* context, size_t index,
                     const char* what) {
  const Tensor t = input(api, context, index);
  if (t.count() != 1) throw Failure{ORT_INVALID_ARGUMENT, std::string(what) + " wants one value"};
  return *static_cast<const int64_t*>(t.raw);
}

// x (..., V), k (1,), full (1,) -> log-probs (..., V), or (..., 0) when full is 0; the k best
// log-probs (..., k) and their ids (..., k), best first, ties to the lower id.
void run_vocab(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0);
  const int64_t k = scalar_input(api, context, 1, "LogSoftmaxTopK's k");
  const bool full = scalar_input(api, context, 2, "LogSoftmaxTopK's full") != 0;
  if (x.dims.empty()) throw Failure{ORT_INVALID_ARGUMENT, "LogSoftmaxTopK wants rank >= 1"};
  VocabJob job{};
  job.fns = pick_row_fns();
  job.x = x.data();
  job.columns = x.dims.back();
  job.k = k;
  if (k < 0 || k > job.columns) {
    throw Failure{ORT_INVALID_ARGUMENT, "LogSoftmaxTopK's k must be within [0, V]"};
  }
  std::vector<int64_t> dims = x.dims;
  dims.back() = full ? job.columns : 0;
  void* log_probs = output(api, context, 0, dims);
  job.log_probs = full ? static_cast<float*>(log_probs) : nullptr;
  dims.back() = k;
  job.top_values = static_cast<float*>(output(api, context, 1, dims));
  job.top_ids = static_cast<int64_t*>(output(api, context, 2, dims));
  const size_t rows = static_cast<size_t>(x.count() / std::max<int64_t>(job.columns, 1));
  if (rows == 0 || job.columns == 0) return;
  for_each_row(api, context, vocab_row, rows, &job);
}

// x (..., K) -> q (..., K) uint8, m (..., 1): each row's max |x| and its values quantized.
void run_row_quantize(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0);
  if (x.dims.empty()) throw Failure{ORT_INVALID_ARGUMENT, "RowQuantize wants rank >= 1"};
  RowQuantJob job = row_quant_job(x.data(), nullptr, nullptr, x.dims.back());
  job.q = static_cast<uint8_t*>(output(api, context, 0, x.dims));
  std::vector<int64_t> dims = x.dims;
  dims.back() = 1;
  job.scales = static_cast<float*>(output(api, context, 1, dims));
  const size_t rows = static_cast<size_t>(x.count() / std::max<int64_t>(job.columns, 1));
  if (rows == 0 || job.columns == 0) {
    for (size_t r = 0; r < rows; ++r) job.scales[r] = 0.0f;
    return;
  }
  for_each_row(api, context, row_quantize_one, rows, &job);
}

// The node's weight packed (once, and again if its buffer moves): a (K, N) weight into the
// kernel's own copy, a packed one where it is. The weight must be a constant (an initializer,
// as the graph rewrite makes it): the copy and the column sums are kept by buffer address.
std::shared_ptr<const Packed> packed_weight(const Kernel& kernel, const Tensor& w) {
  std::lock_guard<std::mutex> lock(kernel.mutex);
  const bool packed = w.dims.size() == 4;
  const int64_t k = packed ? 4 * w.dims[1] : w.dims[0];
  const int64_t n = packed ? kPanel * w.dims[0] : w.dims[1];
  const std::shared_ptr<const Packed>& have = kernel.packed;
  if (!have || have->source != w.raw || have->k != k || have->n != n) {
    auto fresh = std::make_shared<Packed>();
    const int8_t* data = static_cast<const int8_t*>(w.raw);
    if (packed) {
      use_packed_weight(data, w.dims[0], w.dims[1], *fresh);
    } else {
      pack_weight(data, k, n, *fresh);
    }
    fresh->source = w.raw;
    kernel.packed = std::move(fresh);
  }
  return kernel.packed;
}

// x_q (..., K) uint8, w (K, N) int8 or packed (N / 64, K / 4, 64, 4), x_scale (..., 1),
// w_scale (N,) [, bias (N,)] -> (..., N).
//
// With `quantize` (RowQMatMul: x (..., K) float, w packed, w_scale): x's rows are quantized
// first, as RowQuantize quantizes them (the same bytes and scales, into buffers of the calling
// thread), one node where the graph had two.
void run_qmatmul(const Kernel& kernel, OrtKernelContext* context, bool with_bias, bool packed,
                 bool quantize = false) {
  const ort_abi::Fns& api = kernel.api;
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
    } else if (count <= kQ4InlineQuantize) {  // a few rows: not worth waking the threads
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
  const std::shared_ptr<const Packed> weight = packed_weight(kernel, w);
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
#endif
  q4_quantize_row(*quant.job, quant.x + row * quant.job->k, row, row_max_portable,
                  quantize_portable);
}

// BlockQ4MatMul: x (..., K) float, q (N / 16, K / 32, 256) uint8, d and m (N / 16, K / 32, 16)
// float16 -> (..., N). BlockQ8MatMul (bits 8): q (N / 16, K / 32, 512), d, no m.
void run_q4(const ort_abi::Fns& api, OrtKernelContext* context, int bits) {
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
  if (job.rows * job.k <= kQ4InlineQuantize) {  // a few rows: not worth waking the threads
    for (int64_t row = 0; row < job.rows; ++row) q4_quantize_task(&quant, static_cast<size_t>(row));
  } else {
    for_each_row(api, context, q4_quantize_task, static_cast<size_t>(job.rows), &quant);
  }
  job.row_tasks = (job.rows + kTaskRows - 1) / kTaskRows;
  const int64_t groups = (job.panels + kQ4TaskPanels - 1) / kQ4TaskPanels;
  for_each_row(api, context, q4_task, static_cast<size_t>(groups * job.row_tasks), &job);
}

// ---- The language model's attention: GroupQueryAttention's decoding cases, in place --------
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
// exp(x), sixteen at a time: exp_nonpositive's polynomial, 2^n by vscalefps (below -87.3:
// ~1e-38, not 0; large x: inf). Written for x <= 0 (a softmax's x - max); SwiGLU's -x works too.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);  // a NaN stays NaN (the second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

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

template <int C>
void group_mix_block(const float* p, const void* v, float* out, int64_t m_count, int64_t n_count,
                     int64_t) {
  group_mix<C>(p, static_cast<const float*>(v), out, m_count, n_count);
}
#endif

// The grouped loops for head sizes 16, 32, 64 and 128 on AVX-512, else the attention's loops.
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
#endif
  return pick<float>(scores, depth);
}

SoftmaxFn pick_softmax() {
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) return softmax_avx512;
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

// ---- A language model's element-wise steps: the residual add with its norm, SwiGLU ----------
//
//   ai.attnserve.AddRMSNorm(x, y (..., C), weight (C,), epsilon ()) -> x + y, RMSNorm(x + y)
//   ai.attnserve.SwiGLU(gate_up (..., 2F)) -> silu(gate_up[..., :F]) * gate_up[..., F:]
//
// A decoding step of a small model runs hundreds of these on rows of a few hundred values,
// where ONNX Runtime's cost per node is most of their time: one node for the residual Add and
// the RMSNormalization after it, one for Split, the SiLU and the product. Each row alone, in a
// fixed order (RMSNorm: the mean square summed in kLanes partial sums, float32 as
// RMSNormalization's stash type 1).
struct NormJob {
  const float* x;
  const float* y;
  const float* weight;
  float* sum;
  float* normed;
  int64_t columns;
  float epsilon;
};

void add_norm_row(void* data, size_t index) {
  const NormJob& job = *static_cast<const NormJob*>(data);
  const int64_t c = job.columns, offset = static_cast<int64_t>(index) * c;
  const float *x = job.x + offset, *y = job.y + offset;
  float *sum = job.sum + offset, *normed = job.normed + offset;
  float partial[kLanes] = {0};
  for (int64_t i = 0; i < c; ++i) {
    sum[i] = x[i] + y[i];
    partial[i % kLanes] += sum[i] * sum[i];
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  }
  const float inverse = 1.0f / std::sqrt(partial[0] / static_cast<float>(c) + job.epsilon);
  for (int64_t i = 0; i < c; ++i) normed[i] = sum[i] * inverse * job.weight[i];
}

struct SwiGluJob {
  const float* x;
  float* out;
  int64_t half;
};

void swiglu_row_portable(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

#if ATTNSERVE_AVX512
__attribute__((target("avx512f"))) void swiglu_row_avx512(const float* gate, const float* up,
                                                          float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                            _mm512_loadu_ps(up + i)));
  }
  swiglu_row_portable(gate + i, up + i, out + i, n - i);
}
#endif

void swiglu_row(void* data, size_t index) {
  const SwiGluJob& job = *static_cast<const SwiGluJob*>(data);
  const int64_t row = static_cast<int64_t>(index);
  const float* gate = job.x + row * 2 * job.half;
  float* out = job.out + row * job.half;
#if ATTNSERVE_AVX512
  if (cpu_has_avx512()) return swiglu_row_avx512(gate, gate + job.half, out, job.half);
#endif
  swiglu_row_portable(gate, gate + job.half, out, job.half);
}

// Rows of at most this many values in all run on the calling thread.
constexpr int64_t kElementInline = 1 << 15;

void run_add_norm(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0), y = input(api, context, 1);
  const Tensor weight = input(api, context, 2), epsilon = input(api, context, 3);
  if (x.dims.empty() || x.dims != y.dims || weight.dims != std::vector<int64_t>{x.dims.back()} ||
      epsilon.count() != 1) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  "AddRMSNorm wants x and y (..., C) alike, weight (C,) and one epsilon"};
  }
  NormJob job{x.data(), y.data(), weight.data(), nullptr, nullptr, x.dims.back(),
              *epsilon.data()};
  job.sum = static_cast<float*>(output(api, context, 0, x.dims));
  job.normed = static_cast<float*>(output(api, context, 1, x.dims));
  const int64_t rows = job.columns == 0 ? 0 : x.count() / job.columns;
  if (x.count() <= kElementInline) {
    for (int64_t r = 0; r < rows; ++r) add_norm_row(&job, static_cast<size_t>(r));
  } else {
    for_each_row(api, context, add_norm_row, static_cast<size_t>(rows), &job);
  }
}

void run_swiglu(const ort_abi::Fns& api, OrtKernelContext* context) {
  const Tensor x = input(api, context, 0);
  if (x.dims.empty() || x.dims.back() % 2 != 0) {
    throw Failure{ORT_INVALID_ARGUMENT, "SwiGLU wants gate_up (..., 2F)"};
  }
  std::vector<int64_t> dims = x.dims;
  dims.back() /= 2;
  SwiGluJob job{x.data(), static_cast<float*>(output(api, context, 0, dims)), dims.back()};
  const int64_t rows = job.half == 0 ? 0 : x.count() / x.dims.back();
  if (x.count() <= kElementInline) {
    for (int64_t r = 0; r < rows; ++r) swiglu_row(&job, static_cast<size_t>(r));
  } else {
    for_each_row(api, context, swiglu_row, static_cast<size_t>(rows), &job);
  }
}

void run(const Kernel& kernel, OrtKernelContext* context) {
  const ort_abi::Fns& api = kernel.api;
  if (kernel.kind == Kind::kRowQMatMul) return run_qmatmul(kernel, context, false, true, true);
  if (is_qmatmul(kernel.kind)) {
    const bool bias = kernel.kind == Kind::kQMatMulBias || kernel.kind == Kind::kPackedQMatMulBias;
    const bool packed =
        kernel.kind == Kind::kPackedQMatMul || kernel.kind == Kind::kPackedQMatMulBias;
    return run_qmatmul(kernel, context, bias, packed);
  }
  if (kernel.kind == Kind::kVocab) return run_vocab(api, context);
  if (kernel.kind == Kind::kBlockQ4MatMul) return run_q4(api, context, 4);
  if (kernel.kind == Kind::kBlockQ8MatMul) return run_q4(api, context, 8);
  if (kernel.kind == Kind::kRowQuantize) return run_row_quantize(api, context);
  if (kernel.kind == Kind::kCausal) return run_causal(api, context);
  if (kernel.kind == Kind::kAddNorm) return run_add_norm(api, context);
  if (kernel.kind == Kind::kSwiGlu) return run_swiglu(api, context);
  const Tensor a = input(api, context, 0);
  const Tensor b = input(api, context, 1);
  const bool half = kernel.kind == Kind::kScoresHalf || kernel.kind == Kind::kMixHalf;
  const int64_t b_element = half ? sizeof(Half) : sizeof(float);
  Job job{};
  if (kernel.kind == Kind::kScores || kernel.kind == Kind::kScoresHalf) {
    check_pair(a, b, 3, 3, "AttnScores");  // q (B, H, M, D), k (B, H, N, D)
    job.m = a.dims[2], job.depth = a.dims[3], job.n = b.dims[2];
    job.out = static_cast<float*>(output(api, context, 0, {a.dims[0], a.dims[1], job.m, job.n}));
    job.block = half ? pick<Half>(true, job.depth) : pick<float>(true, job.depth);
    job.a_size = job.m * job.depth, job.out_size = job.m * job.n;
  } else {
    check_pair(a, b, 3, 2, "AttnMix");  // p (B, H, M, N), v (B, H, N, D)
    job.m = a.dims[2], job.n = a.dims[3], job.depth = b.dims[3];
    job.out =
        static_cast<float*>(output(api, context, 0, {a.dims[0], a.dims[1], job.m, job.depth}));
    job.block = half ? pick<Half>(false, job.depth) : pick<float>(false, job.depth);
    job.a_size = job.m * job.n, job.out_size = job.m * job.depth;
  }
  job.b_bytes = job.n * job.depth * b_element;
  job.a = a.data(), job.b = static_cast<const char*>(b.raw);
  const size_t rows = static_cast<size_t>(a.dims[0] * a.dims[1]);
  if (rows == 0) return;
  for_each_row(api, context, run_one, rows, &job);
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
  for (const OrtCustomOp* op :
       {&kQMatMul, &kQMatMulBias, &kPackedQMatMul, &kPackedQMatMulBias, &kBlockQ4MatMul,
        &kBlockQ8MatMul, &kRowQMatMul}) {
    if (!use_qmatmul()) break;
    if (OrtStatus* status = api.CustomOpDomainAdd(domain, op)) return status;
  }
  return api.AddCustomOpDomain(options, domain);
}

// Whether the integer products (QMatMul..., BlockQ4MatMul) are registered on this CPU.
ATTNSERVE_EXPORT int attnserve_kernels_integer_products() { return use_qmatmul() ? 1 : 0; }

// The kernels' own threads: `threads` in all with the caller's (1: none, ONNX Runtime's are
// used), spinning up to `spin_us` microseconds between calls.
ATTNSERVE_EXPORT void attnserve_kernels_threads(int threads, int spin_us) {
  pool().resize(threads, spin_us);
}

// How many kernel calls ran on those threads so far (observability, tests).
ATTNSERVE_EXPORT uint64_t attnserve_kernels_thread_runs() {
  return pool().runs_.load(std::memory_order_relaxed);
}

// The library's own version, read by attnserve/kernels/__init__.py to refuse a stale build.
ATTNSERVE_EXPORT int attnserve_kernels_version() { return 12; }
