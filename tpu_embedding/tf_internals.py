"""Every other TensorFlow internal the package uses, and what differs between TF versions.

TF has no public API for these; each is one name or function here, so that a TF upgrade that
moves one fails here (`tests/test_tf_internals.py` exercises each) and not in a user's model.
Checked against the TF versions in `tf_versions.CHECKED_AGAINST`; importing this module under
another TF raises `tf_versions.UncheckedTensorFlow`. The mid-level objects' variables and the
restore machinery have their own adapters (`tf_mid_level`, `tf_restore`).

What differs between the checked versions: TF 2.15 to 2.17 have no mid-level
`CustomOptimizer` (`CUSTOM_OPTIMIZER` is None there); TF 2.15 and 2.16 have no SparseCore
checkpoint adapter, without which the SparseCore path cannot restore its stacked tables safely
(`SPARSE_CORE_CHECKPOINTS` is None, and the path is refused there); TF 2.15 has no SparseCore at
all (`HAS_SPARSE_CORE` is False: no `TPUEmbeddingV2`, no layouts to read, so a checkpoint holding
SparseCore-stacked tables is refused rather than read).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2
from tensorflow.python.eager import context, record
from tensorflow.python.framework import config as tf_config
from tensorflow.python.framework import kernels
from tensorflow.python.ops import control_flow_util, resource_variable_ops
from tensorflow.python.saved_model import save_context
from tensorflow.python.trackable import autotrackable, trackable_utils
from tensorflow.python.util import nest

from tpu_embedding import tf_versions

tf_versions.require_checked(__name__)

try:  # TF 2.16 on: SparseCore (TPUEmbeddingV2), its table layouts and TF's functions undoing them.
  from tensorflow.core.tpu.kernels import sparse_core_layout_pb2
  from tensorflow.python.tpu import tpu_embedding_v3, tpu_embedding_v3_utils
except ImportError:  # TF 2.15
  sparse_core_layout_pb2 = tpu_embedding_v3 = tpu_embedding_v3_utils = None
HAS_SPARSE_CORE = tpu_embedding_v3_utils is not None
try:  # TF 2.17 on: converts checkpoints between per-table and SparseCore's stacked layouts.
  from tensorflow.python.tpu import tpu_embedding_v3_checkpoint_adapter as SPARSE_CORE_CHECKPOINTS
except ImportError:  # TF 2.15, 2.16
  SPARSE_CORE_CHECKPOINTS = None

_embedding = tf.tpu.experimental.embedding

# A trackable whose children may have any name (table names, `<table>/<slot>`, feature paths).
AutoTrackable = autotrackable.AutoTrackable
# A variable of several row blocks (from a `variable_partitioner`).
ShardedVariable = tf.__internal__.distribute.ShardedVariable
# V1's `low_dimensional_packing_status` values.
PackingStatus = optimization_parameters_pb2.LowDimensionalPackingStatus.Status
# The mid-level optimizer that runs a user's per-row function; None where TF lacks it (2.16, 2.17).
CUSTOM_OPTIMIZER: Optional[type] = getattr(_embedding, "CustomOptimizer", None)
# SparseCore's per-table limits; None before TF 2.17 (2.16's TPUEmbeddingV2 takes none).
SPARSE_CORE_CONFIG: Optional[type] = getattr(_embedding, "SparseCoreEmbeddingConfig", None)
# ---------------------------------------------------------------------------------------------
# Nests: path-aware flattening in tf.nest's order, and structure-up-to maps.


def flatten_with_paths(structure: Any, expand_composites: bool = False) -> list[tuple[str, Any]]:
  """[(path joined by "/", leaf)] in `tf.nest.flatten` order."""
  return nest.flatten_with_joined_string_paths(structure, expand_composites=expand_composites)


def flatten_up_to(shallow: Any, structure: Any) -> list[Any]:
  """`structure` flattened down to the leaves of `shallow` (list/tuple types not compared)."""
  return nest.flatten_up_to(shallow, structure, check_types=False)


def map_structure_up_to(shallow: Any, fn: Callable, structure: Any) -> Any:
  """`fn` applied to each subtree of `structure` at a leaf of `shallow`."""
  return nest.map_structure_up_to(shallow, fn, structure, check_types=False)


# ---------------------------------------------------------------------------------------------
# Where code runs: saving, tapes, XLA, this process's devices and kernels.


def object_graph(serialized: bytes) -> Any:
  """A checkpoint's object graph (its `_CHECKPOINTABLE_OBJECT_GRAPH` tensor), parsed."""
  return trackable_object_graph_pb2.TrackableObjectGraph.FromString(serialized)


