"""`memory_plan` against the variables TF's real `TPUEmbedding` (V1) and `TPUEmbeddingV2` create
under `tpu_harness.StandInTPUStrategy` (TPU runtime stubbed; nothing runs on a TPU), the
threshold against an exhaustive search, and hostile input."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import hardware, tf_internals, tf_mid_level
from tpu_embedding.preflight import memory, topologies

import tpu_harness

emb = tf.tpu.experimental.embedding
GIB = 2**30
OPTIMIZERS = {
  "sgd": lambda: emb.SGD(0.1),
  "adagrad": lambda: emb.Adagrad(0.1),
  "adam": lambda: emb.Adam(0.1),
  "ftrl": lambda: emb.FTRL(0.1),
}
SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 2}
# (vocabulary, dim): odd sizes and widths, so that padding and uneven splits both show.
SHAPES = [(37, 4), (101, 13), (1000, 8), (5, 130), (64, 16)]
BATCH = 8


def _config(optimizer=None, shapes=SHAPES, output_shape=None):
  return {
    f"f{i}": emb.FeatureConfig(
      emb.TableConfig(rows, dim, name=f"t{i}", optimizer=optimizer), output_shape=output_shape
    )
    for i, (rows, dim) in enumerate(shapes)
  }


def _bytes(variable) -> int:
  return math.prod(variable.shape) * variable.dtype.size


def _v1_per_chip(variables: dict, cores: int) -> tuple[int, int]:
  """(table, slot) bytes on the fullest core of TF's host variables, dealt row r to core
  r mod `cores` (the engine's sharding over all cores), i.e. ceil(rows / cores) rows each."""
  tables = slots = 0
  for by_slot in variables.values():
    for slot, variable in by_slot.items():
      shards = tf_mid_level.plain_variables(variable)
      rows = sum(int(s.shape[0]) for s in shards)
      block = math.ceil(rows / cores) * int(shards[0].shape[1]) * shards[0].dtype.size
      if slot == "parameters":
        tables += block
      else:
        slots += block
  return tables, slots


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chips", [1, 3, 8, 64])
def test_v1_bytes_are_those_of_tf_tpu_embedding(monkeypatch, optimizer, chips):
  strategy, recorded = tpu_harness.tpu_strategy(
    monkeypatch, hardware.EmbeddingFeature.V1, replicas=chips
  )
  v1_optimizer = OPTIMIZERS[optimizer]()
  # TF's V1 writes this attribute's default (False) into an enum field and fails: the layer
  # converts it (backends.conversion); here the enum's own "unspecified" is given.
  v1_optimizer.low_dimensional_packing_status = tf_internals.PackingStatus.UNSPECIFIED
  with strategy.scope():
    mid_level = emb.TPUEmbedding(_config(), v1_optimizer)
    mid_level.build(BATCH * chips)
  variables = tf_mid_level.variables_by_table(mid_level)
  cores = recorded.config_protos[-1].num_tensor_cores
  assert cores == chips
  assert all(len(by_slot) == 1 + SLOTS[optimizer] for by_slot in variables.values())
  # v4's layout on `chips` chips (an explicit (HBM, chips, SparseCores) plans for V2):
  plan = memory.memory_plan(
    _config(),
    OPTIMIZERS[optimizer](),
    topology=topologies.Topology("v1", chips, 32 * GIB, 4, topologies.V1),
    batch_size=BATCH * chips,
  )
  tables, slots = _v1_per_chip(variables, cores)
  assert (plan.tables_bytes_per_chip, plan.slots_bytes_per_chip) == (tables, slots)
  # Hand-worked: ceil(rows / chips) * dim * 4 per table, once more per slot.
  want = sum(math.ceil(rows / chips) * dim * 4 for rows, dim in SHAPES)
  assert plan.tables_bytes_per_chip == want
  assert plan.slots_bytes_per_chip == SLOTS[optimizer] * want


@pytest.mark.skipif(tf_internals.SPARSE_CORE_CONFIG is None, reason="no SparseCore limits")
# Each optimizer stacked and not, v5p's 4 and v6e's 2 SparseCores a chip, 1 to 64 chips (a
# 64-chip build takes TF ~10 s on a loaded CPU, so one of those).
@pytest.mark.parametrize(
  "chips,sparse_cores,optimizer,stacking",
  [
    (1, 4, "sgd", True),
    (1, 4, "ftrl", False),
    (2, 2, "adagrad", False),
    (4, 4, "adam", True),
    (8, 2, "ftrl", True),
    (8, 2, "sgd", False),
    (16, 4, "adagrad", True),
    (4, 2, "adam", False),
    (64, 4, "adam", True),
  ],
)
def test_v2_bytes_are_those_of_tf_tpu_embedding_v2(
  monkeypatch, optimizer, stacking, chips, sparse_cores
):
  strategy, _ = tpu_harness.tpu_strategy(
    monkeypatch, hardware.EmbeddingFeature.V2, replicas=chips, sparse_cores=sparse_cores
  )
  config = _config(output_shape=[BATCH])
  with strategy.scope():
    mid_level = emb.TPUEmbeddingV2(
      config,
      OPTIMIZERS[optimizer](),
      sparse_core_embedding_config=emb.SparseCoreEmbeddingConfig(
        disable_table_stacking=not stacking
      ),
    )
    mid_level.build()
  stacks = mid_level.variables
  assert (len(stacks) < len(SHAPES)) == stacking
  tables = slots = 0
  for by_slot in stacks.values():
    for slot, variable in by_slot.items():
      shards = tf_mid_level.plain_variables(variable)
      assert len(shards) == chips
      fullest = max(_bytes(shard) for shard in shards)
      if slot == "parameters":
        tables += fullest
      else:
        slots += fullest
  plan = memory.memory_plan(
    _config(output_shape=[BATCH]),
    OPTIMIZERS[optimizer](),
    topology=(32 * GIB, chips, sparse_cores),
    batch_size=BATCH * chips,
  )
  assert plan.embedding == topologies.V2
  assert (plan.tables_bytes_per_chip, plan.slots_bytes_per_chip) == (tables, slots)
  assert plan.slots_bytes_per_chip == SLOTS[optimizer] * plan.tables_bytes_per_chip


# ---------------------------------------------------------------------------------------------
# The threshold, checked exhaustively against an independent NumPy reckoning

# benchmarks/cases.py's DLRM tables (dim 16, batch 4096, Adagrad), and TF Model Garden's Criteo
# shapes (official/recommendation/ranking/configs/config.py: vocab_sizes, dlrm_criteo's
# embedding_dim 64, global batch 16384, its default embedding optimizer SGD).
DLRM = ([10**6] * 10 + [int(v) for v in np.logspace(2, 5, 16)], 16, 4096, "adagrad")
CRITEO = (
  [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10]
  + [2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36],
  64,
  16384,
  "sgd",
)


def _reference_bytes(sizes, dim, slots, chips: topologies.Topology):
  """(sharded, replicated) bytes per chip of each table, from the layouts' rules by hand."""
  sizes = np.asarray(sizes, np.int64)
  n = chips.num_chips
  if chips.embedding == topologies.V2:
    unit = 8 * n * chips.sparse_cores_per_chip
    sharded = -(-sizes // unit) * unit // n * (-(-dim // 8) * 8)
  else:
    sharded = -(-sizes // n) * dim
  return sharded * 4 * (1 + slots), sizes * dim * 4 * (1 + slots)


@pytest.mark.parametrize("workload", [DLRM, CRITEO], ids=["dlrm", "criteo"])
@pytest.mark.parametrize("name", ["v4-8", "v5p-8", "v6e-8", "v6e-16"])
def test_the_threshold_fits_and_no_larger_candidate_does(workload, name):
  sizes, dim, batch, optimizer = workload
  chips = topologies.topology(name)
  config = {
    f"f{i}": emb.FeatureConfig(emb.TableConfig(v, dim, name=f"t{i}")) for i, v in enumerate(sizes)
  }
  sharded, replicated = _reference_bytes(sizes, dim, SLOTS[optimizer], chips)
  activations = 2 * math.ceil(batch / chips.num_chips) * len(sizes) * dim * 4
  candidates = [0, *sorted(set(sizes))[:-1], None]  # None: every table replicated

  def cost(threshold):
    small = np.asarray(sizes) <= (max(sizes) if threshold is None else threshold)
    return int(np.where(small, replicated, sharded).sum()) + activations

  # One dense-model budget per candidate, leaving exactly that candidate's bytes free.
  for candidate in candidates:
    dense = chips.hbm_bytes_per_chip - cost(candidate)
    if dense < 0:
      continue
    plan = memory.memory_plan(
      config, optimizer, topology=name, batch_size=batch, dense_bytes_per_chip=dense
    )
    assert plan.fits
    chosen = candidates.index(plan.partial_size_threshold)
    assert chosen >= candidates.index(candidate)
    assert cost(plan.partial_size_threshold) + dense <= chips.hbm_bytes_per_chip
    assert plan.partial_bytes_per_chip == cost(plan.partial_size_threshold) + dense
    for larger in candidates[chosen + 1 :]:
      assert cost(larger) + dense > chips.hbm_bytes_per_chip, (candidate, larger)
  # The tables as TF's class lays them out, by hand:
  assert plan.tables_bytes_per_chip + plan.slots_bytes_per_chip == int(sharded.sum())
  assert plan.activations_bytes_per_chip == activations


def test_the_dlrm_tables_on_v6e_8_by_hand():
  """Adagrad, 8 chips x 2 SparseCores: rows padded to multiples of 128, 16 columns; a
  1e6-row table is 1000064 rows, 125008 a chip: 125008 * 16 * 4 = 8,000,512 B, as much again
  for its accumulator."""
  sizes, dim, batch, optimizer = DLRM
  config = {
    f"f{i}": emb.FeatureConfig(emb.TableConfig(v, dim, name=f"t{i}")) for i, v in enumerate(sizes)
  }
  plan = memory.memory_plan(config, optimizer, topology="v6e-8", batch_size=batch)
  assert plan.num_chips == 8 and plan.hbm_bytes_per_chip == 32 * 10**9
  assert (plan.per_table["t0"].table_bytes, plan.per_table["t0"].slot_bytes) == (8000512, 8000512)
  assert plan.per_table["t10"].rows_per_chip == 128 // 8  # 100 rows padded to 128
  assert plan.activations_bytes_per_chip == 2 * 512 * 26 * 16 * 4
  assert plan.fits and plan.partial_size_threshold is None  # 0.5 GiB replicated fits in 32 GB
  assert plan.verdict.startswith("fits on v6e-8 (8 chip(s)): PartialTPUEmbedding(size_threshold")


def test_without_embedding_hardware_every_table_is_whole_on_every_chip():
  plan = memory.memory_plan(_config(), "adam", topology="v5litepod-4", batch_size=BATCH)
  assert plan.embedding == topologies.REPLICATED and plan.num_chips == 4
  assert plan.tables_bytes_per_chip == sum(rows * dim * 4 for rows, dim in SHAPES)
  assert plan.slots_bytes_per_chip == 2 * plan.tables_bytes_per_chip
  assert plan.partial_size_threshold is None


def test_activations_are_forward_and_backward_float32_per_chip():
  """Batch 10 over 4 chips: 3 samples on the fullest chip; a [B] feature of dim 4 gives 4
  floats a sample, a sequence feature of length 3 and dim 2 gives 6, a [B, 5] feature of dim
  8 gives 40: 2 * 3 * 50 * 4 = 1200 B."""
  table = lambda name, dim: emb.TableConfig(100, dim, name=name)
  config = {
    "a": emb.FeatureConfig(table("a", 4)),
    "b": emb.FeatureConfig(table("b", 2), max_sequence_length=3),
    "c": emb.FeatureConfig(table("c", 8), output_shape=[3, 5]),
  }
  plan = memory.memory_plan(config, "sgd", topology=(GIB, 4, 4), batch_size=10)
  assert plan.activations_bytes_per_chip == 1200


# ---------------------------------------------------------------------------------------------
# Topologies and hostile input


@pytest.mark.parametrize(
  "topology,message",
  [
    ("v9-8", "Unknown TPU topology 'v9-8'"),
    ("tpu7x-8", "TPU7x (Ironwood) does not run TensorFlow"),
    ("v5p-3", "multiple of 2"),
    ("v6e-0", "multiple of 1"),
    ((GIB, 0, 4), "num_chips=0; expected an int >= 1"),
    ((GIB, 2.0, 4), "num_chips=2.0"),
    ((0, 2, 4), "HBM bytes per chip=0"),
    (8, "expected a Cloud TPU name"),
  ],
)
def test_bad_topologies_are_refused_by_name(topology, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    memory.memory_plan(_config(), "sgd", topology=topology, batch_size=BATCH)


def test_unknown_optimizers_and_bad_sizes_are_refused_by_name():
  with pytest.raises(ValueError, match="unknown optimizer name 'rmsprop'"):
    memory.memory_plan(_config(), "rmsprop", topology="v5p-8", batch_size=BATCH)
  with pytest.raises(ValueError, match="batch_size=0; expected an int >= 1"):
    memory.memory_plan(_config(), "sgd", topology="v5p-8", batch_size=0)
  with pytest.raises(ValueError, match="dense_bytes_per_chip=-1"):
    memory.memory_plan(_config(), "sgd", topology="v5p-8", batch_size=1, dense_bytes_per_chip=-1)


def test_a_table_that_fits_nowhere_is_named_with_its_bytes():
  """4e9 rows x 128 x (table + Adagrad accumulator) over 8 v6e chips: 5e8 rows a chip (the
  padding unit, 128 rows, divides 4e9), 512 B a row each: 512 GB a chip, of 32 GB."""
  config = {
    "small": emb.FeatureConfig(emb.TableConfig(10, 8, name="small")),
    "huge": emb.FeatureConfig(emb.TableConfig(4 * 10**9, 128, name="huge")),
  }
  plan = memory.memory_plan(config, "adagrad", topology="v6e-8", batch_size=BATCH)
  assert not plan.fits and plan.partial_size_threshold == 0
  assert plan.per_table["huge"].bytes == 5 * 10**8 * 128 * 4 * 2
  assert plan.verdict.startswith(
    "does not fit on v6e-8: table 'huge' needs 476.84 GiB per chip (512,000,000,000 B"
  )
  assert plan.verdict.endswith("the chip has 29.80 GiB")


def test_the_package_gives_the_function_on_every_use():
  """`tpu_embedding.preflight.memory_plan` stays the function after its module is imported (a
  module of the same name would replace it on the package after the first call)."""
  from tpu_embedding import preflight

  for _ in range(2):
    assert preflight.memory_plan(_config(), "sgd", topology="v5p-8", batch_size=8).num_chips == 4
