"""The engine's compiled kernels (cc/), and where they may run.

`pip install` compiles them against the installed TensorFlow (see setup.py). Without them, or
with `TPU_EMBEDDING_NATIVE_KERNELS=0`, the engine runs the same maths on TF's own ops, slower.
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any, Optional, Sequence

import tensorflow as tf
from absl import logging

from tpu_embedding import tf_internals

ENV_SWITCH = "TPU_EMBEDDING_NATIVE_KERNELS"
# Beside the library: the TensorFlow version it was compiled against (written by setup.py).
BUILT_FOR = "_kernels_tf_version.txt"
ENGINE_DIR = pathlib.Path(__file__).parent  # where the install puts both


@functools.cache
def _library():
  """The loaded op library, or None (with one warning) if it was not built for this TF."""
  return load_kernels(ENGINE_DIR)


def load_kernels(directory: pathlib.Path) -> Optional[Any]:
  """The op library built in `directory`, or None with one warning: when it is missing, or was
  built for another TensorFlow (setup.py records which, in `BUILT_FOR`). TF's C++ API has no
  stable ABI: a library built against another TF may fail to load, or load and crash."""
  built = sorted(directory.glob("_kernels*.so"))
  if not built:
    logging.warning(
      "tpu_embedding: compiled kernels not found in %s (was the package installed "
      "without a C++ compiler?); the CPU engine runs on TF ops, which is slower.",
      directory,
    )
    return None
  record = directory / BUILT_FOR
  built_for = record.read_text().strip() if record.exists() else "a version it did not record"
  if built_for != tf.__version__:
    logging.warning(
      "tpu_embedding: its compiled kernels were built for TensorFlow %s, this is %s; the CPU "
      "engine runs on TF ops, which is slower (reinstall tpu_embedding to rebuild them).",
      built_for,
      tf.__version__,
    )
    return None
  return tf.load_op_library(str(built[0]))


def enabled() -> bool:
  """Whether the kernels are built and not switched off by the environment."""
  return os.environ.get(ENV_SWITCH, "1") != "0" and _library() is not None


def runs_on(variables: Sequence[tf.Variable]) -> bool:
  """Whether the kernels can read and update these variables in place.

  They need float32 variables on a CPU of this process: a parameter server's tasks are other
  processes, which may not have loaded the kernels. Nor are they traced into a SavedModel
  (training functions, gradients included, are saved too), which must load where this package
  is not installed.
  """
  return all(v.dtype == tf.float32 for v in variables) and runs_here(variables)


def runs_here(variables: Sequence[tf.Variable]) -> bool:
  """Whether the kernels are enabled and these variables live on a CPU of this process, outside
  a SavedModel trace (see `runs_on`)."""
  if not enabled() or tf_internals.in_save_context():
    return False
  local = tf.DeviceSpec.from_string(tf_internals.host_address_space())
  for variable in variables:
    device = tf.DeviceSpec.from_string(variable.device)
    if device.device_type != "CPU" or not same_task(device, local):
      return False
  return True


def same_task(device: tf.DeviceSpec, local: tf.DeviceSpec) -> bool:
  """Whether `device` belongs to the task (process) `local` names; a job-less or "localhost"
  device is always this process's."""
  if device.job in (None, "localhost"):
    return True
  return (device.job, device.replica or 0, device.task or 0) == (
    local.job,
    local.replica or 0,
    local.task or 0,
  )


def apply_rows(
  rule: str,
  hyperparameters: Sequence[float],
  table: tf.Variable,
  slots: Sequence[tf.Variable],
  row_ids: tf.Tensor,
  grads: tf.Tensor,
  learning_rate: tf.Tensor,
  clip_gradient: tuple[Optional[float], Optional[float]],
  weight_decay: float,
  weight_decay_by_learning_rate: bool,
  clip_weight: tuple[Optional[float], Optional[float]],
) -> None:
  """One fused optimizer step on the unique rows `row_ids`, in place (cc/apply_rows.cc).

  Limits given as None are absent.
  """
  infinity = float("inf")
  bound = lambda value, default: default if value is None else float(value)
  _library().tpu_embedding_apply_rows(
    table=table.handle,
    slots=[s.handle for s in slots],
    row_ids=tf.cast(row_ids, tf.int64),
    gradients=tf.cast(grads, tf.float32),
    learning_rate=tf.cast(learning_rate, tf.float32),
    rule=rule,
    hyperparameters=[float(h) for h in hyperparameters],
    clip_gradient_min=bound(clip_gradient[0], -infinity),
    clip_gradient_max=bound(clip_gradient[1], infinity),
    weight_decay=float(weight_decay or 0.0),
    weight_decay_by_learning_rate=bool(weight_decay_by_learning_rate),
    clip_weight_min=bound(clip_weight[0], -infinity),
    clip_weight_max=bound(clip_weight[1], infinity),
  )


def _optional(value: Optional[tf.Tensor], dtype: tf.DType) -> tf.Tensor:
  """The kernels' encoding of an absent per-occurrence input: an empty tensor."""
  return tf.zeros([0], dtype) if value is None else tf.cast(value, dtype)


