// The rows a managed-id map gives to new keys in one step (docs/managed-ids.md, "Placement"),
// from an eviction index kept between steps, so that a step costs O(batch log pool) rather than
// a scan of the whole map.
//
// The index is a cache derived from the map's variables (`last_seen`, `counts`, `step`), which
// alone are checkpointed. It holds:
// - free rows: a cursor over rows in ascending order plus a min-heap of rows freed below it;
// - a pool: every used row whose eviction key is <= a threshold `T`, in a min-heap (lazily
//   deleted: an entry whose row's key has changed since it was pushed is dropped when popped).
//   Within one LFU epoch a row's key changes only when its row is seen or given to a new key;
//   those rows are pushed again (if <= T) at the step that changes them, so the invariant holds
//   without reading the other rows. When the pool runs dry, grows too stale, the LFU epoch
//   changes (every key halves: the order between unseen rows may change), or the index cannot
//   vouch for the variables, one scan rebuilds it (at most `pool` entries kept).
// The index vouches for the variables only if every write of the step counter since its last
// step was its own (`TpuEmbeddingManagedNextStep`): it holds the counter's buffer, so any other
// write (a checkpoint restore, an assign) gives the variable a new buffer and forces a rebuild.
// The rows given are exactly those of the full ordering (the TF ops' sort): eviction keys end in
// the row index, so no two are equal.
#include <algorithm>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/types/span.h"

#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tpu_embedding/engine/cc/kernels.h"

namespace tpu_embedding {
namespace {

using ::tensorflow::DT_INT32;
using ::tensorflow::DT_INT64;
using ::tensorflow::HandleFromInput;
using ::tensorflow::LookupOrCreateResource;
using ::tensorflow::LookupResource;
using ::tensorflow::ResourceBase;
using ::tensorflow::ResourceHandleOp;
using ::tensorflow::Var;
using ::tensorflow::shape_inference::InferenceContext;

// One used row and what orders it as a victim; `aged` is 0 for LRU and TTL.
struct Victim {
  int64_t aged;
  int64_t last_seen;
  int64_t row;
  bool operator<(const Victim& other) const {
    if (aged != other.aged) return aged < other.aged;
    if (last_seen != other.last_seen) return last_seen < other.last_seen;
    return row < other.row;
  }
  bool operator>(const Victim& other) const { return other < *this; }
};

constexpr int64_t kMaxShift = 62;  // as the TF ops: a longer absence ages any count to 0
constexpr int64_t kMinPool = 1024;
constexpr int64_t kMaxPool = 1 << 16;

class ManagedIndex : public ResourceBase {
 public:
  std::string DebugString() const override { return "TpuEmbeddingManagedIndex"; }

  ::tensorflow::mutex mu;
  bool valid = false;           // false: rebuild from the variables before use
  ::tensorflow::Tensor step;    // the step counter's buffer as this index last wrote it
  int64_t capacity = 0;
  int64_t epoch = 0;            // LFU epoch the pool's keys were computed at
  int64_t cursor = 1;           // rows >= cursor: free iff last_seen < 0
  std::vector<int64_t> freed;   // min-heap of free rows below the cursor
  std::vector<Victim> pool;     // min-heap, lazily deleted
  Victim threshold{0, 0, 0};    // every used row with key <= threshold is in the pool
  bool everything = false;      // the pool held every used row when built (no threshold)
  int64_t pool_size = 0;        // how many entries a rebuild keeps
  std::vector<int64_t> given;   // rows given last step: their keys are set after this kernel
};

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

REGISTER_OP("TpuEmbeddingManagedNextStep")
    .Input("index: resource")
    .Input("step: resource")
    .Output("next: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Adds 1 to a managed-id map's int64 step counter and returns the new value. The index stays
valid only if the counter still holds the buffer this op wrote at the previous step.
)doc");

class ManagedNextStepOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<ManagedIndex> index;
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<ManagedIndex>(ctx, HandleFromInput(ctx, 0),
                                                             &index, NewIndex));
    ::tensorflow::core::RefCountPtr<Var> step;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &step));
    ::tensorflow::mutex_lock step_lock(*step->mu());
    ::tensorflow::mutex_lock index_lock(index->mu);
    Tensor* current = step->tensor();
    OP_REQUIRES(ctx, current->dtype() == DT_INT64 && current->NumElements() == 1,
                InvalidArgument("the step counter must be an int64 scalar"));
    if (!index->step.SharesBufferWith(*current)) index->valid = false;
    Tensor next;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_INT64, TensorShape({}), &next));
    next.scalar<int64_t>()() = current->flat<int64_t>()(0) + 1;
    *current = next;  // a new buffer, never written again: readers of the old one are unaffected
    index->step = next;
    ctx->set_output(0, next);
  }
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingManagedNextStep").Device(DEVICE_CPU),
                        ManagedNextStepOp);

