#pragma once
// Sparse COO tensors on dipu (SparseOps.cpp): ATen's generic sparse tensor over dipu indices and
// values; their computations run on the CPU with copies.
#include <ATen/core/Tensor.h>

namespace ditorch {

// The sparse COO tensor of `like`'s shape, dimensions and coalesced flag over `indices` and
// `values`, on their device.
at::Tensor sparseOver(const at::Tensor& like, const at::Tensor& indices, const at::Tensor& values);

}  // namespace ditorch
