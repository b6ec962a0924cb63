// Element-wise reduction of one host buffer into another (the arithmetic of allreduce & co).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>

namespace dicomm {

enum class ReduceKind { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

// dst[i] = dst[i] (op) src[i] for numel elements of `dtype`. kAvg sums (divide with finishAvg).
void reduceInto(void* dst, const void* src, size_t numel, c10::ScalarType dtype, ReduceKind op);
// dst[i] /= divisor (integer types: truncating division). Used once on the final sum for kAvg.
void finishAvg(void* dst, size_t numel, c10::ScalarType dtype, int divisor);
// Throws std::invalid_argument naming both when `op` is not defined for `dtype` (BAND on float,
// MIN on complex, ...). Runs the very kernels above on one element, so it agrees with them; called
// before a collective posts anything, so a refused op leaves the group as it was.
void checkReducible(c10::ScalarType dtype, ReduceKind op);
const char* reduceName(ReduceKind op);
// Makes the reductions the calling thread runs single-threaded. Called by each group's
// collective thread: every rank reduces its own share already, and a team of ATen's OpenMP
// workers per rank would compete with the ranks for the cores (and poll after each kernel).
void reduceOnThisThreadOnly();

}  // namespace dicomm
