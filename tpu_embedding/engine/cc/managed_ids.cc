// One training step of a managed-id map (docs/managed-ids.md) in one kernel: count the batch's
// keys, age and count the rows they hold, free expired rows (TTL), admit new keys (min_count,
// through the candidates table), pick their rows from an eviction index kept between steps, and
// update the map's variables in place. TF's own ops take ~25 ops a step for this, each paying
// the executor and streaming its operands; here each key is hashed once and each touched row
// read and written once, so a step costs O(batch log pool).
//
// The index is a cache derived from the map's variables (`keys`, `last_seen`, `counts`, `step`),
// which alone hold the map (checkpoints save the key -> row pairs from them). It holds:
// - the key -> row table: open addressing over row numbers (8 bytes a slot: the row and 32 bits
//   of its key's hash; the key itself is read from `keys`), linear probing, deletion by moving
//   later entries back (no tombstones), at most 70 % full. TF's `MutableHashTable` (a node per
//   key) took ~40 bytes a key and most of a step's time; this takes ~12-23 bytes a row.
// - free rows: a cursor over rows in ascending order plus a min-heap of rows freed below it;
// - a pool: every used row whose eviction key is <= a threshold `T`: the entries of its last
//   rebuild in ascending order (taken from the front: one step's victims are read in a row)
//   and a min-heap of the entries pushed since, lazily deleted (an entry whose row's key has
//   changed since it was pushed is dropped when taken).
//   Within one LFU epoch a row's key changes only when its row is seen or given to a new key;
//   those rows are pushed again (if <= T) at the step that changes them, so the invariant holds
//   without reading the other rows. When the pool runs dry, grows too stale, the LFU epoch
//   changes (every key halves: the order between unseen rows may change), or the index cannot
//   vouch for the variables, one scan rebuilds it (at most `pool` entries kept).
// TTL's expired rows (last seen at or before `step - ttl_steps`) are a prefix of the pool's
// (last_seen, row) order, so they are popped from it rather than found by a scan.
// The index vouches for the variables only if every write of the step counter since its last
// step was its own: it holds the counter's buffer, so any other write (a checkpoint restore, an
// assign) gives the variable a new buffer and forces a rebuild of the table and the pool.
// The rows given are exactly those of the full ordering (the TF ops' sort): eviction keys end in
// the row index, so no two are equal. No result depends on the table's layout.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tpu_embedding/engine/cc/kernels.h"  // first: it sets up Eigen's thread pool
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

#include "tensorflow/core/framework/lookup_interface.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tpu_embedding {
namespace {

using ::tensorflow::DataTypeToEnum;
using ::tensorflow::DT_INT32;
using ::tensorflow::DT_INT64;
using ::tensorflow::HandleFromInput;
using ::tensorflow::LookupOrCreateResource;
using ::tensorflow::LookupResource;
using ::tensorflow::ResourceBase;
using ::tensorflow::ResourceHandleOp;
using ::tensorflow::Var;
using ::tensorflow::lookup::LookupInterface;
using ::tensorflow::shape_inference::InferenceContext;

// One used row and what orders it as a victim; `aged` is 0 for LRU and TTL. 12 bytes: counts and
// steps are int32 in the variables, rows below 2**32.
struct Victim {
  int32_t aged;
  int32_t last_seen;
  uint32_t row;
  bool operator<(const Victim& other) const {
    if (aged != other.aged) return aged < other.aged;
    if (last_seen != other.last_seen) return last_seen < other.last_seen;
    return row < other.row;
  }
  bool operator>(const Victim& other) const { return other < *this; }
};

// Keys and rows ahead whose memory a loop prefetches: a miss costs ~150 ns here and most
// loops below spend a few ns an entry, so kernels.h's distance (12) leaves them waiting.
constexpr int64_t kLookAhead = 32;
constexpr int64_t kMaxShift = 62;  // as the TF ops: a longer absence ages any count to 0

// The LFU epoch of a used row's last_seen (0 <= last_seen < 2**31) for a half life clamped by
// `Divisor`: a 32-bit division, several times faster than a 64-bit one, in the loops over the
// rows of a step and over every row of a rebuild.
inline int64_t EpochOf(int32_t last_seen, uint32_t divisor) {
  return static_cast<uint32_t>(last_seen) / divisor;
}
inline uint32_t Divisor(int64_t half_life) {
  return static_cast<uint32_t>(std::min<int64_t>(half_life, std::numeric_limits<uint32_t>::max()));
}

// Bits needed to write `x` (0 for 0).
int BitWidth(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// Sorts a rebuild's entries ascending. Their fields span small ranges (counts aged to one epoch,
// the steps since the last rebuilds, the rows), so as a rule they pack into 64 bits that order
// alike and sort by radix (11-bit digits, digits all entries share skipped): a comparison sort
// of 250 000 entries took ~8 ms of a ~20 ms rebuild. Otherwise (or with a negative count,
// which only a write from outside can leave), a comparison sort.
void SortVictims(std::vector<Victim>& entries) {
  const size_t n = entries.size();
  if (n < 4096) {
    std::sort(entries.begin(), entries.end());
    return;
  }
  int32_t least_aged = 0, most_aged = 0;
  int32_t first_seen = std::numeric_limits<int32_t>::max(), last_seen = 0;
  uint32_t most_row = 0;
  for (const Victim& v : entries) {
    least_aged = std::min(least_aged, v.aged);
    most_aged = std::max(most_aged, v.aged);
    first_seen = std::min(first_seen, v.last_seen);
    last_seen = std::max(last_seen, v.last_seen);
    most_row = std::max(most_row, v.row);
  }
  const int row_bits = BitWidth(most_row);
  const int seen_bits = BitWidth(static_cast<uint32_t>(last_seen - first_seen));
  const int bits = BitWidth(static_cast<uint32_t>(most_aged)) + seen_bits + row_bits;
  if (bits > 64 || least_aged < 0) {
    std::sort(entries.begin(), entries.end());
    return;
  }
  std::vector<uint64_t> keys(n), sorted(n);
  for (size_t i = 0; i < n; ++i) {
    const Victim& v = entries[i];
    const uint64_t seen = static_cast<uint32_t>(v.last_seen - first_seen);
    keys[i] = (static_cast<uint64_t>(v.aged) << (seen_bits + row_bits)) | (seen << row_bits) |
              v.row;
  }
  constexpr int kDigitBits = 11;
  constexpr size_t kDigits = size_t{1} << kDigitBits;
  std::vector<size_t> at(kDigits);
  for (int shift = 0; shift < bits; shift += kDigitBits) {
    std::fill(at.begin(), at.end(), 0);
    for (const uint64_t k : keys) ++at[(k >> shift) & (kDigits - 1)];
    if (at[(keys[0] >> shift) & (kDigits - 1)] == n) continue;  // one digit: order unchanged
    size_t sum = 0;
    for (size_t& count : at) sum += std::exchange(count, sum);
    for (const uint64_t k : keys) sorted[at[(k >> shift) & (kDigits - 1)]++] = k;
    keys.swap(sorted);
  }
  const uint64_t row_mask = (uint64_t{1} << row_bits) - 1;
  const uint64_t seen_mask = (uint64_t{1} << seen_bits) - 1;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t k = keys[i];
    entries[i] = Victim{static_cast<int32_t>(k >> (seen_bits + row_bits)),
                        static_cast<int32_t>(((k >> row_bits) & seen_mask) + first_seen),
                        static_cast<uint32_t>(k & row_mask)};
  }
}

constexpr int64_t kMinPool = 1024;
constexpr int64_t kMaxPool = 1 << 18;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// Rows are stored as uint32 in the key -> row table.
constexpr int64_t kMaxCapacity = std::numeric_limits<uint32_t>::max();

// A slot of the key -> row table: a row (0: empty; row 0 never holds a key) and 32 bits of its
// key's hash, whose low bits are also the slot where the key's probe starts.
struct Slot {
  uint32_t row;
  uint32_t hash;
};

uint32_t Fold(uint64_t h) { return static_cast<uint32_t>(h ^ (h >> 32)); }

// A strong mix of the 64 bits (MurmurHash3's finalizer): raw ids are often multiples of a
// power of two or consecutive, which would crowd a table indexed by their low bits.
uint32_t HashOf(int64_t key) {
  uint64_t x = static_cast<uint64_t>(key);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return Fold(x);
}

class ManagedIndex : public ResourceBase {
 public:
  std::string DebugString() const override { return "TpuEmbeddingManagedIndex"; }

