// What the engine's kernels share: TF's kernel API and the variable-locking helpers.
#ifndef TPU_EMBEDDING_ENGINE_CC_KERNELS_H_
#define TPU_EMBEDDING_ENGINE_CC_KERNELS_H_

#define EIGEN_USE_THREADS

#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tpu_embedding {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using CPUDevice = ::Eigen::ThreadPoolDevice;

// Rows ahead whose memory is prefetched while the current one is processed: enough to cover
// memory latency (~100 ns) at a few ns of work per row.
constexpr int64_t kPrefetchAhead = 12;

}  // namespace tpu_embedding

#endif  // TPU_EMBEDDING_ENGINE_CC_KERNELS_H_
