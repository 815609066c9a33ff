// A training step's lookup of one table, and its row gradients, as two kernels.
//
// With TF's ops the lookup is tf.unique, a gather of the unique rows, and a sparse-dense matmul
// that combines them into bags; the backward pass builds the same sparse matrix again for its
// transpose. Here one pass deduplicates the ids with an open-addressing hash table and adds each
// occurrence's row (prefetched) into its sample's activation, and one pass sums each occurrence's
// gradient into its unique row. Unique ids keep tf.unique's order (first occurrence) and sums
// run in occurrence order, as TF's kernels do.
#include <algorithm>
#include <limits>
#include <vector>

#include "tpu_embedding/engine/cc/kernels.h"

namespace tpu_embedding {
namespace {

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TpuEmbeddingDedupLookup")
    .Input("table: resource")
    .Input("ids: int64")
    .Input("samples: int64")
    .Input("gains: float")
    .Input("num_samples: int64")
    .Output("activations: float")
    .Output("unique_ids: int64")
    .Output("index: int64")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(InferenceContext::kUnknownDim, InferenceContext::kUnknownDim));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(2, c->input(1));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Deduplicates `ids` and combines their rows of `table` into `num_samples` activations:
activations[samples[k]] += gains[k] * table[ids[k]]. Empty `samples` means sample k is
occurrence k; empty `gains` means every gain is 1. unique_ids[index[k]] == ids[k].
)doc");

REGISTER_OP("TpuEmbeddingRowGradients")
    .Input("index: int64")
    .Input("samples: int64")
    .Input("gains: float")
    .Input("upstream: float")
    .Input("num_unique: int64")
    .Output("row_gradients: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(InferenceContext::kUnknownDim, c->Dim(c->input(3), 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The transpose of the lookup's combine: row_gradients[index[k]] += gains[k] *
upstream[samples[k]], with `samples` and `gains` as in TpuEmbeddingDedupLookup.
)doc");

// The optional per-occurrence inputs: sample k and gain k, or their defaults.
struct Occurrences {
  const int64_t* samples = nullptr;
  const float* gains = nullptr;
  int64_t sample(int64_t k) const { return samples ? samples[k] : k; }
  float gain(int64_t k) const { return gains ? gains[k] : 1.0f; }
};

// Checks `samples` and `gains` (each empty or one per occurrence) and the samples' range.
absl::Status ReadOccurrences(const Tensor& samples, const Tensor& gains, int64_t n,
                             int64_t num_samples, Occurrences* out) {
  if (samples.NumElements() != 0) {
    if (samples.NumElements() != n) {
      return InvalidArgument("samples must be empty or hold one entry per id (", n, "), got ",
                             samples.NumElements());
    }
    out->samples = samples.flat<int64_t>().data();
    for (int64_t k = 0; k < n; ++k) {
      if (out->samples[k] < 0 || out->samples[k] >= num_samples) {
        return InvalidArgument("sample ", out->samples[k], " is not in [0, ", num_samples, ")");
      }
    }
  } else if (n > num_samples) {
    return InvalidArgument(n, " ids are their own samples but num_samples is ", num_samples);
  }
  if (gains.NumElements() != 0) {
    if (gains.NumElements() != n) {
      return InvalidArgument("gains must be empty or hold one entry per id (", n, "), got ",
                             gains.NumElements());
    }
    out->gains = gains.flat<float>().data();
  }
  return absl::OkStatus();
}

// The count given as the scalar input `index`: a number of rows to allocate, which the engine
// keeps below 2**31 (samples and rows are int32 coordinates in its sparse matrices).
absl::Status ReadCount(OpKernelContext* ctx, int index, const char* name, int64_t* out) {
  const Tensor& input = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(input.shape())) {
    return InvalidArgument(name, " must be a scalar, got shape ", input.shape().DebugString());
  }
  *out = input.scalar<int64_t>()();
  if (*out < 0 || *out > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument(name, " must be in [0, 2**31), got ", *out);
  }
  return absl::OkStatus();
}

// The [count, dim] output shape, or an error where it cannot be a tensor's shape.
absl::Status RowsShape(const char* name, int64_t count, int64_t dim, TensorShape* out) {
  absl::Status status = TensorShape::BuildTensorShape({count, dim}, out);
  if (!status.ok()) {
    return InvalidArgument(name, " (", count, ") rows of ", dim,
                           " values cannot be allocated: ", status.message());
  }
  return absl::OkStatus();
}

// Open addressing with linear probing over a power-of-two table at most half full; each slot
// keeps its id and that id's position side by side, so a probe touches one cache line.
class IdDeduplicator {
 public:
  explicit IdDeduplicator(int64_t n) {
    int64_t capacity = 16;
    int bits = 4;
    while (capacity < 2 * n) {
      capacity *= 2;
      ++bits;
    }
    shift_ = 64 - bits;
    mask_ = capacity - 1;
    slots_.assign(capacity, Slot{-1, 0});  // ids are checked to be >= 0
    unique_.reserve(n);
  }