  ::tensorflow::mutex mu;
  bool valid = false;           // false: rebuild from the variables before use
  // The buffers of the map's keys, counts, last_seen and step as this index last saw them:
  // holding them makes any other writer give a variable a new buffer (TF's assign and scatter
  // ops copy a buffer another tensor shares), which the next step sees.
  ::tensorflow::Tensor held[4];
  int64_t capacity = 0;
  int64_t epoch = 0;            // LFU epoch the pool's keys were computed at
  int64_t cursor = 1;           // rows >= cursor: free iff last_seen < 0
  std::vector<int64_t> freed;   // min-heap of free rows below the cursor
  std::vector<Victim> sorted;   // the pool's entries from its last rebuild, ascending...
  size_t next = 0;              // ...from this one on
  std::vector<Victim> pushed;   // min-heap of the pool's entries pushed since
  Victim threshold{0, 0, 0};    // every used row with key <= threshold is in the pool
  bool everything = false;      // the pool held every used row when built (no threshold)
  std::vector<Slot> slots;      // the key -> row table (RowTable)
  int64_t table_rows = 0;       // the capacity `slots` was built for; 0: rebuild it
};

// The key -> row table over an index's slots; keys are read from the map's `keys` variable.
class RowTable {
 public:
  RowTable(std::vector<Slot>& slots, const int64_t* keys)
      : slots_(slots), keys_(keys), mask_(slots.size() - 1) {}

  // Slots for a map of `capacity` rows: a power of two, at most 70 % of it used.
  static size_t SlotsFor(int64_t capacity) {
    size_t n = 8;
    while (n * 7 < static_cast<size_t>(capacity) * 10) n <<= 1;
    return n;
  }

  void Prefetch(uint32_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }

  // The row of `key`, whose hash is `hash`; 0 if it holds none. Every loop below visits each
  // slot at most once: a table made inconsistent by a bug cannot make it spin.
  uint32_t Find(int64_t key, uint32_t hash) const {
    size_t i = hash & mask_;
    for (size_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
      const Slot slot = slots_[i];
      if (slot.row == 0) return 0;
      if (slot.hash == hash && keys_[slot.row] == key) return slot.row;
    }
    return 0;
  }

