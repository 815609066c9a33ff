"""Runs TF's real mid-level TPU embedding classes on CPU, with only the TPU runtime stubbed.

What is real: `TPUEmbeddingV0`, `TPUEmbedding` (V1) and `TPUEmbeddingV2` themselves, their config
protos, table stacking, variable creation (TF's sharded variable creators), and the enqueue /
dequeue / send-gradients graphs they build. What is stubbed, and why:

* the strategy: `StandInTPUStrategy` IS a `tf.distribute.TPUStrategy` (so TF's and our own
  `isinstance` checks pass unchanged), created without its TPU-connecting `__init__`, and carries
  only the attributes the classes read (`STRATEGY_ATTRIBUTES`);
* the TPU runtime: the calls listed in `runtime_stubs`, which would execute a TPU op (system
  initialisation, loading tables into / retrieving them from TPU memory). Where they build a
  graph, the stub traces it (so op attributes and the config proto are still checked by TF) and
  records it instead of running it.

Nothing here executes on a TPU, and V1/V2 training steps can only be traced, never run.
Every TF-internal name the harness relies on is listed in `runtime_stubs` or
`STRATEGY_ATTRIBUTES`; `tests/test_tpu_harness.py` fails loudly when a TF upgrade moves one.
It also holds what the TPU tests share: two small tables, and SparseCore stacks filled and
read back by hand (independently of `tpu_embedding.sparse_core`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, one_device_strategy, tpu_strategy
from tensorflow.python.tpu import tpu as tpu_lib
from tensorflow.python.tpu import tpu_embedding_v2
from tensorflow.python.tpu.ops import tpu_ops

EmbeddingFeature = tf.tpu.experimental.HardwareFeature.EmbeddingFeature
# What TF's `TPUStrategy.run` builds a replicated TPU step with (`replicated_steps=True`).
_TPU_STEP_CREATOR = tpu_strategy.TPUExtended._tpu_function_creator

# The TPU strategy's extended attributes that TF's mid-level classes read (TPUExtended sets
# them in its __init__); the stand-in carries these and nothing more of TPUExtended.
# `tpu_run` is what `TPUStrategy.run` calls; `steps_per_run` is what tf-keras's `load_weights`
# reads of a TPU strategy; the last three are what TF's `TPUStrategy.run` reads to build a
# replicated TPU step (`tpu_strategy(..., replicated_steps=True)`).
STRATEGY_ATTRIBUTES = (
  "tpu_hardware_feature",
  "_tpu_devices",
  "_device_assignment",
  "num_hosts",
  "worker_devices",
  "tpu_run",
  "steps_per_run",
  "_tpu_function_creator",
  "_tpu_function_cache",
  "_use_spmd_for_xla_partitioning",
)


@dataclasses.dataclass
class Recorded:
  """What the stubs were asked to do instead of running it on a TPU."""

  config_protos: list = dataclasses.field(default_factory=list)  # V1 system initialisation
  loads: int = 0
  retrieves: int = 0
  # The graph each load / retrieve would have run, in order: ("loads" or "retrieves", graph).
  graphs: list = dataclasses.field(default_factory=list)


class _HardwareFeature:
  """The two fields of `tf.tpu.experimental.HardwareFeature` the classes read."""

  def __init__(self, embedding_feature: EmbeddingFeature, num_embedding_devices_per_chip: int):
    self.embedding_feature = embedding_feature
    self.num_embedding_devices_per_chip = num_embedding_devices_per_chip


class _StandInExtended(one_device_strategy.OneDeviceExtended):
  """One host with `replicas` TPU cores, one core per replica, no model parallelism.

  What actually runs (V0 lookups and Keras updates, variable creation) runs as under
  `OneDeviceStrategy("/cpu:0")`; only the TPU attributes TF's classes read are added.
  """

  def __init__(
    self,
    strategy,
    feature: EmbeddingFeature,
    replicas: int,
    sparse_cores: int,
    replicated_steps: bool = False,
  ):
    super().__init__(strategy, "/cpu:0")
    self._replicated_steps = replicated_steps
    self._tpu_function_cache = weakref.WeakKeyDictionary()
    self._use_spmd_for_xla_partitioning = False
    self.tpu_hardware_feature = _HardwareFeature(feature, sparse_cores)
    self._tpu_devices = np.array(
      [[f"/job:localhost/replica:0/task:0/device:TPU:{i}"] for i in range(replicas)], dtype=object
    )
    self._device_assignment = None
    self.steps_per_run = 1

  @property
  def worker_devices(self) -> tuple[str, ...]:
    return tuple(devices[0] for devices in self._tpu_devices)

  @property
  def num_hosts(self) -> int:
    return 1

  @property
  def _num_replicas_in_sync(self) -> int:
    return len(self._tpu_devices)

  def tpu_run(self, fn, args, kwargs, options=None):
    """`TPUStrategy.run` lands here: the step runs on this CPU, not compiled for TPU cores; with
    `replicated_steps`, TF's own `TPUStrategy.run` code builds it as on a TPU (`tpu.replicate`,
    host work in outside compilation), a graph that is traced only (nothing here runs it)."""
    if self._replicated_steps:
      step = _TPU_STEP_CREATOR(self, fn, options or tf.distribute.RunOptions())
      return step(args, kwargs)
    return self._call_for_each_replica(fn, args, kwargs or {})


class StandInTPUStrategy(tf.distribute.TPUStrategy):
  """A `tf.distribute.TPUStrategy` reporting `feature`, without a TPU behind it."""

  def __init__(
    self,
    feature: EmbeddingFeature,
    replicas: int = 1,
    sparse_cores: int = 4,
    replicated_steps: bool = False,
  ):
    # Skips TPUStrategy.__init__ (it connects to a TPU cluster); the generic base is enough.
    extended = _StandInExtended(self, feature, replicas, sparse_cores, replicated_steps)
    distribute_lib.Strategy.__init__(self, extended)


def _traced_instead_of_run(recorded: Recorded, counter: str, function: Callable) -> Callable:
  """A stand-in for a tf.function that loads/retrieves: traces its graph, runs nothing."""

  def stub(*args, **kwargs):
    graph = function.get_concrete_function(*args, **kwargs).graph
    setattr(recorded, counter, getattr(recorded, counter) + 1)
    recorded.graphs.append((counter, graph))

  return stub


def _initialise_by_tracing(recorded: Recorded, initialise: Callable) -> Callable:
  def stub(config_proto, *args, **kwargs):
    recorded.config_protos.append(config_proto)
    with tf.Graph().as_default():  # built by TF (serialises the proto), never run
      initialise(config_proto, *args, **kwargs)

  return stub


def runtime_stubs(recorded: Recorded) -> list[tuple[Any, str, Any]]:
  """(module, TF-internal name, replacement) for every call needing a TPU."""
  return [
    # V1 build: asks the TPU whether the embedding engine is initialised.
    (tpu_ops, "is_tpu_embedding_initialized", lambda *args, **kwargs: False),
    # V1 build: initialises the TPU embedding engine with the config proto.
    (
      tpu_lib,
      "initialize_system_for_tpu_embedding",
      _initialise_by_tracing(recorded, tpu_lib.initialize_system_for_tpu_embedding),
    ),
    # V1 build / restore and save: copy tables into and out of TPU memory.
    (
      tpu_embedding_v2,
      "_load_variables_impl",
      _traced_instead_of_run(recorded, "loads", tpu_embedding_v2._load_variables_impl),
    ),
    (
      tpu_embedding_v2,
      "_retrieve_variables_impl",
      _traced_instead_of_run(recorded, "retrieves", tpu_embedding_v2._retrieve_variables_impl),
    ),
  ]


class TpuMemory:
  """V1's TPU memory, for tests of what moves between it and the host variables: TF's load
  copies the host variables into it and its retrieve copies it back (instead of the tracing
  stubs of `runtime_stubs`). Set it up after `tpu_strategy`."""

  def __init__(self, monkeypatch):
    # id of a mid-level object's variables dict -> {(table, slot, host): values}
    self._memory: dict[int, dict[tuple[str, str, int], np.ndarray]] = {}
    monkeypatch.setattr(tpu_embedding_v2, "_load_variables_impl", self._load)
    monkeypatch.setattr(tpu_embedding_v2, "_retrieve_variables_impl", self._retrieve)

  def of(self, variables: dict) -> dict[tuple[str, str, int], np.ndarray]:
    """The memory of the mid-level object whose variables dict is `variables`."""
    return self._memory[id(variables)]

  def _load(self, config, hosts, variables, table_config):
    self._memory[id(variables)] = {
      (table, slot, host): shard.numpy()
      for table, slots in variables.items()
      for slot, variable in slots.items()
      for host, shard in enumerate(variable.variables)
    }

  def _retrieve(self, config, hosts, variables, table_config):
    for (table, slot, host), values in self._memory[id(variables)].items():
      variables[table][slot].variables[host].assign(values)


# Classes whose real `isinstance` targets the stand-in must satisfy.
TPU_STRATEGY_CLASSES = (tpu_strategy.TPUStrategy, tpu_strategy.TPUStrategyV2)


def tpu_strategy(
  monkeypatch,
  feature: EmbeddingFeature,
  replicas: int = 1,
  sparse_cores: int = 4,
  replicated_steps: bool = False,
) -> tuple[StandInTPUStrategy, Recorded]:
  """A stand-in TPU strategy (`sparse_cores` per chip), with the TPU runtime stubbed for the
  rest of the test. `replicated_steps`: `strategy.run` inside a `tf.function` builds the step TF
  builds for TPU cores (`tpu.replicate`), to be traced, not run."""
  recorded = Recorded()
  for module, name, replacement in runtime_stubs(recorded):
    monkeypatch.setattr(module, name, replacement)  # raises if TF no longer has `name`
  return StandInTPUStrategy(
    feature, replicas, sparse_cores, replicated_steps=replicated_steps
  ), recorded


def training_step(strategy: tf.distribute.Strategy, layer: Any, remapped: bool = False) -> Any:
  """A `tf.function` running one training step of `layer` on its features in each replica
  (loss: the sum of every activation), for tracing."""

  @tf.function
  def step(features):
    def replica_step(features):
      with tf.GradientTape() as tape:
        activations = tf.nest.flatten(layer(features, remapped=remapped))
        loss = tf.add_n([tf.reduce_sum(a) for a in activations])
      return tape.gradient(loss, layer.trainable_variables)

    return strategy.run(replica_step, args=(features,))

  return step


# ---------------------------------------------------------------------------------------------
# Two small tables for the V0 / V1 tests, holding 0, 1, ..., 7 row by row


def video_and_user_tables(
  video: str = "video", user: str = "user"
) -> tuple[tf.tpu.experimental.embedding.TableConfig, ...]:
  """A [2, 4] "sum" table and a [4, 2] "mean" table, both 0..7 in row-major order."""
  make = lambda vocabulary, dim, combiner, name: tf.tpu.experimental.embedding.TableConfig(
    vocabulary_size=vocabulary,
    dim=dim,
    combiner=combiner,
    name=name,
    initializer=tf.constant_initializer(np.arange(8.0)),
  )
  return make(2, 4, "sum", video), make(4, 2, "mean", user)


# ---------------------------------------------------------------------------------------------
# SparseCore tables, known in advance and read back by hand


def pattern(offset: float) -> Callable:
  """An initializer whose row r, column c holds offset + 100 r + c, whatever shape TF asks
  for (SparseCore asks for padded shapes), so every logical entry is known in advance."""

  def initializer(shape, dtype=tf.float32):
    rows = tf.range(shape[0], dtype=dtype)[:, None]
    columns = tf.range(shape[1], dtype=dtype)[None, :]
    return offset + 100.0 * rows + columns

  return initializer


def pattern_table(vocabulary: int, dim: int, offset: float) -> np.ndarray:
  """The logical table `pattern(offset)` gives a [vocabulary, dim] table, computed in NumPy."""
  return (offset + 100.0 * np.arange(vocabulary)[:, None] + np.arange(dim)[None, :]).astype(
    np.float32
  )


def logical_by_hand(stacked: np.ndarray, layout: Any) -> np.ndarray:
  """NumPy reading of a SparseCoreTableLayout: logical row r sits on SparseCore
  (r mod n + rotation) mod n, at row offset + r // n of that core's block, in the first dim
  columns."""
  n = layout.num_sparse_cores
  rows_per_core = stacked.shape[0] // n
  vocabulary, dim = layout.unsharded_shape
  rows = [
    ((r % n + layout.sparse_core_shard_rotation) % n) * rows_per_core
    + layout.sparse_core_shard_row_offset
    + r // n
    for r in range(vocabulary)
  ]
  return stacked[rows, :dim]


def fill_shards(variables: Any, seed: int) -> None:
  """Gives every shard of each SparseCore variable seeded uniform values, so that rows, tables
  and slots all differ (TF's initial values repeat the initializer's pattern)."""
  for variable in variables:
    for shard in variable.values:
      shard.assign(tf.random.stateless_uniform(shard.shape, seed=[seed, shard.shape[0]]))


def stacked_by_hand(variable: Any) -> np.ndarray:
  """A SparseCore variable's per-device shards, one after another."""
  return np.concatenate([shard.numpy() for shard in variable.values])