  // The position of `id` among the unique ids, adding it if new.
  int64_t Find(int64_t id) {
    uint64_t at = (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift_;
    while (true) {
      Slot& slot = slots_[at];
      if (slot.id == id) return slot.position;
      if (slot.id < 0) {
        slot = Slot{id, static_cast<int64_t>(unique_.size())};
        unique_.push_back(id);
        return slot.position;
      }
      at = (at + 1) & mask_;
    }
  }

  const std::vector<int64_t>& unique() const { return unique_; }

 private:
  struct Slot {
    int64_t id;
    int64_t position;
  };
  int shift_;
  uint64_t mask_;
  std::vector<Slot> slots_;
  std::vector<int64_t> unique_;
};

class DedupLookupOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, RequireFloatVariables(ctx, {0}));
    auto lock = ::tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/false, /*sparse=*/true, {0});
    Tensor table;
    OP_REQUIRES_OK(ctx, ::tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 0, /*lock_held=*/false, /*sparse=*/true, &table));
    OP_REQUIRES(ctx, table.dtype() == ::tensorflow::DT_FLOAT && table.dims() == 2,
                InvalidArgument("the table must be a float32 matrix, got ",
                                ::tensorflow::DataTypeString(table.dtype()), " ",
                                table.shape().DebugString()));
    const Tensor& ids = ctx->input(1);
    const int64_t n = ids.NumElements();
    const int64_t rows = table.dim_size(0), dim = table.dim_size(1);
    int64_t num_samples = 0;
    OP_REQUIRES_OK(ctx, ReadCount(ctx, 4, "num_samples", &num_samples));
    TensorShape activations_shape;
    OP_REQUIRES_OK(ctx, RowsShape("num_samples", num_samples, dim, &activations_shape));
    Occurrences occurrences;
    OP_REQUIRES_OK(ctx, ReadOccurrences(ctx->input(2), ctx->input(3), n, num_samples,
                                        &occurrences));
    const int64_t* id = ids.flat<int64_t>().data();
    Tensor* index = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, ids.shape(), &index));
    int64_t* position = index->flat<int64_t>().data();
    for (int64_t k = 0; k < n; ++k) {
      OP_REQUIRES(ctx, id[k] >= 0 && id[k] < rows,
                  InvalidArgument("id ", id[k], " is not in [0, ", rows, ")"));
    }
    Tensor* activations = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, activations_shape, &activations));
    float* out = activations->flat<float>().data();
    const float* values = table.flat<float>().data();
    // One pass: while the next rows are fetched from memory, hash this id and combine its row.
    IdDeduplicator deduplicator(n);
    const bool one_hot = occurrences.samples == nullptr && occurrences.gains == nullptr;
    if (!one_hot) std::fill(out, out + num_samples * dim, 0.0f);
    for (int64_t k = 0; k < n; ++k) {
      if (k + kPrefetchAhead < n) __builtin_prefetch(values + id[k + kPrefetchAhead] * dim);
      position[k] = deduplicator.Find(id[k]);
      const float* row = values + id[k] * dim;
      if (one_hot) {  // sample k is occurrence k, gain 1: a copy
        std::copy_n(row, dim, out + k * dim);
        continue;
      }
      float* target = out + occurrences.sample(k) * dim;
      const float gain = occurrences.gain(k);
      for (int64_t d = 0; d < dim; ++d) target[d] += gain * row[d];
    }
    if (one_hot) std::fill(out + n * dim, out + num_samples * dim, 0.0f);
    const std::vector<int64_t>& unique = deduplicator.unique();
    Tensor* unique_ids = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({static_cast<int64_t>(unique.size())}), &unique_ids));
    std::copy(unique.begin(), unique.end(), unique_ids->flat<int64_t>().data());
  }
};

class RowGradientsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& index = ctx->input(0);
    const Tensor& upstream = ctx->input(3);
    const int64_t n = index.NumElements();
    int64_t num_unique = 0;
    OP_REQUIRES_OK(ctx, ReadCount(ctx, 4, "num_unique", &num_unique));
    OP_REQUIRES(ctx, upstream.dims() == 2,
                InvalidArgument("upstream must be a matrix, got ",
                                upstream.shape().DebugString()));
    const int64_t num_samples = upstream.dim_size(0), dim = upstream.dim_size(1);
    Occurrences occurrences;
    OP_REQUIRES_OK(ctx, ReadOccurrences(ctx->input(1), ctx->input(2), n, num_samples,
                                        &occurrences));
    TensorShape result_shape;
    OP_REQUIRES_OK(ctx, RowsShape("num_unique", num_unique, dim, &result_shape));
    Tensor* result = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, result_shape, &result));
    float* out = result->flat<float>().data();
    std::fill(out, out + num_unique * dim, 0.0f);
    const int64_t* position = index.flat<int64_t>().data();
    const float* grads = upstream.flat<float>().data();
    for (int64_t k = 0; k < n; ++k) {
      OP_REQUIRES(ctx, position[k] >= 0 && position[k] < num_unique,
                  InvalidArgument("index ", position[k], " is not in [0, ", num_unique, ")"));
      const float* source = grads + occurrences.sample(k) * dim;
      float* target = out + position[k] * dim;
      const float gain = occurrences.gain(k);
      for (int64_t d = 0; d < dim; ++d) target[d] += gain * source[d];
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingDedupLookup").Device(DEVICE_CPU), DedupLookupOp);
REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingRowGradients").Device(DEVICE_CPU), RowGradientsOp);

}  // namespace
}  // namespace tpu_embedding