  // The rows of `n` keys (0: none) without waiting on memory: a first pass walks each key's
  // probe run to its first slot with an equal hash (slots prefetched ahead), a second reads that
  // slot's key to confirm it (keys prefetched ahead). Looked up one at a time, each key held
  // waits for its slot, then for its key in `keys` (a second miss, ~150 ns at 10^6 rows). A
  // slot whose hash matches another key (32 bits of hash: rare) sends its key to `Find`.
  void FindAll(const int64_t* ids, const uint32_t* hashes, int64_t n, int64_t* rows) const {
    for (int64_t i = 0; i < n; ++i) {
      if (i + kLookAhead < n) Prefetch(hashes[i + kLookAhead]);
      rows[i] = FirstMatch(hashes[i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i + kLookAhead < n && rows[i + kLookAhead] != 0) {
        __builtin_prefetch(&keys_[rows[i + kLookAhead]]);
      }
      if (rows[i] != 0 && !(keys_[rows[i]] == ids[i])) rows[i] = Find(ids[i], hashes[i]);
    }
  }

  // Adds `row` for a key (hash `hash`) the table does not hold; false if no slot is free.
  bool Insert(uint32_t hash, uint32_t row) {
    size_t i = hash & mask_;
    for (size_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
      if (slots_[i].row == 0) {
        slots_[i] = Slot{row, hash};
        return true;
      }
    }
    return false;
  }

  // The row in the first slot of `hash`'s probe run holding that hash (0: none before a hole).
  uint32_t FirstMatch(uint32_t hash) const {
    size_t i = hash & mask_;
    for (size_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
      const Slot slot = slots_[i];
      if (slot.row == 0 || slot.hash == hash) return slot.row;
    }
    return 0;
  }

  // Removes `row`, held for a key whose hash is `hash`: each later entry of its run whose probe
  // starts at or before the hole moves back into it, so that no probe meets a hole before its
  // key. False if the table does not hold the row.
  bool Erase(uint32_t hash, uint32_t row) {
    size_t hole = hash & mask_, probes = 0;
    for (; slots_[hole].row != row; hole = (hole + 1) & mask_) {
      if (slots_[hole].row == 0 || ++probes > mask_) return false;
    }
    // A run ends at an empty slot: the table is at most 70 % full, so there is one.
    for (size_t j = (hole + 1) & mask_; slots_[j].row != 0; j = (j + 1) & mask_) {
      const size_t start = slots_[j].hash & mask_;
      if (((j - start) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{0, 0};
    return true;
  }

 private:
  std::vector<Slot>& slots_;
  const int64_t* keys_;
  const size_t mask_;
};

// Rebuilds the index's key -> row table from the variables (every used row's key), and marks
// its eviction pool for a rebuild at the next step. Refuses variables giving a key two rows.
absl::Status Reindex(ManagedIndex& index, const int64_t* keys, const int32_t* last_seen,
                     int64_t capacity) {
  index.valid = false;
  index.table_rows = 0;
  if (capacity > kMaxCapacity) {
    return InvalidArgument("a managed-id map holds at most ", kMaxCapacity, " rows, got ",
                           capacity);
  }
  index.slots.assign(RowTable::SlotsFor(capacity), Slot{0, 0});
  RowTable table(index.slots, keys);
  for (int64_t row = 1; row < capacity; ++row) {
    if (last_seen[row] < 0) continue;
    const uint32_t hash = HashOf(keys[row]);
    const uint32_t other = table.Find(keys[row], hash);
    if (other != 0) {
      index.slots.clear();
      return InvalidArgument("the map's variables give one key two rows: ", other, " and ", row,
                             " (its keys variable was assigned a duplicate)");
    }
    if (!table.Insert(hash, static_cast<uint32_t>(row))) {
      index.slots.clear();
      return ::tensorflow::errors::Internal("the map's key -> row table is full");
    }
  }
  index.table_rows = capacity;
  return absl::OkStatus();
}



REGISTER_OP("TpuEmbeddingManagedIndex")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .Output("index: resource")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("The eviction index of one managed-id map (a cache of its variables).");

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingManagedIndex").Device(DEVICE_CPU),
                        ResourceHandleOp<ManagedIndex>);

absl::Status NewIndex(ManagedIndex** index) {
  *index = new ManagedIndex;
  return absl::OkStatus();
}

using Rows = absl::Span<const int64_t>;

// One step's view of the variables, and the index's maintenance from it.
// Whether a step's k-th victim, whose score is `score`, is taken.
using Accept = std::function<bool(int64_t k, double score)>;

// distance_lfu's score: count / distance ** (decay_halves / 2), the power as products and one
// square root (exactly rounded, as the TF ops and the reference compute it; `pow` is not).
double DistanceScore(int32_t count, int64_t distance, int decay_halves) {
  const double d = static_cast<double>(distance);
  double power = 1.0;
  for (int i = 0; i < decay_halves / 2; ++i) power *= d;
  if (decay_halves % 2) power *= std::sqrt(d);
  return static_cast<double>(count) / power;
}

class Step {
 public:
  Step(ManagedIndex& x, const int32_t* last_seen, const int32_t* counts, int64_t capacity,
       int64_t step, int64_t half_life, bool by_count, int64_t seen_now, int decay_halves)
      : x_(x),
        last_(last_seen),
        count_(counts),
        step_(step),
        capacity_(capacity),
        divisor_(Divisor(half_life)),
        epoch_(by_count ? step / half_life : 0),
        by_count_(by_count),
        seen_now_(seen_now),
        decay_halves_(decay_halves) {}

  // Brings the index up to date with the rows seen at this step (the rows given at earlier
  // steps were pushed when given), or rebuilds it.
  void Update(Rows seen, int64_t wanted) {
    const bool kept = x_.valid && x_.capacity == capacity_;
    if (!kept) {
      x_.cursor = 1;
      x_.freed.clear();
    }
    if (!kept || x_.epoch != epoch_) {
      Rebuild(wanted, {});
      return;
    }
    for (const int64_t row : seen) Push(row);
    // Sized by this step's needs, not by those of the step that last rebuilt it: after a step
    // that gave many rows (a map filled at once) the pool holds them all, and taking victims
    // from so large a heap costs more than one rebuild.
    if (PoolSize() > 2 * PoolFor(wanted)) Rebuild(wanted, {});
  }

  // The used rows last seen at or before `cut`, in (last_seen, row) order; `free` marks each
  // free in the variables (last_seen -1) before the next one is looked for.
  std::vector<int64_t> Expired(int64_t cut, const std::function<void(int64_t)>& free) {
    std::vector<int64_t> rows;
    while (true) {
      while (!PoolEmpty() && Front().last_seen <= cut) {
        const Victim v = Pop();
        if (Current(v)) {
          rows.push_back(v.row);
          free(v.row);
          if (v.row < x_.cursor) {
            x_.freed.push_back(v.row);
            std::push_heap(x_.freed.begin(), x_.freed.end(), std::greater<int64_t>());
          }
        }
      }
      // Every used row at or below the threshold was in the pool: if the threshold lies past
      // the cut, no expired row is left outside it.
      if (x_.everything || x_.threshold.last_seen > cut) break;
      Rebuild(0, {});
    }
    return rows;
  }

  std::vector<int64_t> FreeRows(int64_t wanted) {
    std::vector<int64_t> rows;
    std::vector<int64_t>& freed = x_.freed;
    while (static_cast<int64_t>(rows.size()) < wanted) {
      while (!freed.empty() && last_[freed.front()] >= 0) {  // given since it was freed
        std::pop_heap(freed.begin(), freed.end(), std::greater<int64_t>());
        freed.pop_back();
      }
      while (x_.cursor < capacity_ && last_[x_.cursor] >= 0) ++x_.cursor;
      if (!freed.empty()) {  // every row in `freed` is below the cursor
        rows.push_back(freed.front());
        std::pop_heap(freed.begin(), freed.end(), std::greater<int64_t>());
        freed.pop_back();
      } else if (x_.cursor < capacity_) {
        rows.push_back(x_.cursor++);
      } else {
        break;
      }
    }
    return rows;
  }

  // The `more` smallest keys of rows not seen at this step, popped from the pool, while
  // `accept(k, score)` takes the k-th (score: its aged count); the first one refused stays.
  std::vector<int64_t> Victims(int64_t more, const Accept& accept) {
    std::vector<int64_t> rows;
    std::vector<Victim> seen_now;  // current, but not evictable at this step: put back
    bool rebuilt = false;
    while (static_cast<int64_t>(rows.size()) < more) {
      if (PoolEmpty()) {
        // The pool held every used row, or it was rebuilt at this step with room for every
        // row seen now plus twice the victims wanted: no evictable row is left.
        if (x_.everything || rebuilt) break;
        Rebuild(more, std::unordered_set<int64_t>(rows.begin(), rows.end()));
        seen_now.clear();  // the scan pushed them again
        rebuilt = true;
        continue;
      }
      if (x_.next + kLookAhead < x_.sorted.size()) {  // rows checked a few pops later
        const uint32_t later = x_.sorted[x_.next + kLookAhead].row;
        __builtin_prefetch(&last_[later]);
        __builtin_prefetch(&count_[later]);
      }
      const Victim v = Pop();
      if (!Current(v)) continue;
      if (v.last_seen >= step_) {
        seen_now.push_back(v);
      } else if (accept(rows.size(), v.aged)) {
        rows.push_back(v.row);
      } else {
        seen_now.push_back(v);
        break;
      }
    }
    for (const Victim& v : seen_now) Enter(v);
    return rows;
  }

  // distance_lfu's victims: its scores change every step, and so may their order, so no pool
  // keeps them; one scan of the rows not seen at this step keeps the `more` smallest (score,
  // last_seen, row), taken while `accept` takes them.
  std::vector<int64_t> DistanceVictims(int64_t more, const Accept& accept) const {
    struct Scored {
      double score;
      int32_t last_seen;
      uint32_t row;
      bool operator<(const Scored& other) const {
        if (score != other.score) return score < other.score;
        if (last_seen != other.last_seen) return last_seen < other.last_seen;
        return row < other.row;
      }
    };
    std::vector<Scored> kept;
    if (more <= 0) return {};
    const size_t size = more;
    kept.reserve(std::min<size_t>(2 * size, capacity_));
    auto cut = [&kept, size] {
      std::nth_element(kept.begin(), kept.begin() + (size - 1), kept.end());
      kept.resize(size);
    };
    Scored bound{0, 0, 0};
    bool bounded = false;
    for (int64_t r = 1; r < capacity_; ++r) {
      if (last_[r] < 0 || last_[r] >= step_) continue;
      const Scored key{DistanceScore(count_[r], step_ - last_[r], decay_halves_), last_[r],
                       static_cast<uint32_t>(r)};
      if (bounded && !(key < bound)) continue;
      kept.push_back(key);
      if (kept.size() == 2 * size) {
        cut();
        bound = kept[size - 1];
        bounded = true;
      }
    }
    if (kept.size() > size) cut();
    std::sort(kept.begin(), kept.end());
    std::vector<int64_t> rows;
    for (const Scored& v : kept) {
      if (!accept(rows.size(), v.score)) break;
      rows.push_back(v.row);
    }
    return rows;
  }

  // After a step that gave many rows the pool holds them all: cut back to its usual size now
  // rather than at the next step, so that no step leaves the index above its bound.
  void Trim() {
    if (PoolSize() > 2 * PoolFor(0)) Rebuild(0, {});
  }

  // A row whose key changed at this step (given to a new key) enters the index.
  void Push(int64_t row) {
    if (last_[row] < 0) return;
    const Victim key = KeyOf(row);
    if (!x_.everything && x_.threshold < key) return;
    Enter(key);
  }

 private:
  Victim KeyOf(int64_t row) const {
    int32_t aged = 0;
    if (by_count_) {
      aged = count_[row] >> std::min<int64_t>(epoch_ - EpochOf(last_[row], divisor_), 31);
    }
    return Victim{aged, last_[row], static_cast<uint32_t>(row)};
  }

  // Whether a pool entry still describes its row (used, with the key it was pushed with).
  bool Current(const Victim& v) const {
    if (v.last_seen < 0 || last_[v.row] != v.last_seen) return false;
    return !by_count_ || KeyOf(v.row).aged == v.aged;
  }

  Victim Pop() {
    if (FromSorted()) return x_.sorted[x_.next++];
    const Victim v = x_.pushed.front();
    std::pop_heap(x_.pushed.begin(), x_.pushed.end(), std::greater<Victim>());
    x_.pushed.pop_back();
    return v;
  }

  void Enter(const Victim& v) {
    x_.pushed.push_back(v);
    std::push_heap(x_.pushed.begin(), x_.pushed.end(), std::greater<Victim>());
  }

  bool PoolEmpty() const { return x_.next == x_.sorted.size() && x_.pushed.empty(); }
  int64_t PoolSize() const {
    return static_cast<int64_t>(x_.sorted.size() - x_.next + x_.pushed.size());
  }
  // Whether the pool's smallest entry is the sorted one's (the pool is not empty).
  bool FromSorted() const {
    if (x_.next == x_.sorted.size()) return false;
    return x_.pushed.empty() || x_.sorted[x_.next] < x_.pushed.front();
  }
  const Victim& Front() const {
    return FromSorted() ? x_.sorted[x_.next] : x_.pushed.front();
  }

  // How many entries a rebuild keeps: a quarter of the rows within bounds, or room for the
  // victims a step wants (twice) beside the rows it has seen.
  int64_t PoolFor(int64_t wanted) const {
    const int64_t usual =
        std::min(capacity_, std::max(kMinPool, std::min(capacity_ / 4, kMaxPool)));
    return std::max(usual, 2 * wanted + seen_now_);
  }

  // One scan of the variables: the pool's smallest keys (rows in `taken` left out).
  void Rebuild(int64_t wanted, const std::unordered_set<int64_t>& taken) {
    x_.capacity = capacity_;
    x_.epoch = epoch_;
    x_.valid = true;
    // The `size` smallest keys: keys below the bound gather in a buffer of twice that; a
    // full buffer is cut to its `size` smallest (a selection in linear time), whose largest
    // becomes the bound. A heap of `size` entries cost a few cache misses a row.
    const size_t size = PoolFor(wanted);
    std::vector<Victim> kept;
    kept.reserve(std::min<size_t>(2 * size, capacity_));  // a step may want more rows than exist
    auto cut = [&kept, size] {
      std::nth_element(kept.begin(), kept.begin() + (size - 1), kept.end());
      kept.resize(size);
    };
    Victim bound{0, 0, 0};
    bool bounded = false;
    for (int64_t r = 1; r < capacity_; ++r) {
      if (last_[r] < 0) continue;
      const Victim key = KeyOf(r);
      if ((bounded && !(key < bound)) || (!taken.empty() && taken.count(r))) continue;
      kept.push_back(key);
      if (kept.size() == 2 * size) {
        cut();
        bound = kept[size - 1];
        bounded = true;
      }
    }
    x_.everything = kept.size() < size;
    if (!x_.everything) cut();
    SortVictims(kept);
    if (!kept.empty()) x_.threshold = kept.back();
    // At its size, not the buffer's; heaps grown by a step that gave many rows (a map filled at
    // once) are given back, so that the index keeps its bound of bytes a row whatever the batch.
    std::vector<Victim>(kept.begin(), kept.end()).swap(x_.sorted);
    x_.next = 0;
    x_.pushed.clear();
    if (x_.pushed.capacity() > size) x_.pushed.shrink_to_fit();
    if (x_.freed.capacity() > 2 * x_.freed.size() + kMinPool) x_.freed.shrink_to_fit();
  }

  ManagedIndex& x_;
  const int32_t* last_;
  const int32_t* count_;
  const int64_t step_, capacity_;
  const uint32_t divisor_;
  const int64_t epoch_;
  const bool by_count_;
  const int64_t seen_now_;
  const int decay_halves_;
};

REGISTER_OP("TpuEmbeddingManagedRemap")
    .Input("index: resource")
    .Input("keys: resource")
    .Input("counts: resource")     // int32
    .Input("last_seen: resource")  // int32
    .Input("step: resource")       // int64
    .Input("ids: int64")
    .Input("candidates: num_candidates * resource")
    .Attr("num_candidates: int >= 0")
    .Attr("eviction: {'lfu', 'lru', 'ttl', 'distance_lfu'}")
    .Attr("compete: bool = false")
    .Attr("decay_halves: int >= 1 = 2")
    .Attr("half_life: int >= 1")
    .Attr("min_count: int >= 1")
    .Attr("ttl_steps: int >= 0")
    .Attr("table: string = ''")
    .Output("rows: int64")
    .Output("given: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(5));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
One training step of a managed-id map: `rows` of `ids` (0 for keys left without a row) and the
rows `given` to new keys, in the order of their keys' first occurrence. Adds 1 to the int64
`step`; counts each key holding a row (a used row: last_seen >= 0, row > 0, its key in `keys`;
its count aged by halving once per `half_life` steps since its row's last_seen, at most 62
times, plus its occurrences; saturating at 2**31 - 1; last_seen = step); for 'ttl', frees the
rows last seen at or before step - ttl_steps (last_seen = -1). New keys whose occurrences (plus
their count in the one `candidates` table, given when min_count > 1 or with `compete`) reach
`min_count` get rows, in
this order: the free rows (last_seen < 0, row > 0) ascending, then rows whose key was not seen
at this step, by (count aged to step, last_seen, row) for 'lfu', by (count / (step -
last_seen) ** (decay_halves / 2), last_seen, row) for 'distance_lfu' (counts never halved), by
(last_seen, row) for 'lru' and 'ttl'. The first new keys take the free rows; the others take the
victims' rows in that order, or with `compete` ranked by their total (descending, ties by first
occurrence) and only while a key's total is above its victim's score. The new key, its count and
last_seen are written to the given row; new keys left without a row are counted in `candidates`
(the caller prunes it). Errors name the `table`.
)doc");

REGISTER_OP("TpuEmbeddingManagedLookup")
    .Input("index: resource")
    .Input("keys: resource")
    .Input("last_seen: resource")  // int32
    .Input("step: resource")       // int64
    .Input("ids: int64")
    .Attr("table: string = ''")
    .Output("rows: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(4));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The rows of `ids` in a managed-id map (0 for keys holding none), read from its index; changes
nothing in the map. Errors name the `table`.
)doc");

// `status` with its message prefixed by the table's name.
absl::Status Named(const std::string& table, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("Table '", table, "': ", status.message()));
}

// Locks several variables in a fixed (address) order, as TF's own ops do, and releases them.
class VariableLocks {
 public:
  explicit VariableLocks(std::vector<::tensorflow::mutex*> mutexes)
      : mutexes_(std::move(mutexes)) {
    std::sort(mutexes_.begin(), mutexes_.end());
    mutexes_.erase(std::unique(mutexes_.begin(), mutexes_.end()), mutexes_.end());
    for (::tensorflow::mutex* mu : mutexes_) mu->lock();
  }
  ~VariableLocks() {
    for (auto it = mutexes_.rbegin(); it != mutexes_.rend(); ++it) (*it)->unlock();
  }