def dedup_lookup(
  table: tf.Variable,
  ids: tf.Tensor,
  samples: Optional[tf.Tensor],
  gains: Optional[tf.Tensor],
  num_samples: tf.Tensor,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """(activations [num_samples, D], unique ids, index) of one table's training lookup.

  activations[samples[k]] += gains[k] * table[ids[k]]; samples None means sample k is id k,
  gains None means gains of 1; unique_ids[index[k]] == ids[k], in first-occurrence order.
  """
  activations, unique_ids, index = _library().tpu_embedding_dedup_lookup(
    table=table.handle,
    ids=tf.cast(ids, tf.int64),
    samples=_optional(samples, tf.int64),
    gains=_optional(gains, tf.float32),
    num_samples=tf.cast(num_samples, tf.int64),
  )
  activations.set_shape([None, table.shape[-1]])
  return activations, unique_ids, index


def row_gradients(
  index: tf.Tensor,
  samples: Optional[tf.Tensor],
  gains: Optional[tf.Tensor],
  upstream: tf.Tensor,
  num_unique: tf.Tensor,
) -> tf.Tensor:
  """The lookup's transpose: out[index[k]] += gains[k] * upstream[samples[k]], [U, D]."""
  return _library().tpu_embedding_row_gradients(
    index=index,
    samples=_optional(samples, tf.int64),
    gains=_optional(gains, tf.float32),
    upstream=tf.cast(upstream, tf.float32),
    num_unique=tf.cast(num_unique, tf.int64),
  )


def reset_rows(
  rows: tf.Tensor,
  variables: Sequence[tf.Variable],
  draws: Sequence[tuple[str, float, float]],
  seeds: tuple[int, int],
) -> None:
  """Writes fresh values into `rows` of each variable, in place (cc/reset_rows.cc): one draw
  per element as its (kind, first, second) in `draws` says. `seeds`: TF's op-level pair
  ((0, 0): random)."""
  kinds, first, second = zip(*draws)
  _library().tpu_embedding_reset_rows(
    rows=tf.cast(rows, tf.int64),
    variables=[v.handle for v in variables],
    kinds=list(kinds),
    first=[float(x) for x in first],
    second=[float(x) for x in second],
    seed=seeds[0],
    seed2=seeds[1],
  )


def managed_index(name: str) -> tf.Tensor:
  """The handle of a managed-id map's eviction index (cc/managed_ids.cc), created at first use
  and shared by every call naming it: a cache of the map's variables, never checkpointed."""
  return _library().tpu_embedding_managed_index(shared_name=name)


# Indexes whose maps are gone, freed at the next chance to run an op safely (see below).
_UNUSED_INDEXES: list[str] = []


def destroy_managed_index(name: str) -> None:
  """Frees the index `name` if it was created (its map is gone). The garbage collector calls this
  at any point, also while TF holds a graph's lock to add an op to it (tracing a function, or a
  TPU system's set-up), where making an op would wait on that lock for ever: so the name is
  queued, and the queue is freed eagerly, here or at the next call outside any graph."""
  _UNUSED_INDEXES.append(name)
  if not tf.executing_eagerly():
    return
  while _UNUSED_INDEXES:
    unused = _UNUSED_INDEXES.pop()
    tf.raw_ops.DestroyResourceOp(resource=managed_index(unused), ignore_lookup_error=True)


def managed_remap(
  index: tf.Tensor,
  candidates: Optional[tf.Tensor],
  map_variables: Sequence[tf.Variable],
  ids: tf.Tensor,
  eviction: str,
  half_life: int,
  min_count: int,
  ttl_steps: Optional[int],
  table: str,
  compete: bool = False,
  distance_decay: float = 1.0,
) -> tuple[tf.Tensor, tf.Tensor]:
  """One training step of a managed-id map in one kernel (cc/managed_ids.cc): (row of each of
  `ids`, rows given to new keys), the same as `IdMap`'s TF ops. `candidates`: the handle of its
  candidates' `MutableHashTable` (None where min_count is 1); `map_variables`: its keys,
  counts, last_seen and step, updated in place; `index`: its index (key -> row table and
  eviction order, rebuilt from the variables whenever something else wrote them); errors name
  `table`; `compete` and `distance_decay` (in halves) as `ManagedIds`' admission and decay."""
  keys, counts, last_seen, step = map_variables
  return _library().tpu_embedding_managed_remap(
    index=index,
    keys=keys.handle,
    counts=counts.handle,
    last_seen=last_seen.handle,
    step=step.handle,
    ids=ids,
    candidates=[] if candidates is None else [candidates],
    eviction=eviction,
    half_life=int(half_life),
    min_count=int(min_count),
    ttl_steps=int(ttl_steps or 0),
    table=table,
    compete=bool(compete),
    decay_halves=int(2 * distance_decay),
  )


def managed_lookup(
  index: tf.Tensor, map_variables: Sequence[tf.Variable], ids: tf.Tensor, table: str
) -> tf.Tensor:
  """The rows of `ids` in a managed-id map (0: none) from its index (`managed_remap`'s);
  `map_variables`: its keys, counts, last_seen and step, read only; errors name `table`."""
  keys, _, last_seen, step = map_variables
  return _library().tpu_embedding_managed_lookup(
    index=index,
    keys=keys.handle,
    last_seen=last_seen.handle,
    step=step.handle,
    ids=ids,
    table=table,
  )
