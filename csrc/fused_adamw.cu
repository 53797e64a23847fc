// CUDA kernel of zero_ext::fused_adamw_: one AdamW step over S segments of any number of
// param groups in ONE kernel launch.
//
// Host: validates every segment, then packs the metadata into one pinned buffer that is
// copied to the device once (per call): a group table, one record per non-empty segment
// (pointers, numel, flags and, when the steps are on the CPU, the segment's float scalars
// already computed in double, see docs/design.md, "AdamW arithmetic"), and one (segment,
// chunk) record per block.
// Device: each block handles one chunk of kChunk elements of one segment; thread 0 fetches
// (or, for device-resident steps, computes) the scalars into shared memory; the element loop
// uses 4-wide vector loads when the segment's pointers are aligned, fp32 math, and stores the
// state in its own dtype. grad_scale and found_inf are read on the device (no host sync).
// A bf16/fp16 segment with a float32 master is computed on the master (fp32 state); an
// element whose param no longer holds the master's rounding takes the param's value first.
// Launches are split only if the chunk count exceeds the grid limit.
#include <ATen/ATen.h>
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
constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kChunk = int64_t(kThreads) * kVec * 8;  // elements per block
constexpr int64_t kMaxBlocksPerLaunch = 2147483647;      // gridDim.x limit

using adamw::kF32;
using adamw::kBF16;
using adamw::kF16;
using adamw::kind_of;
enum Flag : int { kAms = 1 << 4, kAligned = 1 << 5, kMaster = 1 << 6 };

struct Scalars {  // float scalars of one segment (see make_scalars)
  float decay, lerp_w, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps, grad_mul;
  int lerp_lo;
  int pad_[3];
};

struct GroupMeta {  // one group's hyperparameters, for device-resident steps
  double lr, beta1, beta2, eps, wd, maximize;
};

struct SegMeta {
  void* p;
  const void* g;
  void* m;
  void* v;
  void* vmax;
  float* w;  // the float32 master, or null
  int64_t numel;
  Scalars sc;
  int32_t group;
  int32_t index;  // position in the op's lists (for steps on the device)
  int32_t flags;  // bits 0-1 param kind, 2-3 state kind, kAms, kAligned, kMaster
  int32_t pad_;
};

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
__device__ void run_chunk(const SegMeta& s, const Scalars& c, float grad_div, int64_t start,
                          int64_t end, bool aligned) {
  PT* __restrict__ p = static_cast<PT*>(s.p);
  const PT* __restrict__ g = static_cast<const PT*>(s.g);
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
__device__ __forceinline__ void run_ams(const SegMeta& s, const Scalars& c, float gd, int64_t a,
                                        int64_t b, bool al, bool ams) {
  if (ams) run_chunk<PT, ST, true, MW>(s, c, gd, a, b, al);
  else run_chunk<PT, ST, false, MW>(s, c, gd, a, b, al);
}

__global__ void __launch_bounds__(kThreads)
fused_adamw_kernel(const uint8_t* __restrict__ meta, int64_t group_off, int64_t seg_off,
                   int64_t chunk_off, int64_t chunk_base, const float* __restrict__ steps_dev,
                   const float* __restrict__ grad_scale, const float* __restrict__ found_inf,
                   float host_grad_div) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // skipped step: touch nothing
  const ChunkMeta ck =
      reinterpret_cast<const ChunkMeta*>(meta + chunk_off)[chunk_base + blockIdx.x];
  const SegMeta& s = reinterpret_cast<const SegMeta*>(meta + seg_off)[ck.seg];
  __shared__ Scalars sc;
  if (threadIdx.x == 0) {
    if (steps_dev != nullptr) {
      const GroupMeta& gm = reinterpret_cast<const GroupMeta*>(meta + group_off)[s.group];
      sc = make_scalars(gm.lr, gm.beta1, gm.beta2, gm.eps, gm.wd, gm.maximize != 0.0,
                        double(steps_dev[s.index]));
    } else {
      sc = s.sc;
    }
  }
  __syncthreads();
  const Scalars c = sc;
  const float grad_div = grad_scale != nullptr ? *grad_scale : host_grad_div;
  const int64_t start = int64_t(ck.chunk) * kChunk;
  const int64_t end = min(s.numel, start + kChunk);
  const int flags = s.flags;
  const int pk = flags & 3, sk = (flags >> 2) & 3;
  const bool ams = (flags & kAms) != 0, al = (flags & kAligned) != 0;
  const bool mw = (flags & kMaster) != 0;
  if (pk == kF32) {
    run_ams<float, float>(s, c, grad_div, start, end, al, ams);
  } else if (pk == kBF16) {
    if (mw) run_ams<__nv_bfloat16, float, true>(s, c, grad_div, start, end, al, ams);
    else if (sk == kF32) run_ams<__nv_bfloat16, float>(s, c, grad_div, start, end, al, ams);
    else run_ams<__nv_bfloat16, __nv_bfloat16>(s, c, grad_div, start, end, al, ams);
  } else {
    if (mw) run_ams<__half, float, true>(s, c, grad_div, start, end, al, ams);
    else if (sk == kF32) run_ams<__half, float>(s, c, grad_div, start, end, al, ams);
    else run_ams<__half, __half>(s, c, grad_div, start, end, al, ams);
  }
}