 private:
  std::vector<::tensorflow::mutex*> mutexes_;
};

// The variable's buffer, made this variable's own before it is written in place: a tensor
// read from it earlier may still share it (TF's own sparse updates copy it likewise).
template <typename T>
absl::Status Writable(OpKernelContext* ctx, Var* var, Tensor** out) {
  Tensor* tensor = var->tensor();
  if (!tensor->RefCountIsOne()) {
    Tensor copy;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy));
    std::copy_n(tensor->flat<T>().data(), tensor->NumElements(), copy.flat<T>().data());
    *tensor = copy;
  }
  *out = tensor;
  return absl::OkStatus();
}

// A map's variables (keys, counts, last_seen, step, from the inputs `first`..) looked up,
// locked and checked, with its index; `counts` is absent (null) for a lookup.
class MapState {
 public:
  absl::Status Open(OpKernelContext* ctx, bool with_counts, int first) {
    TF_RETURN_IF_ERROR(LookupOrCreateResource<ManagedIndex>(ctx, HandleFromInput(ctx, 0),
                                                            &index, NewIndex));
    const int names[4] = {0, 1, 2, 3};  // keys, counts, last_seen, step
    int input = first;
    for (const int i : names) {
      if (i == 1 && !with_counts) continue;
      TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input++), &vars[i]));
    }
    std::vector<::tensorflow::mutex*> mutexes;
    for (const auto& var : vars) {
      if (var) mutexes.push_back(var->mu());
    }
    locks_ = std::make_unique<VariableLocks>(std::move(mutexes));
    index_lock_ = std::make_unique<::tensorflow::mutex_lock>(index->mu);
    const Tensor& step = *vars[3]->tensor();
    if (step.dtype() != DT_INT64 || step.NumElements() != 1) {
      return InvalidArgument("the step counter must be an int64 scalar");
    }
    const Tensor& keys = *vars[0]->tensor();
    if (keys.dtype() != DT_INT64 || keys.dims() != 1) {
      return InvalidArgument("keys must be an int64 vector");
    }
    capacity = keys.NumElements();
    if (capacity < 2) {  // row 0 reads every key without a row: no row would be left to give
      return InvalidArgument("a managed-id map needs at least 2 rows, got ", capacity);
    }
    for (int i = 1; i < 3; ++i) {
      if (!vars[i]) continue;
      if (vars[i]->tensor()->dtype() != DT_INT32 || vars[i]->tensor()->shape() != keys.shape()) {
        return InvalidArgument("counts and last_seen must be int32 vectors as long as keys, got ",
                               vars[i]->tensor()->shape().DebugString());
      }
    }
    // The index vouches for the variables only if every write since it last looked was its
    // own, at this capacity: else its table is rebuilt (counts: only the eviction pool).
    if (index->table_rows != capacity || !Held(0) || !Held(2) || !Held(3)) {
      TF_RETURN_IF_ERROR(Reindex(*index, keys.flat<int64_t>().data(),
                                 vars[2]->tensor()->flat<int32_t>().data(), capacity));
    }
    if (vars[1] && !Held(1)) index->valid = false;
    Hold();
    return absl::OkStatus();
  }

  // Whether the index holds variable i's buffer (0 keys, 1 counts, 2 last_seen, 3 step).
  bool Held(int i) const { return index->held[i].SharesBufferWith(*vars[i]->tensor()); }

  // The index holds the buffers of the variables now (after its own writes).
  void Hold() {
    for (int i = 0; i < 4; ++i) {
      if (vars[i]) index->held[i] = *vars[i]->tensor();
    }
  }

  // Drops the index's hold on keys, counts and last_seen: written in place unless another
  // tensor shares their buffers (`Writable`); `Hold` again once written.
  void Release() {
    for (int i = 0; i < 3; ++i) index->held[i] = Tensor();
  }

  // The rows of `ids` (0: none).
  void Find(const int64_t* ids, int64_t n, const uint32_t* hashes, int64_t* rows) const {
    const int64_t* keys = vars[0]->tensor()->flat<int64_t>().data();
    RowTable(index->slots, keys).FindAll(ids, hashes, n, rows);
  }

  ::tensorflow::core::RefCountPtr<ManagedIndex> index;
  ::tensorflow::core::RefCountPtr<Var> vars[4];
  int64_t capacity = 0;

 private:
  std::unique_ptr<VariableLocks> locks_;
  std::unique_ptr<::tensorflow::mutex_lock> index_lock_;
};

