// Partition planning (host logic, CPU only): who owns which parameter elements.
//
//   assign_params(numels, groups, world_size) -> rank of every param (whole-param sharding)
//   flat_offsets(numels, world_size, alignment) -> aligned layout of the flat buffer
//
// Both ops read small int64 CPU tensors and run on the host whatever device the params live
// on, so only a CPU kernel is registered: a CUDA kernel would not make sense here.
// zero_ext/kernels/partition.py holds the Python twin of every step below (the test oracle):
// any change here must be mirrored there, the tests compare exact assignments.
//
// Speed: at 1M params the cost is memory traffic and first-touch page faults, so the sorts
// walk (numel, index) records packed into one uint64 when they fit (always, in practice: 2^31
// params of up to 2^33 elements), radix sorts replace comparison sorts, and owners of the
// second candidate are int32.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>
#include <vector>

namespace zero_ext {
namespace {

// Upper bound on local-search steps (partition.py: MAX_LOCAL_SEARCH_ITERS). Every step
// strictly lowers the sum of squared rank loads, so the search ends anyway; the cap only
// bounds the time on adversarial inputs.
constexpr int64_t kMaxLocalSearchIters = 10000;

// (numel, index) of one param, packed into a uint64: numel in the high bits, index in the low.
struct PackedCodec {
  using Rec = uint64_t;
  int shift;
  Rec make(int64_t numel, int64_t index) const {
    return (static_cast<uint64_t>(numel) << shift) | static_cast<uint64_t>(index);
  }
  int64_t numel(Rec r) const { return static_cast<int64_t>(r >> shift); }
  int64_t index(Rec r) const { return static_cast<int64_t>(r & ((uint64_t{1} << shift) - 1)); }
};

// The same as a pair, for inputs whose numel and index bits do not fit in 64 together.
struct WideCodec {
  using Rec = std::pair<int64_t, int64_t>;
  Rec make(int64_t numel, int64_t index) const { return {numel, index}; }
  int64_t numel(const Rec& r) const { return r.first; }
  int64_t index(const Rec& r) const { return r.second; }
};

int bit_width(uint64_t x) {
  int b = 0;
  while (x != 0) {
    ++b;
    x >>= 1;
  }
  return b;
}

// recs (in index order) sorted by numel descending, ties by index ascending: a stable LSD
// radix sort on the numel digits only (11-bit digits, as many passes as max_numel needs).
template <class Codec>
void sort_by_numel_desc(const Codec& c, std::vector<typename Codec::Rec>& recs,
                        std::vector<typename Codec::Rec>& tmp, int64_t max_numel) {
  constexpr int kBits = 11;
  constexpr int64_t kBuckets = int64_t{1} << kBits;
  const int passes = (bit_width(static_cast<uint64_t>(max_numel)) + kBits - 1) / kBits;
  // Histograms of every digit in one read of the records.
  std::vector<int64_t> count(static_cast<size_t>(passes) * kBuckets, 0);
  for (const auto& r : recs) {
    const uint64_t v = static_cast<uint64_t>(c.numel(r));
    for (int p = 0; p < passes; ++p) ++count[p * kBuckets + ((v >> (p * kBits)) & (kBuckets - 1))];
  }
  for (int p = 0; p < passes; ++p) {
    int64_t* cnt = count.data() + p * kBuckets;
    // Descending digits: bucket kBuckets-1 first. Stable, so earlier passes' order holds.
    int64_t pos = 0;
    for (int64_t d = kBuckets - 1; d >= 0; --d) {
      const int64_t k = cnt[d];
      cnt[d] = pos;
      pos += k;
    }
    const int shift = p * kBits;
    for (const auto& r : recs) tmp[cnt[(c.numel(r) >> shift) & (kBuckets - 1)]++] = r;
    recs.swap(tmp);
  }
}

// torch's processing order: groups by ascending id; inside a group numel descending with a
// stable sort (ties by index). A stable counting sort by group of the global order gives it.
template <class Codec>
void sort_by_group(const Codec& c, const std::vector<typename Codec::Rec>& global,
                   const int64_t* group, int64_t n, std::vector<typename Codec::Rec>& out) {
  int64_t gmin = group[0], gmax = group[0];
  for (int64_t i = 1; i < n; ++i) {
    gmin = std::min(gmin, group[i]);
    gmax = std::max(gmax, group[i]);
  }
  auto counting_sort = [&](int64_t num_keys, auto key_of) {
    std::vector<int64_t> start(num_keys + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++start[key_of(i) + 1];
    for (int64_t k = 0; k < num_keys; ++k) start[k + 1] += start[k];
    for (const auto& r : global) out[start[key_of(c.index(r))]++] = r;
  };
  if (gmax - gmin <= 4 * n + 1024) {  // compact ids (the usual 0..G-1): no extra array
    counting_sort(gmax - gmin + 1, [&](int64_t i) { return group[i] - gmin; });
    return;
  }
  // Sparse ids: rank of each id among the distinct ids.
  std::vector<int64_t> ids(group, group + n);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  std::vector<int32_t> key(n);
  for (int64_t i = 0; i < n; ++i)
    key[i] = static_cast<int32_t>(std::lower_bound(ids.begin(), ids.end(), group[i]) -
                                  ids.begin());
  counting_sort(static_cast<int64_t>(ids.size()), [&](int64_t i) { return int64_t{key[i]}; });
}

// Min over (load, rank) of world_size ranks with O(log W) updates: a tournament tree whose
// nodes hold the winning (load, rank) pair itself (no indirection on the hot path).
class LeastLoaded {
 public:
  explicit LeastLoaded(int64_t world) : leaves_(1) {
    while (leaves_ < world) leaves_ *= 2;
    const int64_t none = std::numeric_limits<int64_t>::max();
    tree_.assign(2 * leaves_, {none, 0});
    for (int64_t r = 0; r < leaves_; ++r) tree_[leaves_ + r] = {r < world ? 0 : none, r};
    for (int64_t node = leaves_ - 1; node >= 1; --node) pull(node);
  }
  int64_t argmin() const { return tree_[1].second; }
  void add(int64_t rank, int64_t amount) {
    tree_[leaves_ + rank].first += amount;
    for (int64_t node = (leaves_ + rank) / 2; node >= 1; node /= 2) pull(node);
  }
  int64_t load(int64_t rank) const { return tree_[leaves_ + rank].first; }

 private:
  // Pairs compare by load, then rank: ties go to the lower rank.
  void pull(int64_t node) { tree_[node] = std::min(tree_[2 * node], tree_[2 * node + 1]); }
  int64_t leaves_;
  std::vector<std::pair<int64_t, int64_t>> tree_;
};

// Each param in `order` goes to the least-loaded rank, the lowest rank on ties.
template <class Codec, class Owner>
std::vector<int64_t> greedy(const Codec& c, const std::vector<typename Codec::Rec>& order,
                            int64_t world, Owner* owner) {
  LeastLoaded heap(world);
  for (const auto& r : order) {
    const int64_t rank = heap.argmin();
    owner[c.index(r)] = static_cast<Owner>(rank);
    heap.add(rank, c.numel(r));
  }
  std::vector<int64_t> loads(world);
  for (int64_t rank = 0; rank < world; ++rank) loads[rank] = heap.load(rank);
  return loads;
}

int64_t max_of(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// Items of one rank: (numel, index) pairs of its non-empty params in ascending order, so that
// the first entry of a run of equal numels holds the smallest index of that size.
using Item = std::pair<int64_t, int64_t>;
using Items = std::vector<Item>;
constexpr int64_t kLo = std::numeric_limits<int64_t>::min();
constexpr int64_t kHi = std::numeric_limits<int64_t>::max();

// First item with numel >= s (its index is the smallest of that numel), or end.
Items::const_iterator first_at_least(const Items& v, int64_t s) {
  return std::lower_bound(v.begin(), v.end(), Item{s, kLo});
}
// First item of the largest numel <= s, or end when there is none.
Items::const_iterator first_of_largest_at_most(const Items& v, int64_t s) {
  auto it = std::upper_bound(v.begin(), v.end(), Item{s, kHi});
  if (it == v.begin()) return v.end();
  return first_at_least(v, std::prev(it)->first);
}

void erase_item(Items& v, Item item) { v.erase(std::lower_bound(v.begin(), v.end(), item)); }
void insert_item(Items& v, Item item) {
  v.insert(std::lower_bound(v.begin(), v.end(), item), item);
}

// A candidate step between the heaviest rank h and rank r: move p (q < 0) or swap p <-> q.
// Ordered by resulting max(load_h', load_r'), then move before swap, then smaller indices.
struct Step {
  int64_t value = kHi;
  bool is_swap = false;
  int64_t p = -1, q = -1;
  int64_t p_numel = 0, q_numel = 0;
  bool better_than(const Step& o) const {
    if (value != o.value) return value < o.value;
    if (is_swap != o.is_swap) return !is_swap;
    if (p != o.p) return p < o.p;
    return q < o.q;
  }
};

Step best_step(const Items& vh, const Items& vr, int64_t lh, int64_t lr) {
  const int64_t gap = lh - lr;  // >= 2
  const int64_t half_lo = gap / 2, half_hi = gap - gap / 2;
  Step best;
  auto offer = [&](Step s) {
    if (s.better_than(best)) best = s;
  };
  // Moves: numel s in [1, gap - 1]; closest to gap/2 from each side.
  auto lo = first_of_largest_at_most(vh, half_lo);
  if (lo != vh.end()) offer(Step{lh - lo->first, false, lo->second, -1, lo->first, 0});
  auto hi = first_at_least(vh, half_hi);
  if (hi != vh.end() && hi->first < gap)
    offer(Step{lr + hi->first, false, hi->second, -1, hi->first, 0});
  if (best.value == lr + half_hi) return best;  // perfect split; a swap can only tie
  // Swaps: d = a - b in [1, gap - 1] for a on h, b on r; per distinct a the b closest on
  // each side of a - gap/2.
  for (auto it = vh.begin(); it != vh.end();) {
    const int64_t a = it->first, p = it->second;
    if (a >= 2) {
      auto b1 = first_at_least(vr, std::max<int64_t>(1, a - half_lo));
      if (b1 != vr.end() && b1->first <= a - 1) {
        const int64_t d = a - b1->first;
        offer(Step{lh - d, true, p, b1->second, a, b1->first});
      }
      auto b2 = first_of_largest_at_most(vr, a - half_hi);
      if (b2 != vr.end() && b2->first >= std::max<int64_t>(1, a - gap + 1)) {
        const int64_t d = a - b2->first;
        offer(Step{lr + d, true, p, b2->second, a, b2->first});
      }
    }
    it = std::upper_bound(it, vh.end(), Item{a, kHi});  // next distinct numel
  }
  return best;
}

// Improves `owner` in place (see partition.py for the rules); `desc` is the numel-descending
// order of all params.
template <class Codec>
void local_search(const Codec& c, const std::vector<typename Codec::Rec>& desc, int64_t world,
                  int64_t bound, int64_t* owner, std::vector<int64_t>& loads) {
  const int64_t n = static_cast<int64_t>(desc.size());
  // Per-rank ascending (numel, index) lists of the non-empty params, built in O(n) from the
  // descending order: walk its runs of equal numel backwards, each run forwards.
  std::vector<Items> items(world);
  std::vector<int64_t> per_rank(world, 0);
  for (const auto& r : desc)
    if (c.numel(r) > 0) ++per_rank[owner[c.index(r)]];
  for (int64_t r = 0; r < world; ++r) items[r].reserve(per_rank[r]);
  for (int64_t end = n; end > 0;) {
    int64_t begin = end - 1;
    const int64_t s = c.numel(desc[begin]);
    while (begin > 0 && c.numel(desc[begin - 1]) == s) --begin;
    if (s > 0)
      for (int64_t k = begin; k < end; ++k) {
        const int64_t idx = c.index(desc[k]);
        items[owner[idx]].push_back({s, idx});
      }
    end = begin;
  }

  // Every rank as (load, rank), ascending, kept ordered as loads change (two per step):
  // the heaviest rank and the visiting order of the others in O(log world) per step, not a
  // sort of every rank per step (which made the search O(steps * world log world)).
  std::set<std::pair<int64_t, int64_t>> by_load;
  for (int64_t r = 0; r < world; ++r) by_load.insert({loads[r], r});
  for (int64_t iter = 0; iter < kMaxLocalSearchIters; ++iter) {
    // The heaviest: the lowest rank of the largest load.
    const int64_t h = by_load.lower_bound({by_load.rbegin()->first, kLo})->second;
    if (loads[h] <= bound) return;
    bool applied = false;
    for (const auto& entry : by_load) {  // the other ranks by ascending (load, rank)
      const int64_t r = entry.second;
      if (r == h) continue;
      if (loads[h] - loads[r] < 2) break;  // ascending loads: no later rank can help
      const Step s = best_step(items[h], items[r], loads[h], loads[r]);
      if (s.p < 0) continue;
      erase_item(items[h], {s.p_numel, s.p});
      insert_item(items[r], {s.p_numel, s.p});
      owner[s.p] = r;
      int64_t delta = s.p_numel;
      if (s.is_swap) {
        erase_item(items[r], {s.q_numel, s.q});
        insert_item(items[h], {s.q_numel, s.q});
        owner[s.q] = h;
        delta -= s.q_numel;
      }
      by_load.erase({loads[h], h});
      by_load.erase({loads[r], r});
      loads[h] -= delta;
      loads[r] += delta;
      by_load.insert({loads[h], h});
      by_load.insert({loads[r], r});
      applied = true;
      break;  // `entry` is not used again: the set may have changed under it
    }
    if (!applied) return;
  }
}

template <class Codec>
void plan(const Codec& c, const int64_t* numel, const int64_t* group, int64_t n, int64_t world,
          int64_t* owner) {
  using Rec = typename Codec::Rec;
  int64_t total = 0, max_numel = 0;
  std::vector<Rec> desc(n), buf(n);
  for (int64_t i = 0; i < n; ++i) {
    desc[i] = c.make(numel[i], i);
    total += numel[i];
    max_numel = std::max(max_numel, numel[i]);
  }
  sort_by_numel_desc(c, desc, buf, max_numel);
  // No plan can have a max load below this: stop improving once it is reached.
  const int64_t bound = std::max((total + world - 1) / world, max_numel);

  // Candidate A: torch's per-group rule, written straight into `owner`.
  const bool one_group = std::all_of(group, group + n, [&](int64_t g) { return g == group[0]; });
  if (!one_group) sort_by_group(c, desc, group, n, buf);
  std::vector<int64_t> loads = greedy(c, one_group ? desc : buf, world, owner);
  // Candidate B: LPT over all params. It coincides with A for one group, and it cannot beat
  // an A that already meets the bound (A wins ties).
  if (!one_group && max_of(loads) > bound) {
    std::vector<int32_t> owner_b(n);
    std::vector<int64_t> loads_b = greedy(c, desc, world, owner_b.data());
    if (max_of(loads_b) < max_of(loads)) {
      std::copy(owner_b.begin(), owner_b.end(), owner);
      loads.swap(loads_b);
    }
  }
  if (max_of(loads) <= bound) return;
  buf = std::vector<Rec>();  // release before the local search allocates its lists
  local_search(c, desc, world, bound, owner, loads);
}

void check_int64_1d_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), "-D");
}

void check_numels(const at::Tensor& numels, const char* op) {
  const int64_t* p = numels.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < numels.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0, op, ": numels[", i, "] = ", p[i], " is negative");
    TORCH_CHECK(p[i] <= std::numeric_limits<int64_t>::max() - total, op,
                ": the sum of numels overflows int64");
    total += p[i];
  }
}

