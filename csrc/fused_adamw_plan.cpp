// zero_ext.AdamWPlan (torch.classes.zero_ext.AdamWPlan): one fused AdamW call whose lists
// are kept in C++ from step to step, so that a step costs one check per tensor in C++ and one
// launch, not the op's list conversion and checks at every call (zero_ext/kernels/adamw.py,
// FusedAdamWPlan, is its Python side; docs/performance.md, "The kernels on a GPU").
//
// Built from the op's lists (params, moments, max, masters, group of each segment) plus where
// each segment's grad comes from: `sources[seg_source[i]].grad`, from element
// seg_grad_offset[i] on (whole or a run of the source's flattened grad). Grads are read from
// their sources at each step, since autograd gives new grad tensors step after step.
// - ready(): whether a step may run as built: every source still has a grad (and every
//   source in `no_grad_sources` still none) of the dtype, device and numel seen at build,
//   contiguous, not sparse, aligned as at build where the kernel's vector accesses need it,
//   and every param / state tensor still has the storage (data pointer) seen at build, every
//   param its numel (but the params the caller declared fixed: `fixed_params`, memory it
//   owns and never moves, as offload_optimizer's host keys), and every step count given at
//   build (`steps`: the 0-d tensors whose values the caller passes to run(), e.g. the AdamW
//   engine's views into its step pack) still has the storage seen at build (`step.data = t`
//   or `step.set_(t)` cut a count off the memory run() reads); also records each segment's
//   grad pointer. False: nothing was changed, and the caller rebuilds (or takes the op
//   path, whose checks report any bad input). Big plans check on the intra-op threads.
// - run(steps, group_hparams, grad_scale, found_inf): the step, after a ready() that returned
//   True; the hyperparameters and the steps are read fresh. CUDA: the static table (pointers,
//   numels, chunks) lives on the device since the build; a step copies the per-step table and
//   launches once (fused_adamw.cu). CPU: the CPU kernel runs on the kept records, each run
//   of records that continue each other in every tensor's memory (the grad's too: one
//   source at consecutive offsets) as one segment while the run's steps are equal
//   (PlanRun): a share packed in flat buffers costs a few records per step.
// The constructor checks every segment as the op does (same messages): it raises for what
// the op would reject.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "fused_adamw_common.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace zero_ext {
namespace adamw {
namespace {

using Tensors = std::vector<at::Tensor>;
// ready()'s checks: segments per task of its parallel loop (a plan of at most this many
// segments checks on the calling thread)
constexpr int64_t kCheckGrain = 4096;

c10::List<at::Tensor> to_list(const Tensors& ts) {
  c10::List<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(t);
  return out;
}

const void* data_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.const_data_ptr() : nullptr;
}

}  // namespace