def in_save_context() -> bool:
  """Whether a SavedModel is being traced."""
  return save_context.in_save_context()


def untraced_copy(function: Any) -> Any:
  """A `tf.function` like `function` (same Python function and options) with no traces yet."""
  return function._clone(python_function=None)


def saved_as_trainable(variable: Any) -> None:
  """Makes SavedModels hold `variable` (trainable=False) as trainable, so that a reloaded model
  lets a `GradientTape` watch it as a plain trainable variable (TF writes the flag in the
  variable's object proto, which `tf.saved_model.save` asks the variable itself to write)."""
  write = variable._write_object_proto

  def write_trainable(proto: Any, options: Any) -> None:
    write(proto, options)
    proto.variable.trainable = True

  variable._write_object_proto = write_trainable


def could_possibly_record() -> bool:
  """Whether a gradient tape may be recording what runs now."""
  return record.could_possibly_record()


def adds_control_dependencies() -> bool:
  """Whether TF adds automatic control dependencies to the ops built now (a `tf.function`'s
  body, and the backward functions TF traces for functions called inside one): they then run
  every stateful op, in program order per resource."""
  if tf.executing_eagerly():
    return False
  return bool(tf.compat.v1.get_default_graph()._add_control_dependencies)


def compiling_with_xla() -> bool:
  """Whether XLA compiles the graph being built (a TPU step or a `jit_compile` function)."""
  return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def global_seed() -> Optional[int]:
  """The global random seed where ops are being made (eagerly: the context's; in a graph: the
  graph's), read without consuming an op seed as `tf.compat.v1.get_seed` does."""
  if tf.executing_eagerly():
    return context.global_seed()
  return tf.compat.v1.get_default_graph().seed


def op_determinism_enabled() -> bool:
  """Whether `tf.config.experimental.enable_op_determinism` is on (TF then refuses unseeded
  random ops)."""
  return tf_config.is_op_determinism_enabled()


def host_address_space() -> str:
  """The device name prefix of this process's task, e.g. "/job:worker/replica:0/task:1"."""
  return context.context().host_address_space()


def kernel_device_types(op: str) -> set[str]:
  """The device types with a registered kernel for the op type `op`."""
  return {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}


@contextlib.contextmanager
def undistributed_variables() -> Iterator[None]:
  """Variables created within are plain resource variables of the current device, even under a
  strategy's scope (whose variable creator would mirror them): state that one copy holds. They
  still count as the strategy's own (`variable_created_in_scope`, which Keras checks of every
  variable of a model compiled in the scope)."""
  strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None

  def create(next_creator: Callable, **kwargs: Any) -> tf.Variable:
    del next_creator  # the strategy's creator and those below it are skipped
    kwargs["distribute_strategy"] = strategy
    return resource_variable_ops.default_variable_creator_v2(None, **kwargs)

  with tf.variable_creator_scope(create):
    yield


def uninitialized_variable(**kwargs: Any) -> tf.Variable:
  """A resource variable with no value yet (assign before reading): no initial value in memory."""
  return resource_variable_ops.UninitializedVariable(**kwargs)


# ---------------------------------------------------------------------------------------------
# Mid-level optimizers' slots.


def slot_names(optimizer: Any) -> list[str]:
  """The slot names of a mid-level optimizer, in its order."""
  return list(optimizer._slot_names())


def slot_initializers(optimizer: Any) -> list[Callable]:
  """The initializer of each slot of a mid-level optimizer, in `slot_names` order."""
  return list(optimizer._slot_initializers())


# ---------------------------------------------------------------------------------------------
# SparseCore's layouts and checkpoints.

# The name under which a SparseCore layer saves its layouts: TF's constant (the same string on
# every checked version; TF 2.15 has no SparseCore, but may meet a checkpoint a later TF wrote).
SPARSE_CORE_LAYOUTS_KEY = "_sparse_core_table_layouts"