REGISTER_OP("TpuEmbeddingManagedRowsToGive")
    .Input("index: resource")
    .Input("last_seen: resource")  // int32
    .Input("counts: resource")     // int32
    .Input("step: int64")
    .Input("wanted: int64")
    .Input("seen: int64")
    .Input("freed: int64")
    .Attr("eviction: {'lfu', 'lru', 'ttl'}")
    .Attr("half_life: int >= 1")
    .Output("rows: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Up to `wanted` rows of a managed-id map for new keys, at `step` (after the rows `seen` in it
were counted and the rows `freed` in it were freed). First the free rows (last_seen < 0,
row > 0) in ascending order, then the rows whose key was not seen at `step`
(0 <= last_seen < step), ordered for 'lfu' by (count aged to step, last_seen, row), for 'lru'
and 'ttl' by (last_seen, row). A count is aged by halving it once per `half_life` steps since
it was last updated (at most 62 times), which was at its row's last_seen. The caller must give
the returned rows their new keys (last_seen = step) before the next step.
)doc");

using Rows = absl::Span<const int64_t>;

Rows RowsOf(const Tensor& t) { return Rows(t.flat<int64_t>().data(), t.NumElements()); }

// One call's view of the variables, and the index's maintenance from it.
class Step {
 public:
  Step(ManagedIndex& x, const Tensor& last_seen, const Tensor& counts, int64_t step,
       int64_t half_life, bool by_count, int64_t seen_now)
      : x_(x),
        last_(last_seen.flat<int32_t>().data()),
        count_(counts.flat<int32_t>().data()),
        step_(step),
        capacity_(last_seen.NumElements()),
        half_life_(half_life),
        epoch_(by_count ? step / half_life : 0),
        by_count_(by_count),
        seen_now_(seen_now) {}