// ---- host side ---------------------------------------------------------------------------
inline bool aligned_to(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) == 0;
}

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
  TORCH_CHECK(steps.scalar_type() == at::kFloat && steps.dim() == 1 && steps.numel() == S,
              "fused_adamw_: steps must be a float32 tensor of shape [", S, "], got ",
              steps.scalar_type(), " ", steps.sizes());
  TORCH_CHECK(steps.device().is_cpu() || steps.device() == dev,
              "fused_adamw_ (CUDA): steps must be on the CPU or on ", dev, ", got ",
              steps.device());
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
  check_scalar_tensor(grad_scale, "grad_scale", dev);
  check_scalar_tensor(found_inf, "found_inf", dev);

  const at::Tensor groups_c = segment_groups.contiguous();
  const at::Tensor hp_c = group_hparams.contiguous();
  const int64_t* group_ptr = groups_c.data_ptr<int64_t>();
  const double* hp = hp_c.data_ptr<double>();
  const int64_t G = hp_c.size(0);
  const bool steps_on_device = steps.device().is_cuda();
  at::Tensor steps_cpu;
  if (!steps_on_device) steps_cpu = steps.contiguous();
  const float* host_steps = steps_on_device ? nullptr : steps_cpu.data_ptr<float>();

  // Validate everything first: nothing is written when any check fails.
  std::vector<SegMeta> segs;
  segs.reserve(S);
  Scalars last_sc{};
  int64_t last_group = -1;
  float last_step = 0.0f;
  int64_t n_chunks = 0;
  for (int64_t i = 0; i < S; ++i) {
    const at::Tensor& p = params.get(i);
    const at::Tensor& g = grads.get(i);
    const at::Tensor& m = exp_avgs.get(i);
    const at::Tensor& v = exp_avg_sqs.get(i);
    const int64_t gi = group_ptr[i];
    TORCH_CHECK(gi >= 0 && gi < G, "fused_adamw_: segment_groups[", i, "] = ", gi,
                " is out of range for ", G, " groups");
    const double* h = hp + gi * kCols;
    const bool ams = h[5] != 0.0;
    void* vmax_ptr = adamw::check_segment(i, p, g, m, v, max_exp_avg_sqs, gi, ams, dev);
    float* master_ptr = adamw::check_master(i, p, m, v, masters, dev);
    const int pk = kind_of(p.scalar_type());
    const int64_t n = p.numel();
    if (n == 0) continue;
    const int sk = kind_of(m.scalar_type());
    SegMeta s;
    std::memset(&s, 0, sizeof(s));
    s.p = p.data_ptr();
    s.g = g.const_data_ptr();
    s.m = m.data_ptr();
    s.v = v.data_ptr();
    s.vmax = vmax_ptr;
    s.w = master_ptr;
    s.numel = n;
    if (!steps_on_device) {  // segments of a group mostly share a step: compute it once
      const float step = host_steps[i];
      if (gi != last_group || !(step == last_step)) {
        last_sc = make_scalars(h[0], h[1], h[2], h[3], h[4], h[6] != 0.0, double(step));
        last_group = gi;
        last_step = step;
      }
      s.sc = last_sc;
    }
    s.group = static_cast<int32_t>(gi);
    s.index = static_cast<int32_t>(i);
    const int64_t pw = kVec * p.element_size(), sw = kVec * m.element_size();
    const bool al = aligned_to(s.p, pw) && aligned_to(s.g, pw) && aligned_to(s.m, sw) &&
                    aligned_to(s.v, sw) && (!ams || aligned_to(vmax_ptr, sw)) &&
                    (master_ptr == nullptr || aligned_to(master_ptr, kVec * 4));
    s.flags = pk | (sk << 2) | (ams ? kAms : 0) | (al ? kAligned : 0) |
              (master_ptr != nullptr ? kMaster : 0);
    const int64_t nc = (n + kChunk - 1) / kChunk;
    TORCH_CHECK(nc < (int64_t(1) << 31), "fused_adamw_: segment ", i, " is too large");
    n_chunks += nc;
    segs.push_back(s);
  }
  if (segs.empty()) return;

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

  // One pinned buffer: [groups | segments | chunks], copied to the device once.
  const int64_t group_off = 0;
  const int64_t seg_off = round_up(G * int64_t(sizeof(GroupMeta)), 16);
  const int64_t chunk_off = round_up(seg_off + int64_t(segs.size() * sizeof(SegMeta)), 16);
  const int64_t bytes = chunk_off + n_chunks * int64_t(sizeof(ChunkMeta));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* base = host.data_ptr<uint8_t>();
  GroupMeta* gm = reinterpret_cast<GroupMeta*>(base + group_off);
  for (int64_t gi = 0; gi < G; ++gi) {
    const double* h = hp + gi * kCols;
    gm[gi] = GroupMeta{h[0], h[1], h[2], h[3], h[4], h[6]};
  }
  std::memcpy(base + seg_off, segs.data(), segs.size() * sizeof(SegMeta));
  ChunkMeta* ck = reinterpret_cast<ChunkMeta*>(base + chunk_off);
  for (size_t k = 0; k < segs.size(); ++k) {
    const int32_t nc = static_cast<int32_t>((segs[k].numel + kChunk - 1) / kChunk);
    for (int32_t c = 0; c < nc; ++c) *ck++ = ChunkMeta{static_cast<int32_t>(k), c};
  }

  c10::cuda::CUDAGuard guard(dev);
  // The copy runs on the current stream and records the pinned block's use on it.
  at::Tensor meta = host.to(at::TensorOptions().device(dev), /*non_blocking=*/true);
  at::Tensor steps_dev_t;
  if (steps_on_device) steps_dev_t = steps.contiguous();
  const float* steps_dev = steps_on_device ? steps_dev_t.data_ptr<float>() : nullptr;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  for (int64_t done = 0; done < n_chunks;) {
    const int64_t blocks = std::min(n_chunks - done, kMaxBlocksPerLaunch);
    fused_adamw_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
        meta.data_ptr<uint8_t>(), group_off, seg_off, chunk_off, done, steps_dev,
        grad_scale_dev, found_inf_dev, host_grad_div);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    done += blocks;
  }
}

}  // namespace
}  // namespace zero_ext

TORCH_LIBRARY_IMPL(zero_ext, CUDA, m) {
  m.impl("fused_adamw_", &zero_ext::fused_adamw_cuda);
}
