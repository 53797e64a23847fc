// Schemas of every zero_ext op, in one place. Implementations live in sibling files:
// *_cpu.cpp register the CPU kernels, *.cu the CUDA kernels (TORCH_LIBRARY_IMPL), and
// zero_ext/kernels/*.py hold the fake (meta) kernels and the pure-PyTorch references.
#include <torch/library.h>

TORCH_LIBRARY(zero_ext, m) {
  // Copy each tensor into flat[offsets[i] : offsets[i] + tensors[i].numel()].
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) flat, int[] offsets) -> ()");
  // Inverse of flatten_into: copy flat[offsets[i] : ...] back into each tensor.
  m.def("unflatten_from(Tensor flat, Tensor(a!)[] tensors, int[] offsets) -> ()");
  // Whole-parameter ownership: rank of every param (int64 [n]); never worse than torch's
  // per-group sorted greedy. numels, groups: int64 [n] on CPU.
  m.def("assign_params(Tensor numels, Tensor groups, int world_size) -> Tensor");
  // Element-level layout: aligned start offset of each param, then the padded total,
  // a multiple of world_size * alignment (int64 [n + 1]).
  m.def("flat_offsets(Tensor numels, int world_size, int alignment) -> Tensor");
  // One AdamW step over S segments of any param groups. steps: float32 [S] (already
  // incremented), segment_groups: int64 [S] on CPU, group_hparams: float64 [G, 7] on CPU
  // with columns (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize).
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor steps, "
      "Tensor segment_groups, Tensor group_hparams, Tensor? grad_scale, "
      "Tensor? found_inf) -> ()");
}