class AdamWPlan : public torch::CustomClassHolder {
 public:
  AdamWPlan(Tensors params, Tensors exp_avgs, Tensors exp_avg_sqs, Tensors max_exp_avg_sqs,
            Tensors masters, Tensors sources, at::Tensor seg_source, at::Tensor seg_grad_offset,
            Tensors no_grad_sources, at::Tensor segment_groups, at::Tensor group_hparams,
            std::optional<at::Tensor> fixed_params, std::optional<Tensors> steps)
      : params_(to_list(params)),
        exp_avgs_(to_list(exp_avgs)),
        exp_avg_sqs_(to_list(exp_avg_sqs)),
        max_exp_avg_sqs_(to_list(max_exp_avg_sqs)),
        masters_(to_list(masters)),
        sources_(std::move(sources)),
        no_grad_sources_(std::move(no_grad_sources)) {
    const int64_t S = check_list_lengths(params_, params_, exp_avgs_, exp_avg_sqs_,
                                         max_exp_avg_sqs_, masters_);
    TORCH_CHECK(S > 0 && S < (int64_t(1) << 31), "AdamWPlan: needs 1 to 2^31 - 1 segments, got ",
                S);
    device_ = params_.get(0).device();
    TORCH_CHECK(device_.is_cpu() || device_.is_cuda(), "AdamWPlan: params on ", device_);
    TORCH_CHECK(device_.is_cpu() || cuda_plan_ops() != nullptr,
                "AdamWPlan: this build of the library has no CUDA kernels");
    for (const at::Tensor* t : {&seg_source, &seg_grad_offset, &segment_groups}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->numel() == S &&
                      t->device().is_cpu(),
                  "AdamWPlan: seg_source, seg_grad_offset and segment_groups must be int64 CPU "
                  "tensors of shape [", S, "]");
    }
    TORCH_CHECK(group_hparams.scalar_type() == at::kDouble && group_hparams.dim() == 2 &&
                    group_hparams.size(1) == kCols && group_hparams.device().is_cpu(),
                "AdamWPlan: group_hparams must be a float64 CPU tensor of shape [G, 7]");
    fixed_.assign(S, 0);
    if (fixed_params.has_value()) {
      TORCH_CHECK(fixed_params->scalar_type() == at::kBool && fixed_params->dim() == 1 &&
                      fixed_params->numel() == S && fixed_params->device().is_cpu(),
                  "AdamWPlan: fixed_params must be a bool CPU tensor of shape [", S, "]");
      const at::Tensor f = fixed_params->contiguous();
      for (int64_t i = 0; i < S; ++i) fixed_[i] = f.data_ptr<bool>()[i] ? 1 : 0;
    }
    if (steps.has_value()) {
      TORCH_CHECK(static_cast<int64_t>(steps->size()) == S,
                  "AdamWPlan: steps must have one tensor per segment (", S, "), got ",
                  steps->size());
      steps_ = std::move(*steps);
      step_impls_.resize(S);
      step_want_.resize(S);
      for (int64_t i = 0; i < S; ++i) {
        TORCH_CHECK(steps_[i].defined(), "AdamWPlan: steps[", i, "] is undefined");
        step_impls_[i] = steps_[i].unsafeGetTensorImpl();
        step_want_[i] = where(step_impls_[i]);
      }
    }
    groups_ = segment_groups.contiguous();
    const at::Tensor src_c = seg_source.contiguous(), off_c = seg_grad_offset.contiguous();
    const at::Tensor hp = group_hparams.contiguous();
    const int64_t* group = groups_.data_ptr<int64_t>();
    const int64_t* src = src_c.data_ptr<int64_t>();
    const int64_t* off = off_c.data_ptr<int64_t>();
    const int64_t G = hp.size(0);
    const int64_t n_src = static_cast<int64_t>(sources_.size());