at::Tensor assign_params_cpu(const at::Tensor& numels_in, const at::Tensor& groups_in,
                             int64_t world_size) {
  check_int64_1d_cpu(numels_in, "assign_params", "numels");
  check_int64_1d_cpu(groups_in, "assign_params", "groups");
  TORCH_CHECK(numels_in.numel() == groups_in.numel(),
              "assign_params: numels and groups must have the same length, got ",
              numels_in.numel(), " and ", groups_in.numel());
  TORCH_CHECK(world_size >= 1 && world_size <= std::numeric_limits<int32_t>::max(),
              "assign_params: world_size must be in [1, 2^31), got ", world_size);
  const at::Tensor numels = numels_in.contiguous();
  const at::Tensor groups = groups_in.contiguous();
  check_numels(numels, "assign_params");
  const int64_t n = numels.numel();
  const int64_t* numel = numels.data_ptr<int64_t>();
  const int64_t* group = groups.data_ptr<int64_t>();

  at::Tensor out = at::empty({n}, numels.options());
  if (n == 0 || world_size == 1) return out.zero_();
  int64_t max_numel = 0;
  for (int64_t i = 0; i < n; ++i) max_numel = std::max(max_numel, numel[i]);
  const int index_bits = std::max(1, bit_width(static_cast<uint64_t>(n - 1)));
  if (index_bits + bit_width(static_cast<uint64_t>(max_numel)) <= 64) {
    plan(PackedCodec{index_bits}, numel, group, n, world_size, out.data_ptr<int64_t>());
  } else {
    plan(WideCodec{}, numel, group, n, world_size, out.data_ptr<int64_t>());
  }
  return out;
}

at::Tensor flat_offsets_cpu(const at::Tensor& numels_in, int64_t world_size, int64_t alignment) {
  check_int64_1d_cpu(numels_in, "flat_offsets", "numels");
  TORCH_CHECK(world_size >= 1, "flat_offsets: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(alignment >= 1, "flat_offsets: alignment must be >= 1, got ", alignment);
  const at::Tensor numels = numels_in.contiguous();
  check_numels(numels, "flat_offsets");
  const int64_t n = numels.numel();
  const int64_t* numel = numels.data_ptr<int64_t>();
  at::Tensor out = at::empty({n + 1}, numels.options());
  int64_t* off = out.data_ptr<int64_t>();
  int64_t cursor = 0, end = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = (cursor + alignment - 1) / alignment * alignment;
    off[i] = start;
    end = start + numel[i];
    cursor = end;
  }
  const int64_t unit = world_size * alignment;  // each rank's shard: a multiple of alignment
  off[n] = (end + unit - 1) / unit * unit;      // 0 when there is no element at all
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("assign_params", &assign_params_cpu);
  m.impl("flat_offsets", &flat_offsets_cpu);
}

}  // namespace zero_ext
