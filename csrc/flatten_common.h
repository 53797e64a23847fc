// Host-side pieces shared by the CPU (flatten_cpu.cpp) and CUDA (flatten.cu) kernels of
// flatten_into / unflatten_from: argument checks (same words as zero_ext/kernels/flatten.py)
// and the copy_ fallback for non-contiguous tensors.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace zero_ext {

inline void check_flatten_args(const char* op, at::TensorList tensors, const at::Tensor& flat,
                               at::IntArrayRef offsets) {
  TORCH_CHECK(flat.dim() == 1, op, ": flat must be 1-D, got ", flat.dim(), "-D");
  TORCH_CHECK(flat.is_contiguous(), op, ": flat must be contiguous");
  TORCH_CHECK(tensors.size() == offsets.size(), op, ": got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  const int64_t total = flat.numel();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.scalar_type() == flat.scalar_type(), op, ": tensors[", i, "] has dtype ",
                t.scalar_type(), " but flat has dtype ", flat.scalar_type());
    TORCH_CHECK(t.device() == flat.device(), op, ": tensors[", i, "] is on ", t.device(),
                " but flat is on ", flat.device());
    const int64_t off = offsets[i], n = t.numel();
    TORCH_CHECK(off >= 0 && off <= total - n, op, ": tensors[", i, "] (", n,
                " elements at offset ", off, ") does not fit in flat of ", total, " elements");
  }
}

// Non-contiguous tensors: copy_ through a view of their slot (TensorIterator handles strides).
inline void copy_strided(at::TensorList tensors, const at::Tensor& flat,
                         at::IntArrayRef offsets, const std::vector<size_t>& strided,
                         bool to_flat) {
  for (size_t i : strided) {
    const at::Tensor& t = tensors[i];
    at::Tensor slot = flat.narrow(0, offsets[i], t.numel()).view(t.sizes());
    if (to_flat) {
      slot.copy_(t);
    } else {
      t.copy_(slot);
    }
  }
}

}  // namespace zero_ext
