// Resets rows of a table and its slots to fresh initial values, in place, in one op.
//
// A managed table resets every row it gives to a new key (docs/managed-ids.md): the table's
// initializer draws the row, each slot gets its initial value. Done with TF's ops that is, per
// variable, a draw or a fill of [rows, dim] values and a scatter into the variable; in the
// managed benchmark (~1 200 rows of 16 a table and step) TF's truncated normal (~30 ns a value,
// Box-Muller with rejection) and its unprefetched scatter (~130 ns a row) cost more than the
// map itself. Here each row is drawn straight into its place in every variable, the rows ahead
// prefetched. Normal values come from a ziggurat sampler (Marsaglia and Tsang, 2000);
// truncated normal ones (TF's default table initializer) from the inverse of their CDF,
// tabulated at 4097 points and interpolated linearly: no branch, half the ziggurat's time, and
// a CDF within 3e-7 of the exact one.
//
// Determinism: each row of a call draws from its own generator, seeded from one block of the
// call's Philox stream (TF's generator) and the row's position in `rows`, so the values do not
// depend on how the rows are split over threads; seeds work as in TF's stateful random ops
// (both 0: random; a kernel's successive calls continue its stream).
#include <algorithm>
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

// The standard normal truncated to (-2, 2) as the inverse of its CDF: `x[i]` its quantile at
// i / kSegments (Newton's method on erfc, each from the previous point), ends pulled inside.
struct TruncatedQuantiles {
  static constexpr int kBits = 12;
  static constexpr int kSegments = 1 << kBits;
  float x[kSegments + 1];
  float dx[kSegments];  // x[i + 1] - x[i]

  TruncatedQuantiles() {
    auto cdf = [](double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); };
    const double low = cdf(-2.0), mass = cdf(2.0) - low;
    double z = -2.0;
    x[0] = std::nextafter(-2.0f, 0.0f);
    for (int i = 1; i < kSegments; ++i) {
      const double p = low + mass * i / kSegments;
      for (int step = 0; step < 50; ++step) {
        const double move = (cdf(z) - p) / (std::exp(-0.5 * z * z) / std::sqrt(2.0 * M_PI));
        z -= move;
        if (std::fabs(move) < 1e-13) break;
      }
      x[i] = static_cast<float>(z);
    }
    x[kSegments] = std::nextafter(2.0f, 0.0f);
    for (int i = 0; i < kSegments; ++i) dx[i] = x[i + 1] - x[i];
  }

  // Strictly inside (-2, 2): a + f * (b - a) with f < 1 rounds to at most b.
  float Draw(uint32_t u) const {
    const uint32_t i = u >> (32 - kBits);
    const float f = static_cast<float>(u & ((1u << (32 - kBits)) - 1)) *
                    (1.0f / static_cast<float>(1u << (32 - kBits)));
    return x[i] + f * dx[i];
  }
};

const TruncatedQuantiles& Quantiles() {
  static const TruncatedQuantiles* quantiles = new TruncatedQuantiles();
  return *quantiles;
}

// SplitMix64's finalizer: a bijection of 64 bits with full avalanche.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A row's 32-bit draws: xoshiro128** (Blackman and Vigna, 2018), its state the call's Philox
// block mixed with the row's position (distinct positions: distinct states). Philox's ten
// rounds cost ~5 ns a value here, more than the distributions, and a block per row as much
// again; xoshiro128** passes the same statistical test batteries at ~1 ns.
class Bits {
 public:
  Bits() = default;  // for rows drawing nothing: constants only

  Bits(const PhiloxRandom::ResultType& block, uint64_t position) {
    const uint64_t step = (position + 1) * 0x9E3779B97F4A7C15ULL;
    const uint64_t low = Mix64(((uint64_t{block[1]} << 32) | block[0]) + step);
    const uint64_t high = Mix64(((uint64_t{block[3]} << 32) | block[2]) ^ step);
    state_[0] = static_cast<uint32_t>(low);
    state_[1] = static_cast<uint32_t>(low >> 32);
    state_[2] = static_cast<uint32_t>(high);
    state_[3] = static_cast<uint32_t>(high >> 32);
    if ((low | high) == 0) state_[0] = 1;  // never all 0
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

// A standard normal draw.
inline float Normal(const Ziggurat& z, Bits& bits) {
  for (;;) {
    const uint32_t u = bits.Next();
    const int layer = u & 127;
    const bool negative = (u >> 7) & 1;
    const uint32_t magnitude = u >> 8;
    float x = static_cast<float>(magnitude) * z.w[layer];
    if (magnitude >= z.k[layer]) {
      if (layer == 0) {  // the base layer's tail, beyond r
        float t, y;
        do {
          t = -std::log(bits.Positive()) / static_cast<float>(Ziggurat::kTail);
          y = -std::log(bits.Positive());
        } while (y + y < t * t);
        x = static_cast<float>(Ziggurat::kTail) + t;
      } else if (z.f[layer] + bits.Uniform() * (z.f[layer - 1] - z.f[layer]) >=
                 std::exp(-0.5f * x * x)) {
        continue;
      }
    }
    return negative ? -x : x;
  }
}

enum class Kind { kConstant, kNormal, kTruncatedNormal, kUniform };

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
    PhiloxRandom::ResultType block;
    if (draws_) block = generator_.ReserveSamples128(1)();
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
        if (draws_) bits = Bits(block, static_cast<uint64_t>(r));
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
      case Kind::kNormal: {
        const Ziggurat& layers = Layers();
        Bits local = bits;  // kept in registers: `out` cannot alias it
        for (int64_t d = 0; d < dim; ++d) out[d] = a + b * Normal(layers, local);
        bits = local;
        return;
      }
      case Kind::kTruncatedNormal: {
        const TruncatedQuantiles& quantiles = Quantiles();
        Bits local = bits;
        for (int64_t d = 0; d < dim; ++d) out[d] = a + b * quantiles.Draw(local.Next());
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
