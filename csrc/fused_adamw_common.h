// Host-side pieces shared by the CPU (fused_adamw_cpu.cpp) and CUDA (fused_adamw.cu)
// kernels of zero_ext::fused_adamw_: the group table's layout, the dtype kinds the kernels
// cover, and the checks of one segment and its master (run for every segment before anything
// is written).
#pragma once
#include <ATen/ATen.h>

namespace zero_ext {
namespace adamw {

// Lists as c10::List, read by reference: an at::TensorList parameter would make the
// dispatcher copy every list into a std::vector first (a measurable host cost at tens of
// thousands of tensors per call).
using TensorListRef = c10::List<at::Tensor>;

constexpr int kCols = 7;  // lr, beta1, beta2, eps, weight_decay, amsgrad, maximize
enum Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline int kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

// The four lists have one entry per segment; max_exp_avg_sqs and masters one too, or none.
inline int64_t check_list_lengths(const TensorListRef& params, const TensorListRef& grads,
                                  const TensorListRef& exp_avgs,
                                  const TensorListRef& exp_avg_sqs,
                                  const TensorListRef& max_exp_avg_sqs,
                                  const TensorListRef& masters) {
  const int64_t S = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == S &&
                  static_cast<int64_t>(exp_avgs.size()) == S &&
                  static_cast<int64_t>(exp_avg_sqs.size()) == S,
              "fused_adamw_: params, grads, exp_avgs and exp_avg_sqs must have the same "
              "length, got ", S, ", ", grads.size(), ", ", exp_avgs.size(), ", ",
              exp_avg_sqs.size());
  TORCH_CHECK(max_exp_avg_sqs.empty() || static_cast<int64_t>(max_exp_avg_sqs.size()) == S,
              "fused_adamw_: max_exp_avg_sqs must be empty or have one entry per segment (",
              S, "), got ", max_exp_avg_sqs.size());
  TORCH_CHECK(masters.empty() || static_cast<int64_t>(masters.size()) == S,
              "fused_adamw_: masters must be empty or have one entry per segment (", S,
              "), got ", masters.size());
  return S;
}

// Checks segment i (param p, grad g, moments m and v, and its max_exp_avg_sq when the group
// uses amsgrad) and returns the max_exp_avg_sq data pointer, or nullptr without amsgrad.
inline void* check_segment(int64_t i, const at::Tensor& p, const at::Tensor& g,
                           const at::Tensor& m, const at::Tensor& v,
                           const TensorListRef& max_exp_avg_sqs, int64_t group,
                           bool amsgrad, const at::Device& device) {
  TORCH_CHECK(p.defined() && g.defined() && m.defined() && v.defined(),
              "fused_adamw_: segment ", i, " has an undefined tensor");
  TORCH_CHECK(kind_of(p.scalar_type()) >= 0, "fused_adamw_: params[", i, "] has dtype ",
              p.scalar_type(), "; supported: float32, bfloat16, float16");
  TORCH_CHECK(g.scalar_type() == p.scalar_type(), "fused_adamw_: grads[", i,
              "] has dtype ", g.scalar_type(), " but params[", i, "] has ", p.scalar_type());
  TORCH_CHECK(m.scalar_type() == v.scalar_type() &&
                  (m.scalar_type() == p.scalar_type() || m.scalar_type() == at::kFloat),
              "fused_adamw_: exp_avgs[", i, "] and exp_avg_sqs[", i,
              "] must both have the param's dtype (", p.scalar_type(), ") or float32, got ",
              m.scalar_type(), " and ", v.scalar_type());
  const int64_t n = p.numel();
  TORCH_CHECK(g.numel() == n && m.numel() == n && v.numel() == n, "fused_adamw_: segment ",
              i, " has mismatched numel: param ", n, ", grad ", g.numel(), ", exp_avg ",
              m.numel(), ", exp_avg_sq ", v.numel());
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() &&
                  v.is_contiguous(),
              "fused_adamw_: segment ", i, " has a non-contiguous tensor (the Python "
              "wrapper zero_ext.kernels.fused_adamw_ accepts those)");
  TORCH_CHECK(p.device() == device && g.device() == device && m.device() == device &&
                  v.device() == device,
              "fused_adamw_: segment ", i, " has a tensor that is not on ", device);
  if (!amsgrad) return nullptr;
  TORCH_CHECK(!max_exp_avg_sqs.empty(), "fused_adamw_: group ", group,
              " uses amsgrad but max_exp_avg_sqs is empty");
  const at::Tensor& x = max_exp_avg_sqs.get(i);
  TORCH_CHECK(x.defined() && x.numel() == n && x.scalar_type() == m.scalar_type() &&
                  x.is_contiguous() && x.device() == device,
              "fused_adamw_: max_exp_avg_sqs[", i, "] must be a contiguous tensor on ",
              device, " with ", n, " elements of dtype ", m.scalar_type());
  return x.data_ptr();
}

// Checks the master of segment i (after check_segment) and returns its data pointer, or
// nullptr when the segment has none (masters empty, or an empty entry). A master is the
// float32 copy of a bfloat16 / float16 param; the kernels then keep all state in float32
// (check_segment has already tied max_exp_avg_sqs[i]'s dtype to exp_avgs[i]'s).
inline float* check_master(int64_t i, const at::Tensor& p, const at::Tensor& m,
                           const at::Tensor& v, const TensorListRef& masters,
                           const at::Device& device) {
  if (masters.empty()) return nullptr;
  const at::Tensor& w = masters.get(i);
  if (!w.defined() || w.numel() == 0) return nullptr;
  TORCH_CHECK(p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
              "fused_adamw_: masters[", i, "] is given but params[", i, "] is ",
              p.scalar_type(), " (masters are for bfloat16 / float16 params)");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == p.numel() && w.device() == device,
              "fused_adamw_: masters[", i, "] must be float32 with ", p.numel(),
              " elements on ", device, ", got ", w.scalar_type(), " with ", w.numel(), " on ",
              w.device());
  TORCH_CHECK(w.is_contiguous(), "fused_adamw_: masters[", i, "] is not contiguous (the "
              "Python wrapper zero_ext.kernels.fused_adamw_ accepts that)");
  TORCH_CHECK(m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "fused_adamw_: segment ", i, " has a master, so its exp_avgs and exp_avg_sqs "
              "must be float32, got ", m.scalar_type(), " and ", v.scalar_type());
  return w.data_ptr<float>();
}

}  // namespace adamw
}  // namespace zero_ext
