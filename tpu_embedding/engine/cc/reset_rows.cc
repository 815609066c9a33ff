// Resets rows of a table and its slots to fresh initial values, in place, in one op.
//
// A managed table resets every row it gives to a new key (docs/managed-ids.md): the table's
// initializer draws the row, each slot gets its initial value. Done with TF's ops that is, per
// variable, a draw or a fill of [rows, dim] values and a scatter into the variable; in the
// managed benchmark (~1 200 rows of 16 a table and step) TF's truncated normal (~30 ns a value,
// Box-Muller with rejection) and its unprefetched scatter (~130 ns a row) cost more than the
// map itself. Here each row is drawn straight into its place in every variable, the rows ahead
// prefetched, with a ziggurat sampler (Marsaglia and Tsang, 2000).
//
// Determinism: each row of a call draws from its own generator, seeded by the block of the
// call's Philox stream (TF's generator) that its position in `rows` picks, so the values do
// not depend on how the rows are split over threads; seeds work as in TF's stateful random ops
// (both 0: random; a kernel's successive calls continue its stream).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tpu_embedding/engine/cc/kernels.h"  // first: it sets up Eigen's thread pool
#include "tensorflow/core/util/guarded_philox_random.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tpu_embedding {
namespace {

using ::tensorflow::random::PhiloxRandom;

REGISTER_OP("TpuEmbeddingResetRows")
    .Input("rows: int64")
    .Input("variables: num_variables * resource")
    .Attr("num_variables: int >= 1")
    .Attr("kinds: list({'constant', 'normal', 'truncated_normal', 'uniform'})")
    .Attr("first: list(float)")
    .Attr("second: list(float)")
    .Attr("seed: int = 0")
    .Attr("seed2: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Writes fresh values into `rows` of every variable, in place. The variables are float32
matrices with the same number of rows; `rows` are distinct (a repeated row may end up with a
mix of its draws). Variable i is filled by kinds[i]:
'constant' first[i]; 'normal' and 'truncated_normal' (truncated at 2 standard deviations, as
tf.random.truncated_normal) with mean first[i] and standard deviation second[i]; 'uniform' in
[first[i], second[i]).
)doc");

// 128-layer ziggurat for the standard normal on 24-bit magnitudes (Marsaglia and Tsang's
// construction; the layer, the sign and the magnitude come from separate bits of one draw).
struct Ziggurat {
  static constexpr double kTail = 3.442619855899;  // r: where the base layer's tail begins
  static constexpr double kArea = 9.91256303526217e-3;  // v: every layer's area
  static constexpr double kScale = 16777216.0;  // 2^24
  uint32_t k[128];  // a magnitude below k[i] lies wholly under the curve in layer i
  float w[128];     // magnitude -> x in layer i
  float f[128];     // the density exp(-x^2/2) at layer i's edge

  Ziggurat() {
    double x = kTail, previous = kTail;
    const double q = kArea / std::exp(-0.5 * x * x);
    k[0] = static_cast<uint32_t>((x / q) * kScale);
    k[1] = 0;
    w[0] = static_cast<float>(q / kScale);
    w[127] = static_cast<float>(x / kScale);
    f[0] = 1.0f;
    f[127] = static_cast<float>(std::exp(-0.5 * x * x));
    for (int i = 126; i >= 1; --i) {
      x = std::sqrt(-2.0 * std::log(kArea / x + std::exp(-0.5 * x * x)));
      k[i + 1] = static_cast<uint32_t>((x / previous) * kScale);
      previous = x;
      f[i] = static_cast<float>(std::exp(-0.5 * x * x));
      w[i] = static_cast<float>(x / kScale);
    }
  }
};

const Ziggurat& Layers() {
  static const Ziggurat* layers = new Ziggurat();
  return *layers;
}

// A row's 32-bit draws: xoshiro128** (Blackman and Vigna, 2018), its state one block of the
// row's Philox sub-stream. Philox's ten rounds cost ~5 ns a value here, more than the
// distributions; xoshiro128** passes the same statistical test batteries at ~1 ns.
class Bits {
 public:
  Bits() = default;  // for rows drawing nothing: constants only

