// The rows a managed-id map gives to new keys in one step (docs/managed-ids.md, "Placement").
//
// With TF's ops this scans the whole map for free rows, then sorts every evictable row by its
// eviction key whenever the map is full: O(capacity log capacity) per step. Here one scan finds
// the free rows (stopping once there are enough), and only when there are too few, a second scan
// keeps the `wanted` smallest evictable rows in a bounded heap: O(capacity + wanted log wanted).
// The result is exactly the TF ops' one: eviction keys end in the row index, so no two are equal.
#include <algorithm>
#include <queue>
#include <string>
#include <vector>

#include "tpu_embedding/engine/cc/kernels.h"

namespace tpu_embedding {
namespace {

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TpuEmbeddingManagedRowsToGive")
    .Input("last_seen: int64")
    .Input("counts: int64")
    .Input("step: int64")
    .Input("wanted: int64")
    .Attr("eviction: {'lfu', 'lru', 'ttl'}")
    .Attr("half_life: int >= 1")
    .Output("rows: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Up to `wanted` rows of a managed-id map for new keys. First the free rows (last_seen < 0,
row > 0) in ascending order, then the rows whose key was not seen at `step`
(0 <= last_seen < step), ordered for 'lfu' by (count aged to step, last_seen, row), for 'lru'
and 'ttl' by (last_seen, row). A count is aged by halving it once per `half_life` steps since
it was last updated (at most 62 times), which was at its row's last_seen.
)doc");

// One evictable row and what orders it; `aged` is 0 for LRU, so the order is (last_seen, row).
struct Victim {
  int64_t aged;
  int64_t last_seen;
  int64_t row;
  bool operator<(const Victim& other) const {
    if (aged != other.aged) return aged < other.aged;
    if (last_seen != other.last_seen) return last_seen < other.last_seen;
    return row < other.row;
  }
};

constexpr int64_t kMaxShift = 62;  // as the TF ops: a longer absence ages any count to 0

class ManagedRowsToGiveOp : public OpKernel {
 public:
  explicit ManagedRowsToGiveOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string eviction;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eviction", &eviction));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("half_life", &half_life_));
    by_count_ = eviction == "lfu";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& last_seen = ctx->input(0);
    const Tensor& counts = ctx->input(1);
    OP_REQUIRES(ctx, last_seen.dims() == 1 && counts.shape() == last_seen.shape(),
                InvalidArgument("last_seen and counts must be vectors of one length, got ",
                                last_seen.shape().DebugString(), " and ",
                                counts.shape().DebugString()));
    OP_REQUIRES(ctx, ctx->input(2).NumElements() == 1 && ctx->input(3).NumElements() == 1,
                InvalidArgument("step and wanted must be scalars"));
    const int64_t step = ctx->input(2).flat<int64_t>()(0);
    const int64_t wanted = std::max<int64_t>(ctx->input(3).flat<int64_t>()(0), 0);
    const int64_t capacity = last_seen.NumElements();
    const int64_t* last = last_seen.flat<int64_t>().data();
    const int64_t* count = counts.flat<int64_t>().data();

    std::vector<int64_t> rows;
    for (int64_t r = 1; r < capacity && static_cast<int64_t>(rows.size()) < wanted; ++r) {
      if (last[r] < 0) rows.push_back(r);
    }
    const int64_t more = wanted - static_cast<int64_t>(rows.size());
    if (more > 0) {
      // The `more` smallest victims seen so far, largest on top: most rows cost one comparison.
      const int64_t epoch = step / half_life_;
      std::priority_queue<Victim> kept;
      for (int64_t r = 1; r < capacity; ++r) {
        if (last[r] < 0 || last[r] >= step) continue;
        int64_t aged = 0;
        if (by_count_) {
          aged = count[r] >> std::min(epoch - last[r] / half_life_, kMaxShift);
        }
        const Victim victim{aged, last[r], r};
        if (static_cast<int64_t>(kept.size()) < more) {
          kept.push(victim);
        } else if (victim < kept.top()) {
          kept.pop();
          kept.push(victim);
        }
      }
      std::vector<int64_t> victims(kept.size());
      for (auto v = victims.rbegin(); v != victims.rend(); ++v, kept.pop()) *v = kept.top().row;
      rows.insert(rows.end(), victims.begin(), victims.end());
    }
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
