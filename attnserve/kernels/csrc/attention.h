// The decoder attention's products, per (row, head): the loops CausalGroupAttention also runs
// where it has no grouped loop of its own (attention.cc).
#pragma once

#include <cstdint>

#include "simd.h"

namespace attnserve::kernels {

// One (row, head)'s product: q (M, D) against k (N, D) into out (M, N) (scores), or p (M, N)
// times v (N, D) into out (M, D) (mix); k and v float or Half, as the loop was picked for.
using Block = void (*)(const float*, const void*, float*, int64_t, int64_t, int64_t);

// The loop for this CPU and head size, chosen once per kernel: T is float or Half.
template <typename T>
Block pick(bool scores, int64_t depth);

extern template Block pick<float>(bool, int64_t);
extern template Block pick<Half>(bool, int64_t);

}  // namespace attnserve::kernels
