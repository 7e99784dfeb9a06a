// The decoder step's attention products.
//
// A decoding step multiplies each row's one query by its own cached keys and values: per
// (row, head) a (1 x D) by (D x T) product and a (1 x T) by (T x D) one. ONNX Runtime's MatMul
// runs each as a GEMM call of its own (thousands a step at beam 4 x batch 32, ~0.2 us each
// before any arithmetic); these loops do the same products with no call per (row, head).
//
//   ai.attnserve.AttnScores(q (B, H, M, D), k (B, H, N, D)) -> (B, H, M, N) = q @ k^T
//   ai.attnserve.AttnMix(p (B, H, M, N), v (B, H, N, D))    -> (B, H, M, D) = p @ v
//   ai.attnserve.AttnScoresHalf / AttnMixHalf: the same with k / v float16 (a half cache)
//
// Each (row, head) is computed on its own, in a fixed order, so a row's result does not depend
// on the other rows of the batch.
#include "attention.h"

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "ort_glue.h"

namespace attnserve::kernels {
namespace {

// The keys and values are float32, or float16 (a cache stored in half precision: half the
// bytes to read at every step). A half is widened to a float exactly before any arithmetic, so
// a half cache's products are the float loops' products of the widened values.
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
// AVX-512 (and AVX2, below) for the head sizes transformers use (D a multiple of 16, at most
// 256): the query row and the output row stay in registers.
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

// The same loops on AVX2 (simd.h's F16: sixteen lanes as two halves), the same floats.
template <typename T>
ATTNSERVE_AVX2 void scores_avx2(const float* q, const void* keys, float* out, int64_t m_count,
                                int64_t n_count, int64_t depth) {
  const T* k = static_cast<const T*>(keys);
  const int64_t chunks = depth / kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    const float* qm = q + m * depth;
    float* om = out + m * n_count;
    int64_t n = 0;
    for (; n + 4 <= n_count; n += 4) {
      const T* kn = k + n * depth;
      const F16 q0 = load16_avx2(qm);
      F16 a0 = mul16(q0, load16_avx2(kn));
      F16 a1 = mul16(q0, load16_avx2(kn + depth));
      F16 a2 = mul16(q0, load16_avx2(kn + 2 * depth));
      F16 a3 = mul16(q0, load16_avx2(kn + 3 * depth));
      for (int64_t c = 1; c < chunks; ++c) {
        const int64_t o = c * kLanes;
        const F16 qc = load16_avx2(qm + o);
        a0 = fmadd16(qc, load16_avx2(kn + o), a0);
        a1 = fmadd16(qc, load16_avx2(kn + depth + o), a1);
        a2 = fmadd16(qc, load16_avx2(kn + 2 * depth + o), a2);
        a3 = fmadd16(qc, load16_avx2(kn + 3 * depth + o), a3);
      }
      om[n] = reduce_add16(a0);
      om[n + 1] = reduce_add16(a1);
      om[n + 2] = reduce_add16(a2);
      om[n + 3] = reduce_add16(a3);
    }
    for (; n < n_count; ++n) {
      const T* kn = k + n * depth;
      F16 a = mul16(load16_avx2(qm), load16_avx2(kn));
      for (int64_t c = 1; c < chunks; ++c) {
        a = fmadd16(load16_avx2(qm + c * kLanes), load16_avx2(kn + c * kLanes), a);
      }
      om[n] = reduce_add16(a);
    }
  }
}

// The output row in registers (or the stack, past eight of F16's sixteen registers).
template <typename T>
ATTNSERVE_AVX2 void mix_avx2(const float* p, const void* values, float* out, int64_t m_count,
                             int64_t n_count, int64_t depth) {
  const T* v = static_cast<const T*>(values);
  const int64_t chunks = depth / kLanes;
  for (int64_t m = 0; m < m_count; ++m) {
    F16 acc[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = zero16_avx2();
    const float* pm = p + m * n_count;
    for (int64_t n = 0; n < n_count; ++n) {
      const F16 weight = set16_avx2(pm[n]);
      const T* vn = v + n * depth;
      for (int64_t c = 0; c < chunks; ++c) {
        acc[c] = fmadd16(weight, load16_avx2(vn + c * kLanes), acc[c]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c) store16_avx2(out + m * depth + c * kLanes, acc[c]);
  }
}

#endif  // ATTNSERVE_AVX512

}  // namespace

template <typename T>
Block pick(bool scores, int64_t depth) {
#if ATTNSERVE_AVX512
  if (depth > 0 && depth % kLanes == 0 && depth / kLanes <= kMaxChunks) {
    if (cpu_has_avx512()) return scores ? scores_avx512<T> : mix_avx512<T>;
    if (cpu_has_avx2()) return scores ? scores_avx2<T> : mix_avx2<T>;
  }
#endif
  if constexpr (std::is_same_v<T, Half>) return scores ? scores_portable_half : mix_portable_half;
  return scores ? scores_portable : mix_portable;
}

template Block pick<float>(bool, int64_t);
template Block pick<Half>(bool, int64_t);

namespace {

// Both inputs rank 4 with equal (B, H) and equal inner sizes: what the graph rewrite builds.
void check_pair(const Tensor& a, const Tensor& b, int inner_a, int inner_b, const char* op) {
  if (a.dims.size() != 4 || b.dims.size() != 4 || a.dims[0] != b.dims[0] ||
      a.dims[1] != b.dims[1] || a.dims[inner_a] != b.dims[inner_b]) {
    throw Failure{ORT_INVALID_ARGUMENT,
                  std::string(op) + " wants rank-4 inputs with equal (B, H) and inner sizes"};
  }
}

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

}  // namespace

void run_attention(const ort_abi::Fns& api, OrtKernelContext* context, bool scores, bool half) {
  const Tensor a = input(api, context, 0);
  const Tensor b = input(api, context, 1);
  const int64_t b_element = half ? sizeof(Half) : sizeof(float);
  Job job{};
  if (scores) {
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

}  // namespace attnserve::kernels
