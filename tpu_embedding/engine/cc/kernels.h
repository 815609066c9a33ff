// What the engine's kernels share: TF's kernel API and the variable-locking helpers.
#ifndef TPU_EMBEDDING_ENGINE_CC_KERNELS_H_
#define TPU_EMBEDDING_ENGINE_CC_KERNELS_H_

#define EIGEN_USE_THREADS

#include <cstdint>
#include <memory>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
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

// Refuses, before any is locked, a resource input in `inputs` that is not a float32 variable:
// TF's locking helpers (`MaybeLockVariableInputMutexesInOrder<..., float>`) may copy a variable
// they lock as float32, which aborts the process for another dtype.
inline ::absl::Status RequireFloatVariables(OpKernelContext* ctx, const std::vector<int>& inputs) {
  for (const int i : inputs) {
    ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
    TF_RETURN_IF_ERROR(
        ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, i), &var));
    const ::tensorflow::DataType dtype = var->tensor()->dtype();
    if (dtype != ::tensorflow::DT_FLOAT) {
      return InvalidArgument("variable input ", i, " must be float32, got ",
                             ::tensorflow::DataTypeString(dtype));
    }
  }
  return ::absl::OkStatus();
}

// Locks the variable inputs `inputs` (exclusively, in TF's order, ready for in-place sparse
// writes; `*locks` holds them) and reads each as a float32 matrix into `(*vars)[k]`; errors
// count the variables from 0, in the order of `inputs`.
inline ::absl::Status LockFloatMatrices(
    OpKernelContext* ctx, const std::vector<int>& inputs,
    std::unique_ptr<::tensorflow::VariableInputLockHolder>* locks, std::vector<Tensor>* vars) {
  TF_RETURN_IF_ERROR(RequireFloatVariables(ctx, inputs));
  *locks = std::make_unique<::tensorflow::VariableInputLockHolder>(
      ::tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
          ctx, /*do_lock=*/true, /*sparse=*/true, inputs));
  vars->resize(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    Tensor& var = (*vars)[k];
    TF_RETURN_IF_ERROR(::tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
        ctx, inputs[k], /*lock_held=*/true, /*sparse=*/true, &var));
    if (var.dtype() != ::tensorflow::DT_FLOAT || var.dims() != 2) {
      return InvalidArgument("variable ", k, " must be a float32 matrix, got ",
                             ::tensorflow::DataTypeString(var.dtype()), " ",
                             var.shape().DebugString());
    }
  }
  return ::absl::OkStatus();
}

// Rows ahead whose memory is prefetched while the current one is processed: enough to cover
// memory latency (~100 ns) at a few ns of work per row.
constexpr int64_t kPrefetchAhead = 12;

}  // namespace tpu_embedding

#endif  // TPU_EMBEDDING_ENGINE_CC_KERNELS_H_
