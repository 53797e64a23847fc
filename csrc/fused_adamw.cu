// CUDA kernel of zero_ext::fused_adamw_: one AdamW step over S segments of any number of
// param groups in ONE kernel launch.
//
// Two tables on the device:
// - the static table: one record per non-empty segment (pointers of param, moments, max,
//   master; numel, group, flags) and one (segment, chunk) record per block. The op builds it
//   at every call; a plan (fused_adamw_plan.cpp) builds it once and keeps it while its
//   tensors keep their storage, so that its steps copy only the per-step table;
// - the per-step table: each group's hyperparameters (and its float scalars, computed on the
//   host in double, see docs/design.md, "AdamW arithmetic", when all of its segments have one
//   step: the common case), the steps (when on the CPU), and each segment's grad pointer.
// Device: each block handles one chunk of kChunk elements of one segment; thread 0 fetches
// (or, for groups whose segments' steps differ or live on the device, computes) the scalars
// into shared memory; the element loop uses 4-wide vector loads when the segment's pointers
// are aligned, fp32 math, and stores the state in its own dtype. grad_scale and found_inf are
// read on the device (no host sync).
// A bf16/fp16 segment with a float32 master is computed on the master (fp32 state); an
// element whose param no longer holds the master's rounding takes the param's value first.
// Launches are split only if the chunk count exceeds the grid limit.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "fused_adamw_common.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace zero_ext {
namespace {

using adamw::kCols;
using adamw::kVec;
constexpr int kThreads = 256;
constexpr int64_t kChunk = int64_t(kThreads) * kVec * 8;  // elements per block
constexpr int64_t kMaxBlocksPerLaunch = 2147483647;      // gridDim.x limit

using adamw::kF32;
using adamw::kBF16;
using adamw::kF16;
using adamw::kind_of;
using adamw::kAms;
using adamw::kAligned;
using adamw::kMaster;
using adamw::PlanSegment;
using adamw::make_segment;

struct Scalars {  // float scalars of one segment (see make_scalars)
  float decay, lerp_w, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps, grad_mul;
  int lerp_lo;
  int pad_[3];
};

struct GroupStep {  // per step: one group's hyperparameters, and its scalars when uniform
  double lr, beta1, beta2, eps, wd, maximize;
  Scalars sc;       // valid when `uniform`: every segment of the group has one (host) step
  int32_t uniform;
  int32_t pad_[3];
};

using SegMeta = PlanSegment;  // the static record of one segment

struct ChunkMeta {
  int32_t seg;
  int32_t chunk;
};

__host__ __device__ inline Scalars make_scalars(double lr, double beta1, double beta2,
                                                double eps, double wd, bool maximize,
                                                double step) {
  const double bc1 = 1.0 - pow(beta1, step);
  const double bc2 = 1.0 - pow(beta2, step);
  Scalars s;
  s.decay = float(1.0 - lr * wd);
  const float w = float(1.0 - beta1);
  s.lerp_lo = fabsf(w) < 0.5f;
  s.lerp_w = s.lerp_lo ? w : -(1.0f - w);  // torch's lerp: g - (g - m) * (1 - w) when w >= .5
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.neg_step_size = float(-(lr / bc1));
  s.bc2_sqrt = float(sqrt(bc2));
  s.eps = float(eps);
  s.grad_mul = maximize ? -1.0f : 1.0f;
  s.pad_[0] = s.pad_[1] = s.pad_[2] = 0;
  return s;
}

// ---- element access ----------------------------------------------------------------------
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}
__device__ __forceinline__ unsigned short bits16(__half x) { return __half_as_ushort(x); }

// The value a mastered element is updated from: the master, unless the param was written by
// someone else since the last step (its bits differ from the master's rounding).
template <typename PT>
__device__ __forceinline__ float master_or_param(float w, PT p) {
  return bits16(from_f<PT>(w)) == bits16(p) ? w : to_f(p);
}

// 4 consecutive elements: one 16-byte (fp32) or 8-byte (16-bit) access; needs alignment.
template <typename T> struct Pack4;
template <> struct Pack4<float> { using type = float4; };
template <> struct Pack4<__nv_bfloat16> { using type = uint2; };
template <> struct Pack4<__half> { using type = uint2; };

