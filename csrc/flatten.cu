// CUDA kernels of flatten_into / unflatten_from: many tensors <-> one flat buffer.
//
// Host: validate; a contiguous tensor of at least memcpy_bytes() (8 MiB by default) is one
// cudaMemcpyAsync (device to device, on the current stream: what copy_ does for it, at the
// copy's full bandwidth, with no table to send); the smaller ones are packed as (src, dst,
// bytes, first block) into one int64 table, copied to the device once (pinned, async, on the
// current stream), and copied by ONE kernel launch for all of them. Block b copies bytes
// [k * kBlockBytes, (k+1) * kBlockBytes) of the tensor whose block range holds b (binary
// search in the table). The table lives in global memory, so it never overflows: a launch is
// split only if the grid would exceed CUDA's 2^31 - 1 blocks. Non-contiguous tensors go
// through copy_ of a view; a tensor that already is the view of flat at its offset is skipped.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flatten_common.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace zero_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;                                  // 16-byte loads in flight per thread
constexpr int64_t kBlockBytes = int64_t{kThreads} * 16 * kUnroll;  // 16 KiB per block
constexpr int kMetaFields = 4;                              // src, dst, bytes, first block
constexpr int64_t kMaxGrid = 2147483647;

// Tensors of at least this many bytes are copied by cudaMemcpyAsync: from there on the
// launch of one more copy costs less than the multi-tensor kernel loses to a plain copy.
// ZERO_EXT_FLATTEN_MEMCPY_BYTES overrides it (a tuning knob, read at each call: 0 sends every
// contiguous tensor to cudaMemcpyAsync; a huge value none).
constexpr int64_t kMemcpyBytes = int64_t{8} << 20;

int64_t memcpy_bytes() {
  const char* env = std::getenv("ZERO_EXT_FLATTEN_MEMCPY_BYTES");
  if (env == nullptr || *env == '\0') return kMemcpyBytes;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  return (end != env && v >= 0) ? static_cast<int64_t>(v) : kMemcpyBytes;
}

// Copy `bytes` bytes with loads of type V (src, dst and the range start are V-aligned).
template <typename V>
__device__ __forceinline__ void copy_range(const char* __restrict__ src, char* __restrict__ dst,
                                           int64_t bytes) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t base = 0; base < n; base += int64_t{kThreads} * kUnroll) {
    V reg[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = base + u * kThreads + threadIdx.x;
      if (k < n) reg[u] = s[k];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = base + u * kThreads + threadIdx.x;
      if (k < n) d[k] = reg[u];
    }
  }
  for (int64_t k = n * sizeof(V) + threadIdx.x; k < bytes; k += kThreads) dst[k] = src[k];
}

__global__ void multi_copy_kernel(const int64_t* __restrict__ meta, int64_t num_tensors,
                                  int64_t block_base) {
  const int64_t block = block_base + blockIdx.x;
  // Last tensor whose first block is <= block (first blocks ascend; every tensor has >= 1).
  int64_t lo = 0, hi = num_tensors - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (meta[mid * kMetaFields + 3] <= block) lo = mid; else hi = mid - 1;
  }
  const int64_t* m = meta + lo * kMetaFields;
  const char* src = reinterpret_cast<const char*>(m[0]);
  char* dst = reinterpret_cast<char*>(m[1]);
  const int64_t begin = (block - m[3]) * kBlockBytes;
  const int64_t left = m[2] - begin;
  const int64_t bytes = left < kBlockBytes ? left : kBlockBytes;
  src += begin;
  dst += begin;
  const auto align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if ((align & 15) == 0) {
    copy_range<uint4>(src, dst, bytes);
  } else if ((align & 7) == 0) {
    copy_range<uint2>(src, dst, bytes);
  } else if ((align & 3) == 0) {
    copy_range<unsigned int>(src, dst, bytes);
  } else if ((align & 1) == 0) {
    copy_range<unsigned short>(src, dst, bytes);
  } else {
    copy_range<unsigned char>(src, dst, bytes);
  }
}

void copy_many(const char* op, at::TensorList tensors, const at::Tensor& flat,
               at::IntArrayRef offsets, bool to_flat) {
  check_flatten_args(op, tensors, flat, offsets);
  const c10::cuda::CUDAGuard guard(flat.device());
  const int64_t itemsize = flat.element_size();
  char* base = static_cast<char*>(flat.data_ptr());

  std::vector<int64_t> meta;
  meta.reserve(tensors.size() * kMetaFields);
  std::vector<size_t> strided;
  std::vector<int64_t> large;  // (src, dst, bytes) of the cudaMemcpyAsync copies
  const int64_t memcpy_from = memcpy_bytes();
  int64_t blocks = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t n = t.numel();
    if (n == 0) continue;
    char* slot = base + offsets[i] * itemsize;
    if (!t.is_contiguous()) {
      strided.push_back(i);
      continue;
    }
    char* data = static_cast<char*>(t.data_ptr());
    if (data == slot) continue;  // already the view of its slot
    const int64_t bytes = n * itemsize;
    if (bytes >= memcpy_from) {
      large.insert(large.end(), {reinterpret_cast<int64_t>(to_flat ? data : slot),
                                 reinterpret_cast<int64_t>(to_flat ? slot : data), bytes});
      continue;
    }
    meta.push_back(reinterpret_cast<int64_t>(to_flat ? data : slot));
    meta.push_back(reinterpret_cast<int64_t>(to_flat ? slot : data));
    meta.push_back(bytes);
    meta.push_back(blocks);
    blocks += (bytes + kBlockBytes - 1) / kBlockBytes;
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flat.device().index());
  for (size_t k = 0; k < large.size(); k += 3) {
    C10_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(large[k + 1]),
                                   reinterpret_cast<const void*>(large[k]),
                                   static_cast<size_t>(large[k + 2]), cudaMemcpyDeviceToDevice,
                                   stream));
  }

  if (blocks > 0) {
    const int64_t count = static_cast<int64_t>(meta.size()) / kMetaFields;
    at::Tensor host = at::empty({static_cast<int64_t>(meta.size())},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::copy(meta.begin(), meta.end(), host.data_ptr<int64_t>());
    // Pinned + non_blocking: the host block is recycled only after this copy completes.
    at::Tensor dev = host.to(flat.device(), /*non_blocking=*/true);
    for (int64_t first = 0; first < blocks; first += kMaxGrid) {
      const auto grid = static_cast<unsigned int>(std::min(blocks - first, kMaxGrid));
      multi_copy_kernel<<<grid, kThreads, 0, stream>>>(dev.data_ptr<int64_t>(), count, first);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  copy_strided(tensors, flat, offsets, strided, to_flat);
}

void flatten_into_cuda(at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets) {
  copy_many("flatten_into", tensors, flat, offsets, /*to_flat=*/true);
}

void unflatten_from_cuda(const at::Tensor& flat, at::TensorList tensors,
                         at::IntArrayRef offsets) {
  copy_many("unflatten_from", tensors, flat, offsets, /*to_flat=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(zero_ext, CUDA, m) {
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_from", &unflatten_from_cuda);
}

}  // namespace zero_ext
