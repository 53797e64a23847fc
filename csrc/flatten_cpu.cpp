// CPU kernels of flatten_into / unflatten_from: many tensors <-> one flat buffer.
//
// The contiguous tensors are copied by ONE at::parallel_for over the concatenation of all of
// them (in elements): each thread gets one equal, contiguous slice of that stream and memcpys
// the pieces of the tensors it covers. So 1000 small tensors cost one parallel region, and
// one huge tensor next to tiny ones still splits evenly. Non-contiguous tensors go through
// copy_ of a view (TensorIterator, itself parallel) outside that loop. A tensor that already
// is the view of flat at its offset (params turned into bucket views) is skipped.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "flatten_common.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace zero_ext {
namespace {

// Each thread gets at least this many bytes; below it the copy runs on the calling thread.
// One thread copies 4 MB in well under a millisecond, about what a parallel region's join
// costs when the cores are shared (several ranks or jobs on one machine): on the 2-core CI
// machines under load, 2-thread regions for 2-8 MB of small tensors ran up to 10x slower
// than one thread, while at tens of MB the second thread pays off.
constexpr int64_t kGrainBytes = int64_t{4} << 20;

void copy_many(const char* op, at::TensorList tensors, const at::Tensor& flat,
               at::IntArrayRef offsets, bool to_flat) {
  check_flatten_args(op, tensors, flat, offsets);
  const int64_t itemsize = flat.element_size();
  char* base = static_cast<char*>(flat.data_ptr());

  // The contiguous tensors of the stream: their pointers and element prefix sums.
  std::vector<char*> tensor_ptr, slot_ptr;
  std::vector<int64_t> prefix{0};
  std::vector<size_t> strided;
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
    tensor_ptr.push_back(data);
    slot_ptr.push_back(slot);
    prefix.push_back(prefix.back() + n);
  }

  const int64_t total = prefix.back();
  if (total > 0) {
    const int64_t grain = std::max<int64_t>(1, kGrainBytes / itemsize);
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      // The tensor holding element `begin` of the stream, then the following ones.
      size_t j = std::upper_bound(prefix.begin(), prefix.end(), begin) - prefix.begin() - 1;
      for (int64_t pos = begin; pos < end; ++j) {
        const int64_t lo = pos - prefix[j];
        const int64_t hi = std::min(end, prefix[j + 1]) - prefix[j];
        char* src = (to_flat ? tensor_ptr[j] : slot_ptr[j]) + lo * itemsize;
        char* dst = (to_flat ? slot_ptr[j] : tensor_ptr[j]) + lo * itemsize;
        std::memcpy(dst, src, static_cast<size_t>((hi - lo) * itemsize));
        pos = prefix[j] + hi;
      }
    });
  }

  copy_strided(tensors, flat, offsets, strided, to_flat);
}

void flatten_into_cpu(at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets) {
  copy_many("flatten_into", tensors, flat, offsets, /*to_flat=*/true);
}

void unflatten_from_cpu(const at::Tensor& flat, at::TensorList tensors,
                        at::IntArrayRef offsets) {
  copy_many("unflatten_from", tensors, flat, offsets, /*to_flat=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_from", &unflatten_from_cpu);
}

}  // namespace zero_ext