template <typename T>
__device__ __forceinline__ void load4(const T* ptr, float (&r)[kVec]) {
  using V = typename Pack4<T>::type;
  V raw = *reinterpret_cast<const V*>(ptr);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) r[k] = to_f(e[k]);
}
template <typename T>
__device__ __forceinline__ void load4_raw(const T* ptr, T (&r)[kVec]) {
  using V = typename Pack4<T>::type;
  V raw = *reinterpret_cast<const V*>(ptr);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) r[k] = e[k];
}
template <typename T>
__device__ __forceinline__ void store4(T* ptr, const float (&r)[kVec]) {
  using V = typename Pack4<T>::type;
  V raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) e[k] = from_f<T>(r[k]);
  *reinterpret_cast<V*>(ptr) = raw;
}

// One element (docs/design.md, "AdamW arithmetic"); vmax only read/written when AMS.
template <bool AMS>
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v, float& vmax,
                                              const Scalars& c, float grad_div) {
  g = g * c.grad_mul / grad_div;
  const float base = c.lerp_lo ? m : g;
  m = base + c.lerp_w * (g - m);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  float vh = v;
  if (AMS) {
    vmax = (vmax > v || isnan(vmax)) ? vmax : v;  // NaN wins, as torch.maximum
    vh = vmax;
  }
  const float denom = sqrtf(vh) / c.bc2_sqrt + c.eps;
  p = p * c.decay + c.neg_step_size * m / denom;
}

// MW: the segment has a float32 master (PT bf16/fp16, ST float); the update runs on it.
template <typename PT, typename ST, bool AMS, bool MW>
__device__ void run_chunk(const SegMeta& s, const void* grad, const Scalars& c, float grad_div,
                          int64_t start, int64_t end, bool aligned) {
  PT* __restrict__ p = static_cast<PT*>(s.p);
  const PT* __restrict__ g = static_cast<const PT*>(grad);
  ST* __restrict__ m = static_cast<ST*>(s.m);
  ST* __restrict__ v = static_cast<ST*>(s.v);
  ST* __restrict__ x = static_cast<ST*>(s.vmax);
  float* __restrict__ w = s.w;
  int64_t scalar_from = start;
  if (aligned) {  // start is a multiple of kChunk, hence of kVec: every access is aligned
    const int64_t vec_end = start + ((end - start) / kVec) * kVec;
    for (int64_t i = start + int64_t(threadIdx.x) * kVec; i < vec_end;
         i += int64_t(blockDim.x) * kVec) {
      float pr[kVec], gr[kVec], mr[kVec], vr[kVec], xr[kVec];
      load4(g + i, gr);
      if constexpr (MW) {
        PT praw[kVec];
        load4_raw(p + i, praw);
        load4(w + i, pr);
#pragma unroll
        for (int k = 0; k < kVec; ++k) pr[k] = master_or_param(pr[k], praw[k]);
      } else {
        load4(p + i, pr);
      }
      load4(m + i, mr);
      load4(v + i, vr);
      if (AMS) load4(x + i, xr);
#pragma unroll
      for (int k = 0; k < kVec; ++k) adamw_element<AMS>(pr[k], gr[k], mr[k], vr[k], xr[k], c, grad_div);
      if constexpr (MW) store4(w + i, pr);
      store4(p + i, pr);
      store4(m + i, mr);
      store4(v + i, vr);
      if (AMS) store4(x + i, xr);
    }
    scalar_from = vec_end;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
    float pe;
    if constexpr (MW) pe = master_or_param(w[i], p[i]);
    else pe = to_f(p[i]);
    float me = to_f(m[i]), ve = to_f(v[i]);
    float xe = AMS ? to_f(x[i]) : 0.0f;
    adamw_element<AMS>(pe, to_f(g[i]), me, ve, xe, c, grad_div);
    if constexpr (MW) w[i] = pe;
    p[i] = from_f<PT>(pe);
    m[i] = from_f<ST>(me);
    v[i] = from_f<ST>(ve);
    if (AMS) x[i] = from_f<ST>(xe);
  }
}

template <typename PT, typename ST, bool MW = false>
__device__ __forceinline__ void run_ams(const SegMeta& s, const void* g, const Scalars& c,
                                        float gd, int64_t a, int64_t b, bool al, bool ams) {
  if (ams) run_chunk<PT, ST, true, MW>(s, g, c, gd, a, b, al);
  else run_chunk<PT, ST, false, MW>(s, g, c, gd, a, b, al);
}

