// Host-side pieces shared by the CPU (fused_adamw_cpu.cpp) and CUDA (fused_adamw.cu)
// kernels of zero_ext::fused_adamw_ and by the step plan (fused_adamw_plan.cpp): the group
// table's layout, the dtype kinds the kernels cover, the checks of one segment and its
// master (run for every segment before anything is written), and the entry points the plan
// calls on each device.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace zero_ext {
namespace adamw {

// Lists as c10::List, read by reference: an at::TensorList parameter would make the
// dispatcher copy every list into a std::vector first (a measurable host cost at tens of
// thousands of tensors per call).
using TensorListRef = c10::List<at::Tensor>;

constexpr int kCols = 7;  // lr, beta1, beta2, eps, weight_decay, amsgrad, maximize
enum Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
// A segment's flags: bits 0-1 param kind, 2-3 state kind, then these.
enum Flag : int { kAms = 1 << 4, kAligned = 1 << 5, kMaster = 1 << 6 };
constexpr int kVec = 4;  // elements per vector access of the CUDA kernel (alignment unit)

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

// The checks of the op's scalar arguments against S segments and the device (the CPU and
// CUDA kernels and the plan alike; on CUDA the steps may live on the device too).
inline void check_step_args(int64_t S, const at::Tensor& steps, const at::Tensor& segment_groups,
                            const at::Tensor& group_hparams, const at::Device& device) {
  TORCH_CHECK(steps.scalar_type() == at::kFloat && steps.dim() == 1 && steps.numel() == S,
              "fused_adamw_: steps must be a float32 tensor of shape [", S, "], got ",
              steps.scalar_type(), " ", steps.sizes());
  if (device.is_cuda()) {
    TORCH_CHECK(steps.device().is_cpu() || steps.device() == device,
                "fused_adamw_ (CUDA): steps must be on the CPU or on ", device, ", got ",
                steps.device());
  } else {
    TORCH_CHECK(steps.device().is_cpu(), "fused_adamw_ (CPU): steps must be on the CPU");
  }
  TORCH_CHECK(segment_groups.scalar_type() == at::kLong && segment_groups.dim() == 1 &&
                  segment_groups.numel() == S && segment_groups.device().is_cpu(),
              "fused_adamw_: segment_groups must be an int64 CPU tensor of shape [", S,
              "], got ", segment_groups.scalar_type(), " ", segment_groups.sizes(), " on ",
              segment_groups.device());
  TORCH_CHECK(group_hparams.scalar_type() == at::kDouble && group_hparams.dim() == 2 &&
                  group_hparams.size(1) == kCols && group_hparams.device().is_cpu(),
              "fused_adamw_: group_hparams must be a float64 CPU tensor of shape [G, 7] "
              "(lr, beta1, beta2, eps, weight_decay, amsgrad, maximize), got ",
              group_hparams.scalar_type(), " ", group_hparams.sizes(), " on ",
              group_hparams.device());
}

// ---- the device entry points of the plan (fused_adamw_plan.cpp) --------------------------

// The CPU kernel (fused_adamw_cpu.cpp), called by the plan without the dispatcher.
void fused_adamw_cpu(const TensorListRef& params, const TensorListRef& grads,
                     const TensorListRef& exp_avgs, const TensorListRef& exp_avg_sqs,
                     const TensorListRef& max_exp_avg_sqs, const at::Tensor& steps,
                     const at::Tensor& segment_groups, const at::Tensor& group_hparams,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf, const TensorListRef& masters);

// One non-empty segment as the CUDA kernel's static table holds it (the grad's pointer is
// not in it: grads change from step to step and come with each step); the plan's CPU steps
// run on the same records.
struct PlanSegment {
  void* p;
  void* m;
  void* v;
  void* vmax;  // or null without amsgrad
  float* w;    // the float32 master, or null
  int64_t numel;
  int32_t group;
  int32_t index;  // position in the op's lists: its step and its grad pointer
  int32_t flags;  // see Flag
};

inline bool aligned_to(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) == 0;
}