class ManagedLookupOp : public OpKernel {
 public:
  explicit ManagedLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table", &table_));
  }

  void Compute(OpKernelContext* ctx) override {
    MapState map;
    OP_REQUIRES_OK(ctx, Named(table_, map.Open(ctx, /*with_counts=*/false, /*first=*/1)));
    const Tensor& ids = ctx->input(4);
    const int64_t n = ids.NumElements();
    std::vector<uint32_t> hashes(n);
    const int64_t* keys = ids.flat<int64_t>().data();
    for (int64_t i = 0; i < n; ++i) hashes[i] = HashOf(keys[i]);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &out));
    map.Find(keys, n, hashes.data(), out->flat<int64_t>().data());
  }

 private:
  std::string table_;
};

class ManagedRemapOp : public OpKernel {
 public:
  explicit ManagedRemapOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string eviction;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eviction", &eviction));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("half_life", &half_life_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("min_count", &min_count_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ttl_steps", &ttl_steps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_candidates", &num_candidates_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table", &table_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("compete", &compete_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("decay_halves", &decay_halves_));
    by_count_ = eviction == "lfu";
    by_distance_ = eviction == "distance_lfu";
    if (by_distance_) half_life_ = std::numeric_limits<int64_t>::max();  // never halved
    ttl_ = eviction == "ttl";
    OP_REQUIRES(ctx, !ttl_ || ttl_steps_ >= 1,
                InvalidArgument("eviction 'ttl' needs ttl_steps >= 1"));
    OP_REQUIRES(ctx, num_candidates_ == (min_count_ > 1 || compete_ ? 1 : 0),
                InvalidArgument("a candidates table is needed exactly when min_count > 1 or "
                                "new keys compete"));
  }

  // One step, in the phases the header describes: count the batch's keys, admit newcomers,
  // age and count the rows seen, choose the rows to give, write them; then the outputs.
  void Compute(OpKernelContext* ctx) override {
    MapState map;
    OP_REQUIRES_OK(ctx, Named(table_, map.Open(ctx, /*with_counts=*/true, /*first=*/1)));
    ::tensorflow::core::RefCountPtr<LookupInterface> candidates;
    OP_REQUIRES_OK(ctx, OpenCandidates(ctx, &candidates));
    Tensor* step_var = map.vars[3]->tensor();
    const int64_t step = step_var->flat<int64_t>()(0) + 1;
    OP_REQUIRES(ctx, step <= kInt32Max,
                InvalidArgument("Table '", table_, "': its managed-id map has counted 2**31 - 1 "
                                "training steps, the most its int32 last-seen steps record; "
                                "nothing was changed"));
    Batch batch;
    OP_REQUIRES_OK(ctx, CountKeys(ctx, map, &batch));
    OP_REQUIRES_OK(ctx, Admit(ctx, candidates.get(), &batch));

    // Everything is checked: from here on the step writes the variables.
    map.Release();
    Tensor* vars_now[3];
    OP_REQUIRES_OK(ctx, Writable<int64_t>(ctx, map.vars[0].get(), &vars_now[0]));
    OP_REQUIRES_OK(ctx, Writable<int32_t>(ctx, map.vars[1].get(), &vars_now[1]));
    OP_REQUIRES_OK(ctx, Writable<int32_t>(ctx, map.vars[2].get(), &vars_now[2]));
    Columns columns{vars_now[0]->flat<int64_t>().data(), vars_now[1]->flat<int32_t>().data(),
                    vars_now[2]->flat<int32_t>().data()};
    Tensor next;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64, TensorShape({}), &next));
    next.scalar<int64_t>()() = step;
    *step_var = next;  // a new buffer, never written again: readers of the old one keep theirs

    const std::vector<int64_t> seen_rows = AgeSeen(batch, columns, step);
    Step index_step(*map.index, columns.last, columns.counts, map.capacity, step, half_life_,
                    by_count_, batch.seen.size(), decay_halves_);
    index_step.Update(seen_rows, batch.eligible.size());
    Choice choice = Choose(&index_step, &batch, columns.last, step);
    std::vector<int64_t> admitted;  // distinct-key positions
    const bool held = WriteRows(*map.index, choice, &index_step, &batch, columns, step, &admitted);

    absl::Status status = held ? absl::OkStatus()
                               : ::tensorflow::errors::Internal(
                                     "the managed-id map's index disagreed with its variables");
    if (status.ok()) status = Output(ctx, 1, choice.given);
    if (status.ok() && candidates) {
      Tensor new_keys;
      status = Gather(ctx, batch.unique_keys, admitted, &new_keys);
      if (status.ok()) {
        status = Count(ctx, *candidates, batch.unique_keys, batch.newcomers, batch.waiting,
                       batch.totals, new_keys);
      }
    }
    map.Hold();
    if (!status.ok()) {
      map.index->table_rows = 0;  // rebuild it all from the variables at the next step
      ctx->SetStatus(Named(table_, status));
      return;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ctx->input(5).shape(), &out));
    int64_t* result = out->flat<int64_t>().data();
    for (size_t i = 0; i < batch.position.size(); ++i) result[i] = batch.row_of[batch.position[i]];
  }

 private:
  // What a step learns of its batch, phase by phase.
  struct Batch {
    std::vector<int64_t> position, first, occurrences;  // see `Distinct`
    std::vector<uint32_t> hashes;                       // of the distinct keys
    Tensor unique_keys;                                 // the distinct keys
    std::vector<int64_t> row_of;                        // becomes each distinct key's row
    std::vector<int64_t> seen, newcomers;               // distinct keys with a row, without
    std::vector<int64_t> totals;     // per newcomer: occurrences plus its candidate count
    std::vector<int64_t> eligible, waiting;  // positions in `newcomers`
  };

  // The map's variables, written in place.
  struct Columns {
    int64_t* keys;
    int32_t* counts;
    int32_t* last;
  };

  // The rows a step gives, in order, to the newcomers at positions `order` of `eligible`, and
  // the rows whose keys leave the map (expired or evicted).
  struct Choice {
    std::vector<int64_t> given, order, leaving;
  };

  // The candidates table (input 6), where the map keeps one (min_count > 1, or competing).
  absl::Status OpenCandidates(OpKernelContext* ctx,
                              ::tensorflow::core::RefCountPtr<LookupInterface>* candidates) {
    if (num_candidates_ == 0) return absl::OkStatus();
    TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, 6), candidates));
    if ((*candidates)->key_dtype() != DT_INT64 ||
        (*candidates)->value_dtype() != DT_INT64) {
      return InvalidArgument("the map's candidates table must map ",
                             ::tensorflow::DataTypeString(DT_INT64),
                             " keys to int64");
    }
    return absl::OkStatus();
  }

  // Count: the batch's distinct keys in first-occurrence order, and the rows they hold.
  static absl::Status CountKeys(OpKernelContext* ctx, const MapState& map, Batch* batch) {
    const auto ids = ctx->input(5).flat<int64_t>();
    const int64_t n = ids.size();
    batch->position.resize(n);
    Distinct(ids.data(), n, &batch->position, &batch->first, &batch->occurrences,
             &batch->hashes);
    const int64_t distinct = batch->first.size();
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({distinct}),
                                          &batch->unique_keys));
    auto unique = batch->unique_keys.flat<int64_t>();
    for (int64_t u = 0; u < distinct; ++u) unique(u) = ids(batch->first[u]);
    batch->row_of.resize(distinct);
    map.Find(unique.data(), distinct, batch->hashes.data(), batch->row_of.data());
    batch->seen.reserve(distinct);
    batch->newcomers.reserve(distinct);
    for (int64_t u = 0; u < distinct; ++u) {
      (batch->row_of[u] > 0 ? batch->seen : batch->newcomers).push_back(u);
    }
    return absl::OkStatus();
  }

  // Admit: a newcomer's total is its occurrences plus its candidate count; those reaching
  // min_count are eligible, the others wait.
  absl::Status Admit(OpKernelContext* ctx, LookupInterface* candidates, Batch* batch) const {
    const std::vector<int64_t>& newcomers = batch->newcomers;
    batch->totals.resize(newcomers.size());
    for (size_t j = 0; j < newcomers.size(); ++j) {
      batch->totals[j] = batch->occurrences[newcomers[j]];
    }
    if (candidates) {
      Tensor keys, counted, zero;
      TF_RETURN_IF_ERROR(Gather(ctx, batch->unique_keys, newcomers, &keys));
      TF_RETURN_IF_ERROR(
          ctx->allocate_temp(DT_INT64, TensorShape({keys.NumElements()}), &counted));
      TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({}), &zero));
      zero.scalar<int64_t>()() = 0;
      TF_RETURN_IF_ERROR(candidates->Find(ctx, keys, &counted, zero));
      for (size_t j = 0; j < newcomers.size(); ++j) {
        batch->totals[j] += counted.flat<int64_t>()(j);
      }
    }
    for (size_t j = 0; j < newcomers.size(); ++j) {
      (batch->totals[j] >= min_count_ ? batch->eligible : batch->waiting).push_back(j);
    }
    return absl::OkStatus();
  }

  // Age and count: each row seen has its count aged to this step's epoch, plus its key's
  // occurrences, and is last seen now. Returns the rows seen.
  std::vector<int64_t> AgeSeen(const Batch& batch, const Columns& columns, int64_t step) const {
    const int64_t epoch = step / half_life_;
    const uint32_t divisor = Divisor(half_life_);
    const std::vector<int64_t>& seen = batch.seen;
    std::vector<int64_t> seen_rows(seen.size());
    for (size_t j = 0; j < seen.size(); ++j) {
      if (j + kLookAhead < seen.size()) {
        __builtin_prefetch(&columns.counts[batch.row_of[seen[j + kLookAhead]]], 1);
        __builtin_prefetch(&columns.last[batch.row_of[seen[j + kLookAhead]]], 1);
      }
      const int64_t row = batch.row_of[seen[j]];
      const int64_t aged = int64_t{columns.counts[row]} >>
                           std::min(epoch - EpochOf(columns.last[row], divisor), kMaxShift);
      columns.counts[row] =
          static_cast<int32_t>(std::min(aged + batch.occurrences[seen[j]], kInt32Max));
      columns.last[row] = static_cast<int32_t>(step);
      seen_rows[j] = row;
    }
    return seen_rows;
  }

  // Free and evict: TTL's expired rows leave; the first eligible keys take the free rows, the
  // rest take victims' rows, in first-occurrence order or, competing, strongest first while
  // they beat the victim. Eligible keys left without a row join the waiting ones.
  Choice Choose(Step* index_step, Batch* batch, int32_t* last, int64_t step) const {
    Choice choice;
    if (ttl_) {
      choice.leaving =
          index_step->Expired(step - ttl_steps_, [last](int64_t row) { last[row] = -1; });
    }
    const std::vector<int64_t>& eligible = batch->eligible;
    choice.given = index_step->FreeRows(eligible.size());
    choice.order.assign(eligible.begin(), eligible.begin() + choice.given.size());
    std::vector<int64_t> rest(eligible.begin() + choice.given.size(), eligible.end());
    const std::vector<int64_t>& totals = batch->totals;
    if (compete_) {
      std::stable_sort(rest.begin(), rest.end(),
                       [&totals](int64_t a, int64_t b) { return totals[a] > totals[b]; });
    }
    const Accept accept = [this, &rest, &totals](int64_t k, double score) {
      return !compete_ || static_cast<double>(totals[rest[k]]) > score;
    };
    const std::vector<int64_t> victims = by_distance_
                                             ? index_step->DistanceVictims(rest.size(), accept)
                                             : index_step->Victims(rest.size(), accept);
    choice.order.insert(choice.order.end(), rest.begin(), rest.begin() + victims.size());
    batch->waiting.insert(batch->waiting.end(), rest.begin() + victims.size(), rest.end());
    choice.given.insert(choice.given.end(), victims.begin(), victims.end());
    choice.leaving.insert(choice.leaving.end(), victims.begin(), victims.end());
    return choice;
  }

  // Write: the leaving rows' keys leave the table, the admitted keys take their rows (key,
  // count, last seen, table entry, eviction index). `admitted`: their distinct-key positions.
  // False if the table disagreed with the variables.
  static bool WriteRows(ManagedIndex& index, const Choice& choice, Step* index_step,
                        Batch* batch, const Columns& columns, int64_t step,
                        std::vector<int64_t>* admitted) {
    // Rows and slots are scattered over memory much larger than the caches: each loop below
    // prefetches what it will touch kLookAhead iterations later.
    RowTable table(index.slots, columns.keys);
    const std::vector<int64_t>& leaving = choice.leaving;
    const int64_t left = leaving.size();
    std::vector<uint32_t> leaving_hashes(left);
    for (int64_t j = 0; j < left; ++j) {
      if (j + kLookAhead < left) __builtin_prefetch(&columns.keys[leaving[j + kLookAhead]]);
      leaving_hashes[j] = HashOf(columns.keys[leaving[j]]);
    }
    bool held = true;
    for (int64_t j = 0; j < left; ++j) {
      if (j + kLookAhead < left) table.Prefetch(leaving_hashes[j + kLookAhead]);
      held = table.Erase(leaving_hashes[j], static_cast<uint32_t>(leaving[j])) && held;
    }
    const std::vector<int64_t>& given = choice.given;
    const std::vector<int64_t>& newcomers = batch->newcomers;
    const int64_t* unique = batch->unique_keys.flat<int64_t>().data();
    const int64_t placed = given.size();
    admitted->resize(placed);
    for (int64_t j = 0; j < placed; ++j) {
      if (j + kLookAhead < placed) {
        const int64_t later = given[j + kLookAhead];
        __builtin_prefetch(&columns.keys[later], 1);
        __builtin_prefetch(&columns.counts[later], 1);
        __builtin_prefetch(&columns.last[later], 1);
        table.Prefetch(batch->hashes[newcomers[choice.order[j + kLookAhead]]]);
      }
      const int64_t u = newcomers[choice.order[j]], row = given[j];
      (*admitted)[j] = u;
      columns.keys[row] = unique[u];
      columns.counts[row] =
          static_cast<int32_t>(std::min(batch->totals[choice.order[j]], kInt32Max));
      columns.last[row] = static_cast<int32_t>(step);
      batch->row_of[u] = row;
      held = table.Insert(batch->hashes[u], static_cast<uint32_t>(row)) && held;
      index_step->Push(row);
    }
    index_step->Trim();
    return held;
  }

  // The distinct keys of `ids` in first-occurrence order: `first` their first positions,
  // `occurrences` their counts, `hashes` their hashes, `position[i]` the one ids[i] is. An
  // open-addressing table of distinct-key numbers over the keys' own hashes (each key is
  // hashed once, for this and the map's table), at most half full.
  static void Distinct(const int64_t* ids, int64_t n, std::vector<int64_t>* position,
                       std::vector<int64_t>* first, std::vector<int64_t>* occurrences,
                       std::vector<uint32_t>* hashes) {
    size_t size = 16;
    while (size < 2 * static_cast<size_t>(n)) size <<= 1;
    const size_t mask = size - 1;
    std::vector<int64_t> slots(size, -1);  // a distinct key's first position, or -1
    first->reserve(n);
    occurrences->reserve(n);
    hashes->reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t hash = HashOf(ids[i]);
      size_t s = hash & mask;
      while (slots[s] >= 0 && !(ids[slots[s]] == ids[i])) s = (s + 1) & mask;
      if (slots[s] < 0) {
        slots[s] = i;
        (*position)[i] = first->size();
        first->push_back(i);
        occurrences->push_back(1);
        hashes->push_back(hash);
      } else {
        (*position)[i] = (*position)[slots[s]];
        ++(*occurrences)[(*position)[i]];
      }
    }
  }

  // `keys[at[j]]` for each j.
  static absl::Status Gather(OpKernelContext* ctx, const Tensor& keys,
                             const std::vector<int64_t>& at, Tensor* out) {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        DT_INT64, TensorShape({static_cast<int64_t>(at.size())}), out));
    for (size_t j = 0; j < at.size(); ++j) out->flat<int64_t>()(j) = keys.flat<int64_t>()(at[j]);
    return absl::OkStatus();
  }

  static absl::Status Output(OpKernelContext* ctx, int index, const std::vector<int64_t>& rows) {
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(
        index, TensorShape({static_cast<int64_t>(rows.size())}), &out));
    std::copy(rows.begin(), rows.end(), out->flat<int64_t>().data());
    return absl::OkStatus();
  }

  // Admitted keys leave the candidates; the others wait there with their totals.
  static absl::Status Count(OpKernelContext* ctx, LookupInterface& candidates,
                            const Tensor& unique_keys, const std::vector<int64_t>& newcomers,
                            const std::vector<int64_t>& waiting,
                            const std::vector<int64_t>& totals, const Tensor& admitted) {
    TF_RETURN_IF_ERROR(candidates.Remove(ctx, admitted));
    std::vector<int64_t> at(waiting.size());
    Tensor keys, counts;
    for (size_t j = 0; j < waiting.size(); ++j) at[j] = newcomers[waiting[j]];
    TF_RETURN_IF_ERROR(Gather(ctx, unique_keys, at, &keys));
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(DT_INT64, TensorShape({static_cast<int64_t>(at.size())}), &counts));
    for (size_t j = 0; j < waiting.size(); ++j) counts.flat<int64_t>()(j) = totals[waiting[j]];
    return candidates.Insert(ctx, keys, counts);
  }

  int64_t half_life_ = 1, min_count_ = 1, ttl_steps_ = 0;
  int num_candidates_ = 0, decay_halves_ = 2;
  bool by_count_ = false, by_distance_ = false, ttl_ = false, compete_ = false;
  std::string table_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingManagedRemap").Device(DEVICE_CPU), ManagedRemapOp);
REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingManagedLookup").Device(DEVICE_CPU), ManagedLookupOp);

}  // namespace
}  // namespace tpu_embedding