// table: the static table (segments at seg_off, chunks at chunk_off); step_table: the
// per-step table (groups at 0, host steps at steps_off or -1, grad pointers at gptr_off).
__global__ void __launch_bounds__(kThreads)
fused_adamw_kernel(const uint8_t* __restrict__ table, int64_t seg_off, int64_t chunk_off,
                   const uint8_t* __restrict__ step_table, int64_t steps_off, int64_t gptr_off,
                   int64_t chunk_base, const float* __restrict__ steps_dev,
                   const float* __restrict__ grad_scale, const float* __restrict__ found_inf,
                   float host_grad_div) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // skipped step: touch nothing
  const ChunkMeta ck =
      reinterpret_cast<const ChunkMeta*>(table + chunk_off)[chunk_base + blockIdx.x];
  const SegMeta& s = reinterpret_cast<const SegMeta*>(table + seg_off)[ck.seg];
  __shared__ Scalars sc;
  __shared__ const void* grad;
  if (threadIdx.x == 0) {
    const GroupStep& gs = reinterpret_cast<const GroupStep*>(step_table)[s.group];
    if (gs.uniform) {
      sc = gs.sc;
    } else {
      const float step = steps_dev != nullptr
          ? steps_dev[s.index]
          : reinterpret_cast<const float*>(step_table + steps_off)[s.index];
      sc = make_scalars(gs.lr, gs.beta1, gs.beta2, gs.eps, gs.wd, gs.maximize != 0.0,
                        double(step));
    }
    grad = reinterpret_cast<const void* const*>(step_table + gptr_off)[s.index];
  }
  __syncthreads();
  const Scalars c = sc;
  const void* g = grad;
  const float grad_div = grad_scale != nullptr ? *grad_scale : host_grad_div;
  const int64_t start = int64_t(ck.chunk) * kChunk;
  const int64_t end = min(s.numel, start + kChunk);
  const int flags = s.flags;
  const int pk = flags & 3, sk = (flags >> 2) & 3;
  const bool ams = (flags & kAms) != 0, al = (flags & kAligned) != 0;
  const bool mw = (flags & kMaster) != 0;
  if (pk == kF32) {
    run_ams<float, float>(s, g, c, grad_div, start, end, al, ams);
  } else if (pk == kBF16) {
    if (mw) run_ams<__nv_bfloat16, float, true>(s, g, c, grad_div, start, end, al, ams);
    else if (sk == kF32) run_ams<__nv_bfloat16, float>(s, g, c, grad_div, start, end, al, ams);
    else run_ams<__nv_bfloat16, __nv_bfloat16>(s, g, c, grad_div, start, end, al, ams);
  } else {
    if (mw) run_ams<__half, float, true>(s, g, c, grad_div, start, end, al, ams);
    else if (sk == kF32) run_ams<__half, float>(s, g, c, grad_div, start, end, al, ams);
    else run_ams<__half, __half>(s, g, c, grad_div, start, end, al, ams);
  }
}

// ---- host side ---------------------------------------------------------------------------
inline int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name,
                         const at::Device& dev) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1,
              "fused_adamw_: ", name, " must be a float32 tensor with one element, got ",
              t->scalar_type(), " with ", t->numel(), " elements");
  TORCH_CHECK(t->device() == dev || t->device().is_cpu(), "fused_adamw_ (CUDA): ", name,
              " must be on ", dev, " (or the CPU), got ", t->device());
}

// Static table: [segments | chunks]. The chunk records follow the segments at a 16-byte
// aligned offset; both offsets are derived from the segment count by the same rule here and
// in step().
int64_t chunk_offset(int64_t n_segs) {
  return round_up(n_segs * int64_t(sizeof(SegMeta)), 16);
}

