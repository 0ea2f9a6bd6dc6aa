// Which of a row's tokens a draw keeps under top_k and top_p, as the smallest weight kept: the top_k
// largest weights, then of those the fewest largest whose mass reaches top_p of theirs (the largest
// always). Built once: a histogram of the weights by their float's exponent and leading mantissa bits,
// then the one bucket where the cut falls sorted. A full sort of SmolLM2's 49,152 probabilities took
// ~1.8 ms in torch; the histogram is one pass.
#pragma once

#include <cstdint>

namespace kvtool::cpu {

// weights [size]: exp((x - largest) / temperature), each in [0, 1]. top_k 0 or >= size, top_p 1: no
// cut. bucket_scratch holds `size` floats. Returns the smallest weight kept (0: every token); weights
// equal to it are kept too (where ties cross the k-th place, more than top_k).
float draw_cut(const float* weights, int64_t size, int64_t top_k, float top_p, float* bucket_scratch);

}  // namespace kvtool::cpu
