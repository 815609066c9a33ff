// Initial values of rows given to new keys (managed ids), drawn in the calling thread.
//
// A managed table resets every row it gives to a new key to what its initializer would draw
// (docs/managed-ids.md). With the default initializer, a truncated normal, TF's own op spent
// ~33 ns a value here, sharding each small draw over the thread pool, and the draws were the
// largest part of a managed step: 16 values a row, ~1 200 rows a table and step in the
// benchmark. This op draws with TF's own generator (Philox, seeded as TF's random ops are) and
// TF's own truncated-normal distribution, so the values follow exactly TF's distribution, at
// about half the cost and one thread.
#include "tensorflow/core/lib/random/random_distributions.h"
#include "tensorflow/core/util/guarded_philox_random.h"
#include "tpu_embedding/engine/cc/kernels.h"

namespace tpu_embedding {
namespace {

using ::tensorflow::random::PhiloxRandom;
using ::tensorflow::random::SingleSampleAdapter;
using ::tensorflow::random::TruncatedNormalDistribution;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("TpuEmbeddingTruncatedNormal")
    .Input("shape: int64")
    .Input("mean: float")
    .Input("stddev: float")
    .Attr("seed: int = 0")
    .Attr("seed2: int = 0")
    .Output("values: float")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(0, &shape));
      c->set_output(0, shape);
      return absl::OkStatus();
    })
    .Doc(R"doc(
`mean + stddev * x` for each value, x drawn from the standard normal distribution truncated to
[-2, 2] (as tf.random.truncated_normal draws). Seeds as TF's random ops: both 0 picks them at
random; the values differ at every run of the op.
)doc");

class TruncatedNormalOp : public OpKernel {
 public:
  explicit TruncatedNormalOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, generator_.Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& shape_tensor = ctx->input(0);
    OP_REQUIRES(ctx, shape_tensor.dims() == 1,
                InvalidArgument("shape must be a vector, got ", shape_tensor.DebugString()));
    TensorShape shape;
    OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape(shape_tensor.vec<int64_t>(), &shape));
    const float mean = ctx->input(1).scalar<float>()();
    const float stddev = ctx->input(2).scalar<float>()();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    float* values = out->flat<float>().data();
    const int64_t n = out->NumElements();
    using Distribution = TruncatedNormalDistribution<SingleSampleAdapter<PhiloxRandom>, float>;
    // As TF's own op reserves: at most 256 samples of the generator for each value.
    PhiloxRandom philox = generator_.ReserveRandomOutputs(n, 256);
    SingleSampleAdapter<PhiloxRandom> samples(&philox);
    Distribution distribution;
    for (int64_t i = 0; i < n; i += Distribution::kResultElementCount) {
      const auto drawn = distribution(&samples);
      const int64_t count = std::min<int64_t>(Distribution::kResultElementCount, n - i);
      for (int64_t j = 0; j < count; ++j) values[i + j] = mean + stddev * drawn[j];
    }
  }

 private:
  ::tensorflow::GuardedPhiloxRandom generator_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingTruncatedNormal").Device(DEVICE_CPU), TruncatedNormalOp);

}  // namespace
}  // namespace tpu_embedding