at::Tensor upload_table(const std::vector<PlanSegment>& segs, const at::Device& dev, bool sync,
                        int64_t* n_chunks_out) {
  int64_t n_chunks = 0;
  for (const PlanSegment& s : segs) {
    const int64_t nc = (s.numel + kChunk - 1) / kChunk;
    TORCH_CHECK(nc < (int64_t(1) << 31), "fused_adamw_: segment ", s.index, " is too large");
    n_chunks += nc;
  }
  const int64_t n_segs = static_cast<int64_t>(segs.size());
  const int64_t chunk_off = chunk_offset(n_segs);
  const int64_t bytes = std::max<int64_t>(1, chunk_off + n_chunks * int64_t(sizeof(ChunkMeta)));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* base = host.data_ptr<uint8_t>();
  if (n_segs) std::memcpy(base, segs.data(), segs.size() * sizeof(SegMeta));
  ChunkMeta* ck = reinterpret_cast<ChunkMeta*>(base + chunk_off);
  for (int64_t k = 0; k < n_segs; ++k) {
    const int32_t nc = static_cast<int32_t>((segs[k].numel + kChunk - 1) / kChunk);
    for (int32_t c = 0; c < nc; ++c) *ck++ = ChunkMeta{static_cast<int32_t>(k), c};
  }
  c10::cuda::CUDAGuard guard(dev);
  *n_chunks_out = n_chunks;
  // The copy runs on the current stream and records the pinned block's use on it.
  return host.to(at::TensorOptions().device(dev), /*non_blocking=*/!sync);
}