    // Each source's grad as it is now: what every later step must find again.
    src_dtype_.resize(n_src);
    src_numel_.resize(n_src);
    std::vector<at::Tensor> src_grad(n_src);
    for (int64_t j = 0; j < n_src; ++j) {
      const at::Tensor g = sources_[j].grad();
      TORCH_CHECK(g.defined() && !g.is_sparse() && g.is_contiguous(),
                  "AdamWPlan: source ", j, " has no grad, or a sparse or non-contiguous one");
      src_grad[j] = g.view({-1});
      src_dtype_[j] = g.scalar_type();
      src_numel_[j] = g.numel();
    }
    ams_.assign(G, -1);
    seg_src_.resize(S);
    seg_off_bytes_.resize(S);
    whole_.resize(S);
    check_vec_.resize(S);
    impls_.resize(S);
    grad_align_.assign(S, 1);
    grad_ptrs_.assign(S, nullptr);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t gi = group[i], j = src[i];
      TORCH_CHECK(gi >= 0 && gi < G, "fused_adamw_: segment_groups[", i, "] = ", gi,
                  " is out of range for ", G, " groups");
      TORCH_CHECK(j >= 0 && j < n_src, "AdamWPlan: seg_source[", i, "] = ", j,
                  " is out of range for ", n_src, " sources");
      const at::Tensor& p = params_.get(i);
      const int64_t n = p.numel();
      TORCH_CHECK(off[i] >= 0 && off[i] <= src_numel_[j] - n, "AdamWPlan: segment ", i,
                  " (", n, " elements at grad offset ", off[i], ") does not fit in the grad of "
                  "source ", j, " (", src_numel_[j], " elements)");
      const bool ams = hp.data_ptr<double>()[gi * kCols + 5] != 0.0;
      ams_[gi] = ams;
      const at::Tensor g = src_grad[j].narrow(0, off[i], n);
      const at::Tensor& m = exp_avgs_.get(i);
      const at::Tensor& v = exp_avg_sqs_.get(i);
      void* vmax = check_segment(i, p, g, m, v, max_exp_avg_sqs_, gi, ams, device_);
      float* master = check_master(i, p, m, v, masters_, device_);
      seg_src_[i] = j;
      seg_off_bytes_[i] = off[i] * g.element_size();
      whole_[i] = off[i] == 0 && n == src_numel_[j];
      // the pointers each step must find again: param, moments, max, master
      check_vec_[i] = {p.const_data_ptr(), m.const_data_ptr(), v.const_data_ptr(),
                       vmax, master, n};
      // (the tensors themselves, held by the lists: ready() reads their storage directly)
      impls_[i] = {p.unsafeGetTensorImpl(), m.unsafeGetTensorImpl(),
                   v.unsafeGetTensorImpl(),
                   vmax != nullptr ? max_exp_avg_sqs_.get(i).unsafeGetTensorImpl() : nullptr,
                   master != nullptr ? masters_.get(i).unsafeGetTensorImpl() : nullptr};
      if (n == 0) continue;
      grad_ptrs_[i] = g.const_data_ptr();
      PlanSegment s = make_segment(i, gi, p, grad_ptrs_[i], m, v, vmax, master);
      segs_.push_back(s);
      grad_align_[i] = (s.flags & kAligned) ? kVec * p.element_size() : 1;
    }
    S_ = S;
    if (device_.is_cpu()) build_runs();
    if (device_.is_cuda() && !segs_.empty()) {
      table_ = cuda_plan_ops()->upload(segs_, device_, /*sync=*/true, &n_chunks_);
    }
  }

  // See the file's comment. Cost: a few loads per tensor. `hold`: keep a reference to each
  // grad until run() (for a caller that runs other code between the two, which might drop
  // a grad; without it the grads must stay as they are until run() launches).
  bool ready(bool hold) {
    ready_ = false;
    held_.clear();
    for (const at::Tensor& t : no_grad_sources_) {
      if (t.grad().defined()) return false;
    }
    const int64_t n_src = static_cast<int64_t>(sources_.size());
    src_base_.resize(n_src);
    for (int64_t j = 0; j < n_src; ++j) {
      const at::Tensor& g = sources_[j].grad();
      if (!g.defined() || g.is_sparse() || g.scalar_type() != src_dtype_[j] ||
          g.device() != device_ || g.numel() != src_numel_[j] || !g.is_contiguous()) {
        return false;
      }
      src_base_[j] = static_cast<const char*>(g.const_data_ptr());
      if (hold) held_.push_back(g);
    }
    // Every tensor's storage, in parallel over the segments for big plans: these loads
    // miss the caches (a step streams far more memory than the caches hold), so they cost
    // about 15 ns per tensor on one core, as long as the step of a 1024-element segment.
    std::atomic<bool> moved{false};
    at::parallel_for(0, S_, kCheckGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const SegPtrs& want = check_vec_[i];
        const auto& t = impls_[i];
        // (each tensor's data pointer as const_data_ptr() gives it, read from its storage
        // without that call's checks and reference counting: thousands of tensors a step;
        // a fixed param, offload_optimizer's host key, is its caller's own and never moves)
        if ((!fixed_[i] && (where(t[0]) != want.p || t[0]->numel() != want.numel)) ||
            where(t[1]) != want.m || where(t[2]) != want.v ||
            (want.vmax != nullptr && where(t[3]) != want.vmax) ||
            (want.w != nullptr && where(t[4]) != want.w) ||
            (!step_impls_.empty() && where(step_impls_[i]) != step_want_[i])) {
          moved.store(true, std::memory_order_relaxed);
          return;
        }
        const char* g = src_base_[seg_src_[i]] + seg_off_bytes_[i];
        // built for vector accesses where aligned (empty segments: alignment 1)
        if (!aligned_to(g, grad_align_[i])) {
          moved.store(true, std::memory_order_relaxed);
          return;
        }
        grad_ptrs_[i] = g;
      }
    });
    if (moved.load()) return false;
    ready_ = true;
    return true;
  }

  void run(at::Tensor steps, at::Tensor group_hparams, std::optional<at::Tensor> grad_scale,
           std::optional<at::Tensor> found_inf) {
    TORCH_CHECK(ready_, "AdamWPlan.run: ready() must return True right before each run");
    ready_ = false;
    const std::vector<at::Tensor> held = std::move(held_);  // released when the step is queued
    held_.clear();
    check_step_args(S_, steps, groups_, group_hparams, device_);
    const int64_t G = group_hparams.size(0);
    TORCH_CHECK(G >= static_cast<int64_t>(ams_.size()),
                "AdamWPlan.run: group_hparams has ", G, " groups, the plan was built for ",
                ams_.size());
    const at::Tensor hp = group_hparams.contiguous();
    for (size_t g = 0; g < ams_.size(); ++g) {
      TORCH_CHECK(ams_[g] < 0 || ams_[g] == (hp.data_ptr<double>()[g * kCols + 5] != 0.0),
                  "AdamWPlan.run: amsgrad of group ", g, " changed since the plan was built");
    }
    if (device_.is_cpu()) {
      // The CPU kernel on the records checked at the build and the grads ready() found
      // (their dtype, numel, contiguity and every state tensor's storage as at the build).
      fused_adamw_cpu_plan(segs_, runs_, grad_ptrs_.data(), steps, hp, grad_scale, found_inf);
      return;
    }
    for (const std::optional<at::Tensor>* t : {&grad_scale, &found_inf}) {
      if (!t->has_value()) continue;
      TORCH_CHECK((*t)->scalar_type() == at::kFloat && (*t)->numel() == 1 &&
                      ((*t)->device() == device_ || (*t)->device().is_cpu()),
                  "fused_adamw_: grad_scale and found_inf must be float32 tensors with one "
                  "element, on ", device_, " or the CPU");
    }
    if (segs_.empty()) return;
    cuda_plan_ops()->step(table_, static_cast<int64_t>(segs_.size()), n_chunks_, S_,
                          grad_ptrs_.data(), groups_.data_ptr<int64_t>(), steps, hp,
                          grad_scale, found_inf, device_);
  }

  int64_t num_segments() const { return S_; }
  // CPU: the records a step starts from when every run's steps are equal (PlanRun)
  int64_t num_runs() const { return static_cast<int64_t>(runs_.size()); }

 private:
  struct SegPtrs {
    const void* p;
    const void* m;
    const void* v;
    const void* vmax;
    const void* w;
    int64_t numel;  // the param's
  };

  c10::List<at::Tensor> params_, exp_avgs_, exp_avg_sqs_, max_exp_avg_sqs_, masters_;
  Tensors sources_, no_grad_sources_;
  at::Tensor groups_;  // int64 [S], CPU
  at::Device device_{at::kCPU};
  int64_t S_ = 0;
  std::vector<at::ScalarType> src_dtype_;
  std::vector<int64_t> src_numel_;
  std::vector<int8_t> ams_;  // per group: -1 no segment, else its amsgrad flag at build
  std::vector<int64_t> seg_src_, seg_off_bytes_;
  std::vector<bool> whole_;
  std::vector<SegPtrs> check_vec_;
  std::vector<std::array<const c10::TensorImpl*, 5>> impls_;  // p, m, v, vmax, master
  // the step counts given at build (held) and where each one's memory was then: empty
  // when none were given
  Tensors steps_;
  std::vector<const c10::TensorImpl*> step_impls_;
  std::vector<const void*> step_want_;

  // The CPU step's runs (PlanRun): consecutive records that continue each other in the
  // memory of every tensor, the grad's included (the same source at consecutive offsets:
  // where the grads come from one flat buffer, as offload_optimizer's host part has them).
  void build_runs() {
    runs_.clear();
    for (size_t k = 0; k < segs_.size(); ++k) {
      const PlanSegment& b = segs_[k];
      if (!runs_.empty() && continues(segs_[runs_.back().first + runs_.back().count - 1], b)) {
        PlanRun& r = runs_.back();
        r.merged.numel += b.numel;
        ++r.count;
        r.index_hi = b.index;
        continue;
      }
      PlanRun r;
      r.merged = b;
      r.first = static_cast<int32_t>(k);
      r.count = 1;
      r.index_lo = r.index_hi = b.index;
      runs_.push_back(r);
    }
  }

  bool continues(const PlanSegment& a, const PlanSegment& b) const {
    if (a.group != b.group || (a.flags & ~kAligned) != (b.flags & ~kAligned)) return false;
    if (seg_src_[a.index] != seg_src_[b.index]) return false;
    const int64_t ps = (a.flags & 3) == kF32 ? 4 : 2, ss = ((a.flags >> 2) & 3) == kF32 ? 4 : 2;
    auto follows = [&](const void* x, int64_t size, const void* y) {
      return static_cast<const char*>(x) + a.numel * size == static_cast<const char*>(y);
    };
    const bool vmax = a.vmax == nullptr ? b.vmax == nullptr
                                        : b.vmax != nullptr && follows(a.vmax, ss, b.vmax);
    const bool w = a.w == nullptr ? b.w == nullptr : b.w != nullptr && follows(a.w, 4, b.w);
    return seg_off_bytes_[a.index] + a.numel * ps == seg_off_bytes_[b.index] &&
           follows(a.p, ps, b.p) && follows(a.m, ss, b.m) && follows(a.v, ss, b.v) && vmax && w;
  }

  static const void* where(const c10::TensorImpl* t) {
    const c10::Storage& st = t->unsafe_storage();
    if (!st) return nullptr;
    return static_cast<const char*>(st.data()) + t->storage_offset() * t->itemsize();
  }
  std::vector<int64_t> grad_align_;  // per segment: the grad's required alignment
  std::vector<uint8_t> fixed_;       // per segment: the param's storage is not checked
  std::vector<const char*> src_base_;
  std::vector<const void*> grad_ptrs_;  // per segment, as of the last ready()
  std::vector<at::Tensor> held_;        // the grads, from ready(hold=true) to run()
  std::vector<PlanSegment> segs_;       // the non-empty segments
  std::vector<PlanRun> runs_;           // CPU: segs_ as runs (build_runs)
  at::Tensor table_;                    // CUDA: the static table on the device
  int64_t n_chunks_ = 0;
  bool ready_ = false;
};

}  // namespace adamw
}  // namespace zero_ext