// The record of segment i (checked by check_segment / check_master; numel > 0). kAligned:
// every pointer, the grad's included, allows the kernel's 4-wide vector accesses.
inline PlanSegment make_segment(int64_t i, int64_t group, const at::Tensor& p, const void* grad,
                                const at::Tensor& m, const at::Tensor& v, void* vmax,
                                float* master) {
  PlanSegment s;
  std::memset(&s, 0, sizeof(s));
  s.p = p.data_ptr();
  s.m = m.data_ptr();
  s.v = v.data_ptr();
  s.vmax = vmax;
  s.w = master;
  s.numel = p.numel();
  s.group = static_cast<int32_t>(group);
  s.index = static_cast<int32_t>(i);
  const int64_t pw = kVec * p.element_size(), sw = kVec * m.element_size();
  const bool al = aligned_to(s.p, pw) && aligned_to(grad, pw) && aligned_to(s.m, sw) &&
                  aligned_to(s.v, sw) && (vmax == nullptr || aligned_to(vmax, sw)) &&
                  (master == nullptr || aligned_to(master, kVec * 4));
  s.flags = kind_of(p.scalar_type()) | (kind_of(m.scalar_type()) << 2) |
            (vmax != nullptr ? kAms : 0) | (al ? kAligned : 0) |
            (master != nullptr ? kMaster : 0);
  return s;
}

// Consecutive records of a plan, records[first, first + count), that continue each other in
// every tensor's memory, the grad's included (one grad source at consecutive offsets, so it
// holds at every step), with one group and one dtype mix: `merged` is them as one record (the
// first's pointers and index, the summed numel). A CPU step takes it whole when the steps of
// segments index_lo..index_hi are equal (they are, unless some segments skipped steps), so
// that a share laid out in flat buffers (offload_optimizer's host part) costs a few records
// per step whatever its number of tensors.
struct PlanRun {
  PlanSegment merged;
  int32_t first;
  int32_t count;
  int32_t index_lo;
  int32_t index_hi;
};

// The CPU kernel over a plan's runs of records (fused_adamw_cpu.cpp), checked when the plan
// was built: this step's grad of record r at grad_ptrs[r.index], its step at
// steps[r.index]; no per-tensor checks or views per step (thousands of small tensors cost
// them each step).
void fused_adamw_cpu_plan(const std::vector<PlanSegment>& records,
                          const std::vector<PlanRun>& runs, const void* const* grad_ptrs,
                          const at::Tensor& steps, const at::Tensor& group_hparams,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf);

// What fused_adamw.cu provides to the plan; registered when the CUDA sources are built in
// (cuda_plan_ops() is null in a CPU-only build).
struct CudaPlanOps {
  // The static table of `segs` (their records and the (segment, chunk) list), copied to
  // `device` on the current stream (`sync`: and waited for, for a table that later steps
  // may read on another stream); *n_chunks receives the number of chunks.
  at::Tensor (*upload)(const std::vector<PlanSegment>& segs, const at::Device& device,
                       bool sync, int64_t* n_chunks);
  // One step over a table of `upload`: the per-step table (each group's hyperparameters,
  // the steps when on the CPU, each segment's grad pointer) copied to the device, one launch
  // per 2^31 - 1 chunks, on the current stream. `seg_groups` holds S group indices.
  void (*step)(const at::Tensor& table, int64_t n_segs, int64_t n_chunks, int64_t S,
               const void* const* grad_ptrs, const int64_t* seg_groups, const at::Tensor& steps,
               const at::Tensor& group_hparams, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, const at::Device& device);
};

// One instance per library (hidden visibility: the copies of all translation units are
// merged when the library is linked, and never shared with another library).
inline const CudaPlanOps*& cuda_plan_ops() {
  static const CudaPlanOps* ops = nullptr;
  return ops;
}

}  // namespace adamw
}  // namespace zero_ext