class NoSparseCore(ValueError):
  """This TensorFlow cannot read SparseCore's table layouts (TF 2.15)."""


def sparse_core_layouts(serialized: bytes) -> Any:
  """The `SparseCoreTableLayouts` proto a SparseCore checkpoint stores under its layouts key."""
  if not HAS_SPARSE_CORE:
    raise NoSparseCore(
      f"The checkpoint holds tables stacked by SparseCore (TPUEmbeddingV2, written under "
      f"TensorFlow 2.16 or later); TensorFlow {tf.__version__} has no SparseCore and cannot read "
      "their layouts. Restore it under TensorFlow 2.17 or later. Nothing was changed."
    )
  layouts = sparse_core_layout_pb2.SparseCoreTableLayouts()
  layouts.ParseFromString(serialized)
  return layouts


def unshuffle_from_sparse_cores(stacked: tf.Tensor, **layout: Any) -> tf.Tensor:
  """TF's own undoing of SparseCore's row dealing and rotation (its checkpoint adapter's)."""
  return tpu_embedding_v3_utils.unshuffle_from_sc_to_cpu(stacked, **layout)


def remove_sparse_core_padding(padded: tf.Tensor, shape: tuple[int, ...]) -> tf.Tensor:
  """The [rows, dim] top-left block of a SparseCore-padded table."""
  return tpu_embedding_v3_utils.remove_padding_from_sc(padded, shape)


def sparse_core_checkpoint_needs_relayout(path: str, mid_level: tf.Module) -> bool:
  """Whether TF's SparseCore checkpoint adapter would convert the checkpoint at `path` for
  `mid_level` (it holds the tables in another layout)."""
  adapter = SPARSE_CORE_CHECKPOINTS.TpuEmbeddingV3CheckpointAdapter
  return adapter.create_from_checkpoint(path).is_applicable(mid_level)


def _no_sparse_core_limits() -> NoSparseCore:
  return NoSparseCore(
    f"TensorFlow {tf.__version__} has no SparseCoreEmbeddingConfig: SparseCore's limits, and the "
    "stacker that reads them, came with TensorFlow 2.17. Run the SparseCore pre-flight (and the "
    "SparseCore path) under TensorFlow 2.17 or later."
  )


def sparse_core_config(**limits: Any) -> Any:
  """TF's `SparseCoreEmbeddingConfig(**limits)`; raises `NoSparseCore` where TF has none."""
  if SPARSE_CORE_CONFIG is None:
    raise _no_sparse_core_limits()
  return SPARSE_CORE_CONFIG(**limits)


def sparse_core_stacking(
  feature_config: Any,
  optimizer: Any,
  num_chips: int,
  sparse_cores_per_chip: int,
  sparse_core_embedding_config: Any,
) -> tuple[Any, list[tuple[str, Any]]]:
  """How `TPUEmbeddingV2` on `num_chips` chips would stack, pad and rotate the tables of
  `feature_config`: (TF's `TableStacking`, [(feature path, cloned feature)] in TF's order).

  Runs TF's own stacker (its C++ `SparseCoreLayoutStacker`, which runs on CPU) on clones, as
  the constructor does, so the user's configs are left as they were. Tables without an optimizer
  take `optimizer`, as TF's base class gives them. Raises `NoSparseCore` on TF 2.15 and 2.16
  (2.16's `TPUEmbeddingV2` stacks by a method of its own, without SparseCore's limits)."""
  if SPARSE_CORE_CONFIG is None:
    raise _no_sparse_core_limits()
  cloned = tpu_embedding_v3._clone_feature_config(feature_config)
  flat_features = nest.flatten_with_joined_string_paths(cloned)
  tables = list({id(feature.table): feature.table for _, feature in flat_features}.values())
  for table in tables:
    if table.optimizer is None:
      table.optimizer = optimizer
  stacking = tpu_embedding_v3._stack_tables_with_same_table_dim_and_optimizer(
    tables, flat_features, num_chips, sparse_cores_per_chip, sparse_core_embedding_config
  )
  return stacking, flat_features


def escape_checkpoint_name(name: str) -> str:
  """A tracked name as it appears in checkpoint keys ('/' and '.' escaped)."""
  return trackable_utils.escape_local_name(name)