// One step over a static table (see CudaPlanOps::step). Every argument has been checked.
void run_step(const at::Tensor& table, int64_t n_segs, int64_t n_chunks, int64_t S,
              const void* const* grad_ptrs, const int64_t* seg_groups, const at::Tensor& steps,
              const at::Tensor& group_hparams, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf, const at::Device& dev) {
  if (n_chunks == 0) return;
  float host_grad_div = 1.0f;
  const float* grad_scale_dev = nullptr;
  if (grad_scale.has_value()) {
    if (grad_scale->device().is_cpu()) host_grad_div = grad_scale->item<float>();
    else grad_scale_dev = grad_scale->data_ptr<float>();
  }
  const float* found_inf_dev = nullptr;
  if (found_inf.has_value()) {
    if (found_inf->device().is_cpu()) {
      if (found_inf->item<float>() != 0.0f) return;
    } else {
      found_inf_dev = found_inf->data_ptr<float>();
    }
  }
  const at::Tensor hp_c = group_hparams.contiguous();
  const double* hp = hp_c.data_ptr<double>();
  const int64_t G = hp_c.size(0);
  const bool steps_on_device = steps.device().is_cuda();
  at::Tensor steps_c = steps.contiguous();  // (the device's own, when there)
  const float* host_steps = steps_on_device ? nullptr : steps_c.data_ptr<float>();

  // [groups | host steps | grad pointers]
  const int64_t steps_off = round_up(G * int64_t(sizeof(GroupStep)), 16);
  const int64_t gptr_off = round_up(steps_off + (steps_on_device ? 0 : S * 4), 16);
  const int64_t bytes = gptr_off + S * int64_t(sizeof(void*));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* base = host.data_ptr<uint8_t>();
  GroupStep* gs = reinterpret_cast<GroupStep*>(base);
  // A group's scalars are computed here once when all of its segments share one step (the
  // steps on the CPU); otherwise each block computes its segment's.
  std::vector<float> first(G, 0.0f);
  std::vector<int8_t> state(G, 0);  // 0 no segment, 1 one step so far, 2 several
  if (!steps_on_device) {
    for (int64_t i = 0; i < S; ++i) {
      const int64_t g = seg_groups[i];
      if (state[g] == 0) {
        state[g] = 1;
        first[g] = host_steps[i];
      } else if (state[g] == 1 && !(host_steps[i] == first[g])) {
        state[g] = 2;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const double* h = hp + g * kCols;
    std::memset(&gs[g], 0, sizeof(GroupStep));
    gs[g].lr = h[0];
    gs[g].beta1 = h[1];
    gs[g].beta2 = h[2];
    gs[g].eps = h[3];
    gs[g].wd = h[4];
    gs[g].maximize = h[6];
    if (state[g] == 1) {
      gs[g].sc = make_scalars(h[0], h[1], h[2], h[3], h[4], h[6] != 0.0, double(first[g]));
      gs[g].uniform = 1;
    }
  }
  if (!steps_on_device) std::memcpy(base + steps_off, host_steps, size_t(S) * 4);
  std::memcpy(base + gptr_off, grad_ptrs, size_t(S) * sizeof(void*));

  c10::cuda::CUDAGuard guard(dev);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev.index());
  // The copy runs on the current stream and records the pinned block's use on it.
  const at::Tensor step_table = host.to(at::TensorOptions().device(dev), /*non_blocking=*/true);
  // a plan's table read on a stream other than the one it was made on must outlive this step
  c10::cuda::CUDACachingAllocator::recordStream(table.storage().data_ptr(), stream);
  const float* steps_dev = steps_on_device ? steps_c.data_ptr<float>() : nullptr;
  const int64_t chunk_off = chunk_offset(n_segs);
  for (int64_t done = 0; done < n_chunks;) {
    const int64_t blocks = std::min(n_chunks - done, kMaxBlocksPerLaunch);
    fused_adamw_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream.stream()>>>(
        table.data_ptr<uint8_t>(), 0, chunk_off, step_table.data_ptr<uint8_t>(),
        steps_on_device ? -1 : steps_off, gptr_off, done, steps_dev, grad_scale_dev,
        found_inf_dev, host_grad_div);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    done += blocks;
  }
}

using adamw::TensorListRef;

void fused_adamw_cuda(const TensorListRef& params, const TensorListRef& grads,
                      const TensorListRef& exp_avgs, const TensorListRef& exp_avg_sqs,
                      const TensorListRef& max_exp_avg_sqs,
                      const at::Tensor& steps, const at::Tensor& segment_groups,
                      const at::Tensor& group_hparams,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const TensorListRef& masters) {
  const int64_t S = adamw::check_list_lengths(params, grads, exp_avgs, exp_avg_sqs,
                                              max_exp_avg_sqs, masters);
  TORCH_CHECK(S < (int64_t(1) << 31), "fused_adamw_: too many segments (", S, ")");
  if (S == 0) return;
  const at::Device dev = params.get(0).device();
  TORCH_CHECK(dev.is_cuda(), "fused_adamw_ (CUDA): params[0] is on ", dev);
  adamw::check_step_args(S, steps, segment_groups, group_hparams, dev);
  check_scalar_tensor(grad_scale, "grad_scale", dev);
  check_scalar_tensor(found_inf, "found_inf", dev);

  const at::Tensor groups_c = segment_groups.contiguous();
  const at::Tensor hp_c = group_hparams.contiguous();
  const int64_t* group_ptr = groups_c.data_ptr<int64_t>();
  const double* hp = hp_c.data_ptr<double>();
  const int64_t G = hp_c.size(0);

  // Validate everything first: nothing is written when any check fails.
  std::vector<PlanSegment> segs;
  segs.reserve(S);
  std::vector<const void*> grad_ptrs(S, nullptr);
  for (int64_t i = 0; i < S; ++i) {
    const at::Tensor& p = params.get(i);
    const at::Tensor& g = grads.get(i);
    const at::Tensor& m = exp_avgs.get(i);
    const at::Tensor& v = exp_avg_sqs.get(i);
    const int64_t gi = group_ptr[i];
    TORCH_CHECK(gi >= 0 && gi < G, "fused_adamw_: segment_groups[", i, "] = ", gi,
                " is out of range for ", G, " groups");
    const bool ams = hp[gi * kCols + 5] != 0.0;
    void* vmax_ptr = adamw::check_segment(i, p, g, m, v, max_exp_avg_sqs, gi, ams, dev);
    float* master_ptr = adamw::check_master(i, p, m, v, masters, dev);
    if (p.numel() == 0) continue;
    grad_ptrs[i] = g.const_data_ptr();
    segs.push_back(make_segment(i, gi, p, grad_ptrs[i], m, v, vmax_ptr, master_ptr));
  }
  if (segs.empty()) return;
  int64_t n_chunks = 0;
  const at::Tensor table = upload_table(segs, dev, /*sync=*/false, &n_chunks);
  run_step(table, static_cast<int64_t>(segs.size()), n_chunks, S, grad_ptrs.data(), group_ptr,
           steps, group_hparams, grad_scale, found_inf, dev);
}

const adamw::CudaPlanOps kPlanOps{&upload_table, &run_step};

struct RegisterPlanOps {
  RegisterPlanOps() { adamw::cuda_plan_ops() = &kPlanOps; }
} register_plan_ops;

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY_IMPL(zero_ext, CUDA, m) {
  m.impl("fused_adamw_", &zero_ext::fused_adamw_cuda);
}