  explicit Bits(PhiloxRandom generator) {
    const PhiloxRandom::ResultType block = generator();
    for (int i = 0; i < 4; ++i) state_[i] = block[i];
    if ((state_[0] | state_[1] | state_[2] | state_[3]) == 0) state_[0] = 1;  // never all 0
  }

  uint32_t Next() {
    const uint32_t result = Rotate(state_[1] * 5, 7) * 9;
    const uint32_t t = state_[1] << 9;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = Rotate(state_[3], 11);
    return result;
  }

  // Uniform in [0, 1), 24 bits.
  float Uniform() { return static_cast<float>(Next() >> 8) * (1.0f / 16777216.0f); }

  // Uniform in (0, 1], for logarithms.
  float Positive() { return static_cast<float>((Next() >> 8) + 1) * (1.0f / 16777216.0f); }

 private:
  static uint32_t Rotate(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }

  uint32_t state_[4] = {1, 0, 0, 0};
};

// A standard normal draw; `truncated`: redrawn until it lies in (-2, 2).
inline float Normal(const Ziggurat& z, Bits& bits, bool truncated) {
  for (;;) {
    const uint32_t u = bits.Next();
    const int layer = u & 127;
    const bool negative = (u >> 7) & 1;
    const uint32_t magnitude = u >> 8;
    float x = static_cast<float>(magnitude) * z.w[layer];
    bool accepted = magnitude < z.k[layer];
    if (!accepted && layer == 0) {
      if (truncated) continue;  // the tail lies beyond r > 2
      float t, y;
      do {
        t = -std::log(bits.Positive()) / static_cast<float>(Ziggurat::kTail);
        y = -std::log(bits.Positive());
      } while (y + y < t * t);
      x = static_cast<float>(Ziggurat::kTail) + t;
      accepted = true;
    } else if (!accepted) {
      accepted = z.f[layer] + bits.Uniform() * (z.f[layer - 1] - z.f[layer]) <
                 std::exp(-0.5f * x * x);
    }
    if (!accepted || (truncated && x >= 2.0f)) continue;
    return negative ? -x : x;
  }
}

enum class Kind { kConstant, kNormal, kTruncatedNormal, kUniform };

// Each row seeds its generator from its own block of the call's Philox stream.

// Resets cheaper than this (cycles, ~1 ms) run in the calling thread.
constexpr int64_t kInlineCycles = int64_t{1} << 22;

class ResetRowsOp : public OpKernel {
 public:
  explicit ResetRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &num_variables_));
    std::vector<std::string> kinds;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kinds", &kinds));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("first", &first_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("second", &second_));
    OP_REQUIRES(ctx, kinds.size() == static_cast<size_t>(num_variables_) &&
                         first_.size() == kinds.size() && second_.size() == kinds.size(),
                InvalidArgument("expected one kind, first and second value for each of ",
                                num_variables_, " variables; got ", kinds.size(), ", ",
                                first_.size(), " and ", second_.size()));
    for (const std::string& kind : kinds) {
      kinds_.push_back(kind == "constant"           ? Kind::kConstant
                       : kind == "normal"           ? Kind::kNormal
                       : kind == "truncated_normal" ? Kind::kTruncatedNormal
                                                    : Kind::kUniform);
      draws_ = draws_ || kinds_.back() != Kind::kConstant;
    }
    // Only ops that draw need seeds (under op determinism, TF refuses unseeded generators).
    if (draws_) OP_REQUIRES_OK(ctx, generator_.Init(ctx));
  }

  void Compute(OpKernelContext* ctx) override {
    std::vector<int> inputs(num_variables_);
    for (int i = 0; i < num_variables_; ++i) inputs[i] = i + 1;
    std::unique_ptr<::tensorflow::VariableInputLockHolder> locks;
    std::vector<Tensor> vars;
    OP_REQUIRES_OK(ctx, LockFloatMatrices(ctx, inputs, &locks, &vars));
    for (int i = 1; i < num_variables_; ++i) {
      OP_REQUIRES(ctx, vars[i].dim_size(0) == vars[0].dim_size(0),
                  InvalidArgument("variable ", i, " has shape ", vars[i].shape().DebugString(),
                                  ", variable 0 ", vars[0].shape().DebugString(),
                                  ": every variable needs the same rows"));
    }
    const Tensor& rows_tensor = ctx->input(0);
    OP_REQUIRES(ctx, rows_tensor.dims() == 1,
                InvalidArgument("rows must be a vector, got ",
                                rows_tensor.shape().DebugString()));
    const int64_t num_rows = vars[0].dim_size(0);
    const int64_t n = rows_tensor.NumElements();
    const int64_t* rows = rows_tensor.flat<int64_t>().data();
    for (int64_t r = 0; r < n; ++r) {
      OP_REQUIRES(ctx, rows[r] >= 0 && rows[r] < num_rows,
                  InvalidArgument("row ", rows[r], " is not in [0, ", num_rows, ")"));
    }
    if (n == 0) return;
    std::vector<float*> base(num_variables_);
    std::vector<int64_t> width(num_variables_);
    int64_t row_floats = 0;
    for (int i = 0; i < num_variables_; ++i) {
      base[i] = vars[i].flat<float>().data();
      width[i] = vars[i].dim_size(1);
      row_floats += width[i];
    }
    const PhiloxRandom stream = draws_ ? generator_.ReserveSamples128(n) : PhiloxRandom();
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (r + kPrefetchAhead < end) {
          const int64_t ahead = rows[r + kPrefetchAhead];
          for (int i = 0; i < num_variables_; ++i) {
            const float* row = base[i] + ahead * width[i];
            for (int64_t d = 0; d < width[i]; d += 16) __builtin_prefetch(row + d, /*rw=*/1);
          }
        }
        Bits bits;
        if (draws_) {
          PhiloxRandom generator = stream;
          generator.Skip(static_cast<uint64_t>(r));
          bits = Bits(generator);
        }
        for (int i = 0; i < num_variables_; ++i) {
          Draw(i, bits, base[i] + rows[r] * width[i], width[i]);
        }
      }
    };
    // Cycles per row, roughly: a cache miss per variable, a few per value drawn. A reset of a
    // few thousand rows runs in this thread: a training step runs its tables' resets side by
    // side already, and handing halves to other threads costs more than it saves.
    const int64_t cost = 200 * num_variables_ + (draws_ ? 30 : 2) * row_floats;
    if (n * cost < kInlineCycles) {
      work(0, n);
      return;
    }
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    ::tensorflow::Shard(workers->num_threads, workers->workers, n, cost, work);
  }

 private:
  void Draw(int i, Bits& bits, float* out, int64_t dim) const {
    const float a = first_[i], b = second_[i];
    switch (kinds_[i]) {
      case Kind::kConstant:
        for (int64_t d = 0; d < dim; ++d) out[d] = a;
        return;
      case Kind::kNormal:
      case Kind::kTruncatedNormal: {
        const bool truncated = kinds_[i] == Kind::kTruncatedNormal;
        const Ziggurat& layers = Layers();
        Bits local = bits;  // kept in registers: `out` cannot alias it
        for (int64_t d = 0; d < dim; ++d) out[d] = a + b * Normal(layers, local, truncated);
        bits = local;
        return;
      }
      case Kind::kUniform: {
        Bits local = bits;
        // a + (b - a) * u can round up to b when |a| >> b - a: kept below it.
        const float below = std::nextafter(b, a);
        for (int64_t d = 0; d < dim; ++d) out[d] = std::min(a + (b - a) * local.Uniform(), below);
        bits = local;
        return;
      }
    }
  }

  int num_variables_ = 0;
  std::vector<Kind> kinds_;
  bool draws_ = false;  // some variable draws random values
  std::vector<float> first_, second_;
  ::tensorflow::GuardedPhiloxRandom generator_;
};

REGISTER_KERNEL_BUILDER(Name("TpuEmbeddingResetRows").Device(DEVICE_CPU), ResetRowsOp);

}  // namespace
}  // namespace tpu_embedding