namespace {

void define_plan_class(torch::Library& m) {
  m.class_<zero_ext::adamw::AdamWPlan>("AdamWPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, at::Tensor,
                       std::vector<at::Tensor>, at::Tensor, at::Tensor,
                       std::optional<at::Tensor>, std::optional<std::vector<at::Tensor>>>(),
           "", {torch::arg("params"), torch::arg("exp_avgs"), torch::arg("exp_avg_sqs"),
                torch::arg("max_exp_avg_sqs"), torch::arg("masters"), torch::arg("sources"),
                torch::arg("seg_source"), torch::arg("seg_grad_offset"),
                torch::arg("no_grad_sources"), torch::arg("segment_groups"),
                torch::arg("group_hparams"), torch::arg("fixed_params") = c10::IValue(),
                torch::arg("steps") = c10::IValue()})
      .def("ready", &zero_ext::adamw::AdamWPlan::ready)
      .def("run", &zero_ext::adamw::AdamWPlan::run)
      .def("num_segments", &zero_ext::adamw::AdamWPlan::num_segments)
      .def("num_runs", &zero_ext::adamw::AdamWPlan::num_runs);
}

// A fragment of the namespace (its op schemas are defined in Python, zero_ext/kernels/_ops.py),
// registered once per process: torch refuses a second class of one name with an exception,
// which a static initializer cannot pass on (the process would abort while loading a second
// copy of the library, another build of these sources). Such a copy's kernels are
// registered over the first's; its class is not (the first one serves).
struct RegisterPlanClass {
  std::unique_ptr<torch::Library> lib;
  RegisterPlanClass() {
    if (torch::getCustomClass("__torch__.torch.classes.zero_ext.AdamWPlan")) return;
    lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "zero_ext", std::nullopt,
                                           __FILE__, __LINE__);
    define_plan_class(*lib);
  }
} register_plan_class;

}  // namespace
