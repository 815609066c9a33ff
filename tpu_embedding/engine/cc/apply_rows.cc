// One fused optimizer step on the touched rows of an embedding table and its slots.
//
// TF's own ops take ~10 graph ops per table and step for this (gather every slot, the rule's
// elementwise maths on [U, D] temporaries, scatter every variable back), each streaming its
// operands through memory and paying the executor's per-op cost. Here each touched row of the
// table and of every slot is read once, updated in registers and written back in place, with
// the next rows prefetched: their random reads are what the step waits on.
//
// The arithmetic is the Python update rules' (tpu_embedding/engine/updates.py), operation for
// operation in float32, so it gives the bits those ops give eagerly (tests/test_native.py); in a
// graph, TF rewrites their `x / sqrt(y)` into the less exact `x * rsqrt(y)`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tpu_embedding/engine/cc/kernels.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tpu_embedding {
namespace {

// The first id of `id[0..n)` (all in [0, rows)) that appears twice, or -1: by a bit per row
// when the ids are a sizeable part of the table, else by sorting a copy (O(n log n)).
int64_t FirstRepeated(const int64_t* id, int64_t n, int64_t rows) {
  if (n * 64 >= rows) {
    std::vector<uint64_t> seen((rows + 63) / 64, 0);
    for (int64_t u = 0; u < n; ++u) {
      uint64_t& word = seen[id[u] >> 6];
      const uint64_t bit = uint64_t{1} << (id[u] & 63);
      if (word & bit) return id[u];
      word |= bit;
    }
    return -1;
  }
  std::vector<int64_t> sorted(id, id + n);
  std::sort(sorted.begin(), sorted.end());
  const auto repeated = std::adjacent_find(sorted.begin(), sorted.end());
  return repeated == sorted.end() ? -1 : *repeated;
}

REGISTER_OP("TpuEmbeddingApplyRows")
    .Input("table: resource")
    .Input("slots: num_slots * resource")
    .Input("row_ids: int64")
    .Input("gradients: float")
    .Input("learning_rate: float")
    .Attr("num_slots: int >= 0")
    .Attr("rule: {'sgd', 'adagrad', 'adam'}")
    .Attr("hyperparameters: list(float) = []")
    .Attr("clip_gradient_min: float = -inf")
    .Attr("clip_gradient_max: float = inf")
    .Attr("weight_decay: float = 0")
    .Attr("weight_decay_by_learning_rate: bool = false")
    .Attr("clip_weight_min: float = -inf")
    .Attr("clip_weight_max: float = inf")
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc("Optimizer step on the unique rows `row_ids` of `table` and `slots`, in place.");

// The hyperparameters each rule reads, in the order Python passes them.
struct Hyper {
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, epsilon = 0;
  bool sum_inside_sqrt = false;
};

struct Sgd {
  static constexpr int kSlots = 0;
  static void Row(float* w, float* const*, const float* g, int64_t dim, float lr, const Hyper&) {
    for (int64_t d = 0; d < dim; ++d) w[d] = w[d] - lr * g[d];
  }
};

struct Adagrad {  // SPEC §2.4: no epsilon.
  static constexpr int kSlots = 1;
  static void Row(float* w, float* const* s, const float* g, int64_t dim, float lr,
                  const Hyper&) {
    float* a = s[0];
    for (int64_t d = 0; d < dim; ++d) {
      a[d] = a[d] + g[d] * g[d];
      w[d] = w[d] - lr * g[d] / std::sqrt(a[d]);
    }
  }
};

struct Adam {  // SPEC §2.6, lazy: no bias correction.
  static constexpr int kSlots = 2;
  static void Row(float* w, float* const* s, const float* g, int64_t dim, float lr,
                  const Hyper& h) {
    float* m = s[0];
    float* v = s[1];
    for (int64_t d = 0; d < dim; ++d) {
      m[d] = h.beta1 * m[d] + h.one_minus_beta1 * g[d];
      v[d] = h.beta2 * v[d] + h.one_minus_beta2 * (g[d] * g[d]);
      const float denominator =
          h.sum_inside_sqrt ? std::sqrt(v[d] + h.epsilon) : std::sqrt(v[d]) + h.epsilon;
      w[d] = w[d] - lr * m[d] / denominator;
    }
  }
};

class ApplyRowsOp : public OpKernel {
 public:
  explicit ApplyRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule_));
    std::vector<float> values;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hyperparameters", &values));
    if (rule_ == "adam") {
      OP_REQUIRES(ctx, values.size() == 6,
                  InvalidArgument(
                      "adam takes 6 hyperparameters (beta1, 1 - beta1, beta2, 1 - beta2, "
                      "epsilon term, sum_inside_sqrt), got ", values.size()));
      hyper_ = {values[0], values[1], values[2], values[3], values[4], values[5] != 0};
    }
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_gradient_min", &clip_gradient_min_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_gradient_max", &clip_gradient_max_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("weight_decay", &weight_decay_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("weight_decay_by_learning_rate", &decay_by_lr_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_weight_min", &clip_weight_min_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_weight_max", &clip_weight_max_));
    const int expected = rule_ == "sgd" ? Sgd::kSlots : rule_ == "adagrad" ? Adagrad::kSlots
                                                                            : Adam::kSlots;
    OP_REQUIRES(ctx, num_slots_ == expected,
                InvalidArgument(rule_, " takes ", expected,
                                                      " slot variables, got ", num_slots_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int num_vars = num_slots_ + 1;
    std::vector<int> inputs(num_vars);
    for (int i = 0; i < num_vars; ++i) inputs[i] = i;
    std::unique_ptr<::tensorflow::VariableInputLockHolder> locks;
    std::vector<Tensor> vars;
    OP_REQUIRES_OK(ctx, LockFloatMatrices(ctx, inputs, &locks, &vars));
    for (int i = 1; i < num_vars; ++i) {
      OP_REQUIRES(ctx, vars[i].shape() == vars[0].shape(),
                  InvalidArgument(
                      "slot ", i - 1, " has shape ", vars[i].shape().DebugString(),
                      ", the table ", vars[0].shape().DebugString()));
    }
    const Tensor& ids = ctx->input(num_vars);
    const Tensor& grads = ctx->input(num_vars + 1);
    const Tensor& lr = ctx->input(num_vars + 2);
    const int64_t rows = vars[0].dim_size(0);
    const int64_t dim = vars[0].dim_size(1);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(ctx, ids.dims() == 1 && grads.dims() == 2 && grads.dim_size(0) == n &&
                         grads.dim_size(1) == dim && lr.dims() == 0,
                InvalidArgument(
                    "expected row_ids [U], gradients [U, ", dim, "] and a scalar learning "
                    "rate, got ", ids.shape().DebugString(), ", ",
                    grads.shape().DebugString(), ", ", lr.shape().DebugString()));
    const int64_t* id = ids.flat<int64_t>().data();
    for (int64_t u = 0; u < n; ++u) {
      OP_REQUIRES(ctx, id[u] >= 0 && id[u] < rows,
                  InvalidArgument("row id ", id[u], " is not in [0, ",
                                                        rows, ")"));
    }
    const int64_t twice = FirstRepeated(id, n, rows);
    OP_REQUIRES(ctx, twice < 0,
                InvalidArgument("row id ", twice, " appears more than once in row_ids: the "
                                "update takes unique rows (shards updating one row at once "
                                "would lose updates). Deduplicate them first, summing their "
                                "gradients (tf.unique and tf.math.unsorted_segment_sum); "
                                "nothing was written"));
    std::vector<float*> base(num_vars);
    for (int i = 0; i < num_vars; ++i) base[i] = vars[i].flat<float>().data();
    const float learning_rate = lr.scalar<float>()();
    const float* g = grads.flat<float>().data();
    if (rule_ == "sgd") {
      Run<Sgd>(ctx, base, id, g, n, dim, learning_rate);
    } else if (rule_ == "adagrad") {
      Run<Adagrad>(ctx, base, id, g, n, dim, learning_rate);
    } else {
      Run<Adam>(ctx, base, id, g, n, dim, learning_rate);
    }
  }

 private:
  template <typename Rule>
  void Run(OpKernelContext* ctx, const std::vector<float*>& base, const int64_t* id,
           const float* grads, int64_t n, int64_t dim, float lr) const {
    const bool clip_low = clip_gradient_min_ != -std::numeric_limits<float>::infinity();
    const bool clip_high = clip_gradient_max_ != std::numeric_limits<float>::infinity();
    const bool clip_weights = clip_weight_min_ != -std::numeric_limits<float>::infinity() ||
                              clip_weight_max_ != std::numeric_limits<float>::infinity();
    const float decay = decay_by_lr_ ? weight_decay_ * lr : weight_decay_;
    // Row ids are unique (the engine deduplicates them), so shards never share a row.
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> g(dim);
      float* slots[Rule::kSlots > 0 ? Rule::kSlots : 1];
      for (int64_t u = begin; u < end; ++u) {
        if (u + kPrefetchAhead < end) {
          for (size_t i = 0; i < base.size(); ++i) {
            __builtin_prefetch(base[i] + id[u + kPrefetchAhead] * dim, /*rw=*/1);
          }
        }
        const float* row_grads = grads + u * dim;
        for (int64_t d = 0; d < dim; ++d) {
          float x = row_grads[d];
          if (clip_low) x = std::max(x, clip_gradient_min_);
          if (clip_high) x = std::min(x, clip_gradient_max_);
          g[d] = x;
        }
        float* w = base[0] + id[u] * dim;
        for (int i = 0; i < Rule::kSlots; ++i) slots[i] = base[i + 1] + id[u] * dim;
        if (weight_decay_ != 0) {
          for (int64_t d = 0; d < dim; ++d) w[d] = w[d] - decay * w[d];
        }
        Rule::Row(w, slots, g.data(), dim, lr, hyper_);
        if (clip_weights) {
          for (int64_t d = 0; d < dim; ++d) {
            w[d] = std::min(std::max(w[d], clip_weight_min_), clip_weight_max_);
          }
        }
      }
    };
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    // Cost per row in cycles, roughly: a few cache misses per variable.
    const int64_t cost = 200 * static_cast<int64_t>(base.size()) + 10 * dim;
    ::tensorflow::Shard(workers->num_threads, workers->workers, n, cost, work);
  }

  int num_slots_ = 0;
  std::string rule_;
  Hyper hyper_;
  float clip_gradient_min_ = 0, clip_gradient_max_ = 0, weight_decay_ = 0;
  bool decay_by_lr_ = false;
  float clip_weight_min_ = 0, clip_weight_max_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingApplyRows").Device(DEVICE_CPU), ApplyRowsOp);

}  // namespace
}  // namespace tpu_embedding