  // Brings the index up to date with the rows whose keys changed since its last step (given
  // then, seen or freed now), or rebuilds it.
  void Update(Rows seen, Rows freed, int64_t wanted) {
    const bool kept = x_.valid && x_.capacity == capacity_;
    if (!kept) {
      x_.cursor = 1;
      x_.freed.clear();
    } else {
      for (const int64_t row : freed) {
        if (row < x_.cursor) {
          x_.freed.push_back(row);
          std::push_heap(x_.freed.begin(), x_.freed.end(), std::greater<int64_t>());
        }
      }
    }
    if (!kept || x_.epoch != epoch_) {
      Rebuild(wanted, {});
      return;
    }
    for (const int64_t row : x_.given) {
      if (last_[row] == step_ - 1) Push(row);  // else seen now (below) or freed
    }
    for (const int64_t row : seen) Push(row);
    if (static_cast<int64_t>(x_.pool.size()) > 2 * x_.pool_size) Rebuild(wanted, {});
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

  // The `more` smallest keys of rows not seen at this step, popped from the pool.
  std::vector<int64_t> Victims(int64_t more) {
    std::vector<int64_t> rows;
    std::vector<Victim> seen_now;  // current, but not evictable at this step: put back
    bool rebuilt = false;
    while (static_cast<int64_t>(rows.size()) < more) {
      if (x_.pool.empty()) {
        // The pool held every used row, or it was rebuilt at this step with room for every
        // row seen now plus twice the victims wanted: no evictable row is left.
        if (x_.everything || rebuilt) break;
        Rebuild(more, std::unordered_set<int64_t>(rows.begin(), rows.end()));
        seen_now.clear();  // the scan pushed them again
        rebuilt = true;
        continue;
      }
      const Victim v = x_.pool.front();
      std::pop_heap(x_.pool.begin(), x_.pool.end(), std::greater<Victim>());
      x_.pool.pop_back();
      if (!Current(v)) continue;
      if (v.last_seen >= step_) {
        seen_now.push_back(v);
      } else {
        rows.push_back(v.row);
      }
    }
    for (const Victim& v : seen_now) {
      x_.pool.push_back(v);
      std::push_heap(x_.pool.begin(), x_.pool.end(), std::greater<Victim>());
    }
    return rows;
  }

 private:
  Victim KeyOf(int64_t row) const {
    int64_t aged = 0;
    if (by_count_) {
      aged = int64_t{count_[row]} >> std::min(epoch_ - last_[row] / half_life_, kMaxShift);
    }
    return Victim{aged, last_[row], row};
  }

  // Whether a pool entry still describes its row (used, with the key it was pushed with).
  bool Current(const Victim& v) const {
    if (v.last_seen < 0 || last_[v.row] != v.last_seen) return false;
    return !by_count_ || KeyOf(v.row).aged == v.aged;
  }

  void Push(int64_t row) {
    if (last_[row] < 0) return;
    const Victim key = KeyOf(row);
    if (!x_.everything && x_.threshold < key) return;
    x_.pool.push_back(key);
    std::push_heap(x_.pool.begin(), x_.pool.end(), std::greater<Victim>());
  }

  // One scan of the variables: the pool's smallest keys (rows in `taken` left out).
  void Rebuild(int64_t wanted, const std::unordered_set<int64_t>& taken) {
    x_.capacity = capacity_;
    x_.epoch = epoch_;
    x_.valid = true;
    const int64_t usual = std::min(capacity_, std::max(kMinPool, std::min(capacity_ / 16,
                                                                          kMaxPool)));
    x_.pool_size = std::max(usual, 2 * wanted + seen_now_);
    // The pool_size smallest keys, largest on top: most rows cost one comparison.
    std::vector<Victim>& kept = x_.pool;
    kept.clear();
    for (int64_t r = 1; r < capacity_; ++r) {
      if (last_[r] < 0 || taken.count(r)) continue;
      const Victim key = KeyOf(r);
      if (static_cast<int64_t>(kept.size()) < x_.pool_size) {
        kept.push_back(key);
        std::push_heap(kept.begin(), kept.end());
      } else if (key < kept.front()) {
        std::pop_heap(kept.begin(), kept.end());
        kept.back() = key;
        std::push_heap(kept.begin(), kept.end());
      }
    }
    x_.everything = static_cast<int64_t>(kept.size()) < x_.pool_size;
    if (!kept.empty()) x_.threshold = kept.front();
    std::make_heap(kept.begin(), kept.end(), std::greater<Victim>());
  }

  ManagedIndex& x_;
  const int32_t* last_;
  const int32_t* count_;
  const int64_t step_, capacity_, half_life_, epoch_;
  const bool by_count_;
  const int64_t seen_now_;
};

class ManagedRowsToGiveOp : public OpKernel {
 public:
  explicit ManagedRowsToGiveOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string eviction;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eviction", &eviction));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("half_life", &half_life_));
    by_count_ = eviction == "lfu";
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<ManagedIndex> index;
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<ManagedIndex>(ctx, HandleFromInput(ctx, 0),
                                                             &index, NewIndex));
    ::tensorflow::core::RefCountPtr<Var> last_var, count_var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &last_var));
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 2), &count_var));
    ::tensorflow::tf_shared_lock last_lock(*last_var->mu());
    ::tensorflow::tf_shared_lock count_lock(*count_var->mu());
    ::tensorflow::mutex_lock index_lock(index->mu);
    const Tensor& last_seen = *last_var->tensor();
    const Tensor& counts = *count_var->tensor();
    OP_REQUIRES(ctx,
                last_seen.dtype() == DT_INT32 && counts.dtype() == DT_INT32 &&
                    last_seen.dims() == 1 && counts.shape() == last_seen.shape(),
                InvalidArgument("last_seen and counts must be int32 vectors of one length, got ",
                                last_seen.shape().DebugString(), " and ",
                                counts.shape().DebugString()));
    for (int input = 3; input < 5; ++input) {
      OP_REQUIRES(ctx, ctx->input(input).NumElements() == 1,
                  InvalidArgument("step and wanted must be scalars"));
    }
    const int64_t capacity = last_seen.NumElements();
    for (int input = 5; input < 7; ++input) {
      for (const int64_t row : RowsOf(ctx->input(input))) {
        OP_REQUIRES(ctx, 0 < row && row < capacity,
                    InvalidArgument("row ", row, " is not in [1, ", capacity, ")"));
      }
    }
    const int64_t wanted = std::max<int64_t>(ctx->input(4).flat<int64_t>()(0), 0);
    const Rows seen = RowsOf(ctx->input(5));
    Step step(*index, last_seen, counts, ctx->input(3).flat<int64_t>()(0), half_life_, by_count_,
              seen.size());
    step.Update(seen, RowsOf(ctx->input(6)), wanted);
    std::vector<int64_t> rows = step.FreeRows(wanted);
    const std::vector<int64_t> victims = step.Victims(wanted - static_cast<int64_t>(rows.size()));
    rows.insert(rows.end(), victims.begin(), victims.end());
    index->given = rows;

    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({static_cast<int64_t>(rows.size())}),
                                             &out));
    std::copy(rows.begin(), rows.end(), out->flat<int64_t>().data());
  }

 private:
  int64_t half_life_ = 1;
  bool by_count_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingManagedRowsToGive").Device(DEVICE_CPU),
                        ManagedRowsToGiveOp);

}  // namespace
}  // namespace tpu_embedding
