"""Tests of `tpu_embedding.engine.native`: the compiled lookup kernels against NumPy; the update
kernel gives the same bits as the TF-op path run eagerly (itself checked against the NumPy
reference in test_updates); the kernels run where they should and refuse bad input.

Eagerly, because in a graph TF's optimizer rewrites `x / sqrt(y)` into `x * rsqrt(y)`, which is
up to an ulp off; the kernel keeps the exact division.
"""

import math
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.engine import native, updates
from tpu_embedding.engine.state import TableState
from tpu_embedding.managed_ids import IdMap, ManagedIds

import child_process

E = tf.tpu.experimental.embedding

# Every option the kernel implements, on each optimizer it serves.
OPTIONS = {
  "plain": {},
  "clipped": dict(clipvalue=(-0.3, 0.25), clip_weight_min=-0.2, clip_weight_max=0.3),
  "one_sided_clips": dict(clipvalue=(None, 0.25), clip_weight_min=-0.2),
  "decay": dict(weight_decay_factor=0.05),
  "decay_by_lr": dict(weight_decay_factor=0.05, multiply_weight_decay_factor_by_learning_rate=True),
}
OPTIMIZERS = {
  "sgd": lambda **kw: E.SGD(learning_rate=0.1, **kw),
  "adagrad": lambda **kw: E.Adagrad(learning_rate=0.1, initial_accumulator_value=0.05, **kw),
  "adam": lambda **kw: E.Adam(learning_rate=0.1, **kw),
  "adam_eps_outside": lambda **kw: E.Adam(
    learning_rate=0.1, sum_inside_sqrt=False, epsilon=1e-3, **kw
  ),
}


def _numpy_lookup(table, ids, samples, gains, num_samples):
  """activations[samples[k]] += gains[k] * table[ids[k]]; unique ids in first-seen order."""
  first = sorted(np.unique(ids, return_index=True)[1])
  unique = ids[first]
  index = np.array([list(unique).index(i) for i in ids], np.int64)
  samples = np.arange(len(ids)) if samples is None else samples
  gains = np.ones(len(ids), np.float32) if gains is None else gains
  out = np.zeros((num_samples, table.shape[1]), np.float64)
  for k, i in enumerate(ids):
    out[samples[k]] += gains[k] * table[i]
  return out, unique, index


@pytest.mark.parametrize("with_samples", [False, True])
@pytest.mark.parametrize("with_gains", [False, True])
def test_dedup_lookup_and_row_gradients_match_numpy(with_samples, with_gains):
  rng = np.random.default_rng(3)
  values = rng.normal(size=(40, 5)).astype(np.float32)
  ids = rng.zipf(1.5, 300) % 40  # duplicate-heavy
  num_samples = 120 if with_samples else 300
  samples = rng.integers(0, num_samples, 300) if with_samples else None
  gains = rng.normal(size=300).astype(np.float32) if with_gains else None
  table = tf.Variable(values)
  activations, unique_ids, index = native.dedup_lookup(
    table,
    tf.constant(ids),
    None if samples is None else tf.constant(samples),
    None if gains is None else tf.constant(gains),
    num_samples,
  )
  want, want_unique, want_index = _numpy_lookup(values, ids, samples, gains, num_samples)
  np.testing.assert_allclose(activations.numpy(), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(unique_ids.numpy(), want_unique)
  np.testing.assert_array_equal(index.numpy(), want_index)

  upstream = rng.normal(size=(num_samples, 5)).astype(np.float32)
  grads = native.row_gradients(
    index,
    None if samples is None else tf.constant(samples),
    None if gains is None else tf.constant(gains),
    tf.constant(upstream),
    len(want_unique),
  )
  want_grads = np.zeros((len(want_unique), 5))
  for k in range(300):
    s = k if samples is None else samples[k]
    want_grads[want_index[k]] += (1 if gains is None else gains[k]) * upstream[s]
  np.testing.assert_allclose(grads.numpy(), want_grads, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eviction", ["lfu", "lru"])
@pytest.mark.parametrize("wanted", [0, 3, 40, 500])
def test_managed_remap_gives_rows_in_numpy_order(eviction, wanted, engine_path):
  """The kernel's step on a map whose variables were written directly (its index is built from
  them): free rows ascending, then victims by (aged count, last seen, row) or (last seen, row),
  never a row whose key is in the batch."""
  rng = np.random.default_rng(wanted)
  capacity, step, half_life = 300, 50, 7
  last = rng.integers(-1, step, capacity)  # -1: free
  counts = rng.integers(0, 6, capacity) << rng.integers(0, 3, capacity)  # many equal counts
  index = np.arange(capacity)
  used = index[(last >= 0) & (index > 0)]
  in_batch = rng.choice(used, 30, replace=False)  # seen now: never victims
  free = index[(last < 0) & (index > 0)]
  victims = np.setdiff1d(used, in_batch)
  aged = counts[victims] >> np.minimum(step // half_life - last[victims] // half_life, 62)
  if eviction == "lru":
    aged = np.zeros_like(aged)
  victims = victims[np.lexsort((victims, last[victims], aged))]
  want = np.concatenate([free, victims])[:wanted]

  spec = ManagedIds(eviction=eviction, lfu_half_life_steps=half_life, admission="always")
  id_map = IdMap(spec, "t", capacity)
  id_map.keys.assign(1000 + index)
  id_map.last_seen.assign(last.astype(np.int32))
  id_map.counts.assign(counts.astype(np.int32))
  id_map.step.assign(step - 1)
  id_map.rows_of_keys.insert(tf.constant(1000 + used), tf.constant(used))
  new_keys = -1 - np.arange(wanted)
  rows, given = id_map.remap(tf.constant(np.concatenate([1000 + in_batch, new_keys])), True)
  np.testing.assert_array_equal(given.numpy(), want)
  np.testing.assert_array_equal(rows.numpy()[:30], in_batch)
  np.testing.assert_array_equal(rows.numpy()[30:], np.pad(want, (0, wanted - len(want))))
  assert 0 < len(free) < 40 < len(free) + len(victims) < 500  # every regime was exercised


def test_an_index_freed_while_a_graph_is_built_adds_no_op_to_it_and_is_freed_later():
  """The garbage collector frees a dead map's index at any point, also while TF holds a graph's
  lock to add an op (a TPU system's set-up did): an op made then waited on that lock for ever.
  So no op goes into the graph, and the index is freed at the next eager free."""
  id_map = IdMap(ManagedIds(), "t", 8)
  id_map.remap(tf.constant([5, 6], tf.int64), True)  # the kernel makes the index
  graph = tf.Graph()
  with graph.as_default():
    native.destroy_managed_index(id_map.index_name)
  assert graph.get_operations() == []
  native.destroy_managed_index("never made")  # eager: frees what was left, ignoring the unknown
  with pytest.raises(tf.errors.NotFoundError):
    tf.raw_ops.DestroyResourceOp(
      resource=native.managed_index(id_map.index_name), ignore_lookup_error=False
    )


@pytest.mark.parametrize("eviction", ["lfu", "lru", "ttl"])
@pytest.mark.parametrize("capacity", [0, 1])
def test_managed_kernels_refuse_maps_of_fewer_than_two_rows(eviction, capacity):
  """Row 0 reads every key without a row, so such a map has no row to give: refused naming the
  table (a 0-row map made the rebuild select from an empty pool, and TTL's expiry loop never
  ended), nothing changed."""
  map_variables = [
    tf.Variable(tf.zeros([capacity], tf.int64)),
    tf.Variable(tf.zeros([capacity], tf.int32)),
    tf.Variable(-tf.ones([capacity], tf.int32)),
    tf.Variable(tf.constant(4, tf.int64)),
  ]
  index = native.managed_index(f"tiny-{eviction}-{capacity}")
  with pytest.raises(tf.errors.InvalidArgumentError, match="'tiny'.*at least 2 rows, got"):
    native.managed_remap(
      index, None, map_variables, tf.constant([], tf.int64), eviction, 10, 1, 3, "tiny"
    )
  with pytest.raises(tf.errors.InvalidArgumentError, match="'tiny'.*at least 2 rows, got"):
    native.managed_lookup(index, map_variables, tf.constant([5], tf.int64), "tiny")
  assert map_variables[3].numpy() == 4


def test_dedup_lookup_of_a_hand_worked_bag():
  table = tf.Variable([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
  activations, unique_ids, index = native.dedup_lookup(
    table, tf.constant([2, 0, 2]), tf.constant([0, 0, 1]), tf.constant([0.5, 1.0, 2.0]), 3
  )
  np.testing.assert_array_equal(activations.numpy(), [[2.0, 1.0], [4.0, 4.0], [0.0, 0.0]])
  np.testing.assert_array_equal(unique_ids.numpy(), [2, 0])
  np.testing.assert_array_equal(index.numpy(), [0, 1, 0])


@pytest.mark.parametrize(
  "ids,samples,message",
  [
    ([0, 5], None, r"id 5 is not in \[0, 5\)"),
    ([0, -1], None, r"id -1 is not in \[0, 5\)"),
    ([0, 1], [0, 3], r"sample 3 is not in \[0, 2\)"),
  ],
)
def test_dedup_lookup_refuses_ids_and_samples_out_of_range(ids, samples, message):
  table = tf.Variable(tf.zeros([5, 2]))
  with pytest.raises(tf.errors.InvalidArgumentError, match=message):
    native.dedup_lookup(
      table, tf.constant(ids), None if samples is None else tf.constant(samples), None, 2
    )


# Counts the kernels allocate rows for: negative, too many to be a shape, or not a scalar.
_BAD_COUNTS = {
  "-1": (-1, "must be in [0, 2**31), got -1"),
  "2**61": (2**61, f"must be in [0, 2**31), got {2**61}"),
  "non-scalar": ([1, 2], "must be a scalar"),
}
_HOSTILE_COUNTS = """
import sys
import tensorflow as tf
from tpu_embedding.engine import native
table = tf.Variable(tf.zeros([5, 2]))
for name, (count, _) in {counts}.items():
  for op in ("dedup_lookup", "row_gradients"):
    print(op, name, flush=True)
    try:
      if op == "dedup_lookup":
        native.dedup_lookup(table, tf.constant([0, 1], tf.int64), None, None, tf.constant(count))
      else:
        native.row_gradients(tf.constant([0, 0], tf.int64), None, None, tf.ones([2, 2]),
                             tf.constant(count))
      print("accepted")
    except tf.errors.InvalidArgumentError as e:
      print("refused:", e.message)
"""


@pytest.mark.integration  # starts a process
def test_kernels_refuse_bad_counts_without_aborting():
  """Run in a child process: an abort (a failed CHECK) there fails this test, not pytest."""
  script = _HOSTILE_COUNTS.format(counts=repr(_BAD_COUNTS))
  stdout = child_process.run_python(script, 120)
  lines = stdout.splitlines()
  assert len(lines) == 4 * len(_BAD_COUNTS), stdout
  for (name, (_, message)), at in zip(_BAD_COUNTS.items(), range(0, len(lines), 4)):
    for op, result in zip(("dedup_lookup", "row_gradients"), lines[at + 1 : at + 4 : 2]):
      count = "num_samples" if op == "dedup_lookup" else "num_unique"
      assert result.startswith("refused:") and f"{count} {message}" in result, (op, name, result)


def test_kernels_were_built_by_the_install():
  assert native.enabled(), (
    "tpu_embedding/engine/_kernels*.so is missing: `make` (pip install) should compile it"
  )


def _copy_of_the_kernels(directory, built_for):
  """The installed kernels copied into `directory`, recorded as built for `built_for`."""
  (library,) = native.ENGINE_DIR.glob("_kernels*.so")
  shutil.copy(library, directory / library.name)
  if built_for is not None:
    (directory / native.BUILT_FOR).write_text(built_for + "\n")


def test_the_install_records_the_tensorflow_its_kernels_were_built_for():
  assert (native.ENGINE_DIR / native.BUILT_FOR).read_text().strip() == tf.__version__


@pytest.mark.parametrize("built_for", ["2.14.0", tf.__version__ + ".post1", None])
def test_kernels_built_for_another_tensorflow_are_not_loaded(tmp_path, caplog, built_for):
  _copy_of_the_kernels(tmp_path, built_for)
  assert native.load_kernels(tmp_path) is None
  (warning,) = [r.getMessage() for r in caplog.records if "tpu_embedding" in r.getMessage()]
  assert "\n" not in warning
  assert f"built for TensorFlow {built_for or 'a version it did not record'}, this is " in warning
  assert tf.__version__ in warning and "runs on TF ops" in warning


@pytest.mark.integration  # starts a process
@pytest.mark.parametrize("built_for", ["2.14.0", tf.__version__])
def test_a_package_loads_only_kernels_of_its_tensorflow_and_else_looks_up_on_tf_ops(
  tmp_path, built_for
):
  # In a child: a second copy of the library would register the same ops in this process.
  package = tmp_path / "tpu_embedding"
  shutil.copytree(native.ENGINE_DIR.parent, package)
  (package / "engine" / native.BUILT_FOR).write_text(built_for + "\n")
  child = subprocess.run(
    [sys.executable, "-c", _LOOKUP_ON_ANOTHER_TF],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,  # `python -c` puts the working directory first on the path
    env=dict(os.environ, PYTHONPATH=str(tmp_path)),
  )
  assert child.returncode == 0, child.stderr[-3000:]
  loaded = built_for == tf.__version__
  assert child.stdout.split() == [str(loaded), "[[2.0,", "3.0]]", str(package)], child.stdout
  warnings_seen = [line for line in child.stderr.splitlines() if "built for TensorFlow" in line]
  assert len(warnings_seen) == (0 if loaded else 1), child.stderr[-3000:]
  assert all(f"built for TensorFlow {built_for}, this is" in line for line in warnings_seen)


_LOOKUP_ON_ANOTHER_TF = """
import numpy as np, tensorflow as tf
import tpu_embedding
from tpu_embedding.engine import native
E = tf.tpu.experimental.embedding
initial = tf.constant_initializer(np.arange(6.0).reshape(3, 2))
table = E.TableConfig(3, 2, initializer=initial, name="t")
layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table)}, optimizer=E.SGD(0.1))
with tf.GradientTape():
  out = layer({"f": tf.constant([[1]])})["f"]
print(native.enabled(), out.numpy().tolist(), tpu_embedding.__path__[0])
"""


def _run(
  optimizer,
  path: str,
  monkeypatch,
  vocab: int,
  dim: int,
  steps: int,
  seed: int,
  compiled: bool = True,
):
  """Final table and slots after `steps` updates on the given path."""
  monkeypatch.setenv(native.ENV_SWITCH, "1" if path == "native" else "0")
  rng = np.random.default_rng(seed)
  table = tf.Variable(rng.uniform(-0.5, 0.5, (vocab, dim)).astype(np.float32))
  slots = {
    name: tf.Variable(rng.uniform(0.01, 0.2, (vocab, dim)).astype(np.float32))
    for name in optimizer._slot_names()
  }

  rule = updates.rule_for(optimizer)
  state = TableState.of({"parameters": table, **slots}, rule.slot_names)

  def step(ids, grads, learning_rate):
    updates.apply_sparse_update(rule, state, ids, grads, learning_rate)

  if compiled:
    step = tf.function(step, reduce_retracing=True)
  for n in range(steps):
    ids = rng.choice(vocab, size=rng.integers(1, vocab), replace=False)
    grads = rng.normal(0, 0.5, (len(ids), dim)).astype(np.float32)
    args = (tf.constant(ids, tf.int64), tf.constant(grads), tf.constant(0.1 / (n + 1)))
    step(*args)
  if compiled:
    graph_ops = [op.type for op in step.get_concrete_function(*args).graph.get_operations()]
    assert ("TpuEmbeddingApplyRows" in graph_ops) == (path == "native"), graph_ops
  return [table.numpy()] + [v.numpy() for v in slots.values()]


def _assert_same_bits(optimizer, monkeypatch, **problem):
  native_result = _run(optimizer, "native", monkeypatch, **problem)
  tf_ops_result = _run(optimizer, "tf_ops", monkeypatch, compiled=False, **problem)
  for got, want in zip(native_result, tf_ops_result):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_kernel_matches_tf_ops_bit_for_bit(name, options, monkeypatch):
  kwargs = dict(OPTIONS[options])
  clip = kwargs.pop("clipvalue", None)
  _assert_same_bits(
    OPTIMIZERS[name](clipvalue=clip, **kwargs), monkeypatch, vocab=300, dim=7, steps=3, seed=1
  )


def test_compiled_tf_ops_differ_from_the_kernel_only_by_rounding(monkeypatch):
  """What the graph rewrite of `x / sqrt(y)` costs the TF-op path over three steps."""
  optimizer = E.Adagrad(learning_rate=0.1)
  problem = dict(vocab=300, dim=7, steps=3, seed=1)
  native_result = _run(optimizer, "native", monkeypatch, **problem)
  tf_ops_result = _run(optimizer, "tf_ops", monkeypatch, **problem)
  (table, accumulators), (tf_ops_table, tf_ops_accumulators) = native_result, tf_ops_result
  np.testing.assert_array_equal(accumulators, tf_ops_accumulators)  # no division involved
  assert np.any(table != tf_ops_table)
  np.testing.assert_allclose(table, tf_ops_table, rtol=0, atol=2.5e-7)  # |W| < 1: ~2 ulps


def test_kernel_shards_large_updates_without_changing_them(monkeypatch):
  """Enough rows for the kernel to split them across threads: still the same bits."""
  _assert_same_bits(E.Adam(learning_rate=0.1), monkeypatch, vocab=60_000, dim=16, steps=2, seed=2)


def test_optimizers_without_a_kernel_stay_on_tf_ops(monkeypatch):
  for optimizer in (
    E.Adam(learning_rate=0.1, lazy_adam=False),
    E.FTRL(learning_rate=0.1),
    E.AdagradMomentum(learning_rate=0.1, momentum=0.9),
  ):
    assert updates.rule_for(optimizer).native_form() is None
  assert updates.rule_for(E.Adam(learning_rate=0.1)).native_form()[0] == "adam"


def test_kernel_refuses_row_ids_outside_the_table():
  table, accumulators = tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.ones([4, 2]))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"row id 4 is not in \[0, 4\)"):
    native.apply_rows(
      "adagrad",
      (),
      table,
      [accumulators],
      tf.constant([1, 4]),
      tf.ones([2, 2]),
      0.1,
      (None, None),
      0.0,
      False,
      (None, None),
    )
  np.testing.assert_array_equal(table.numpy(), np.zeros([4, 2]))  # nothing was written


@pytest.mark.parametrize("rows", [4, 10_000], ids=["bitset", "sorted"])
def test_kernel_refuses_duplicate_row_ids_writing_nothing(rows):
  """The layer deduplicates before the update; a caller that does not is refused, rather than
  two shards racing on one row (updates lost in about half the runs on 2 threads)."""
  table, accumulators = tf.Variable(tf.zeros([rows, 2])), tf.Variable(tf.ones([rows, 2]))
  ids = tf.constant([3, 1, 2, 1], tf.int64)
  with pytest.raises(tf.errors.InvalidArgumentError, match="row id 1 appears more than once"):
    native.apply_rows(
      "adagrad",
      (),
      table,
      [accumulators],
      ids,
      tf.ones([4, 2]),
      0.1,
      (None, None),
      0.0,
      False,
      (None, None),
    )
  np.testing.assert_array_equal(table.numpy(), np.zeros([rows, 2]))
  np.testing.assert_array_equal(accumulators.numpy(), np.ones([rows, 2]))


def test_kernel_refuses_slots_of_another_shape():
  table, accumulators = tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.ones([4, 3]))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"slot 0 has shape \[4,3\]"):
    native.apply_rows(
      "adagrad",
      (),
      table,
      [accumulators],
      tf.constant([1]),
      tf.ones([1, 2]),
      0.1,
      (None, None),
      0.0,
      False,
      (None, None),
    )


def test_switch_and_placement_decide_where_the_kernel_runs(monkeypatch):
  local = tf.Variable(tf.zeros([2, 2]))
  assert native.runs_on([local])
  assert not native.runs_on([tf.Variable(tf.zeros([2, 2], tf.float64))])
  monkeypatch.setenv(native.ENV_SWITCH, "0")
  assert not native.runs_on([local])


@pytest.mark.parametrize(
  "device,local,same",
  [
    ("/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0", True),
    ("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1", True),
    ("/job:ps/replica:0/task:0/device:CPU:0", "/job:chief/replica:0/task:0", False),
    ("/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1", False),
  ],
)
def test_a_parameter_servers_variables_are_left_to_tf_ops(device, local, same):
  """Another task's process may not have loaded the kernels."""
  assert (
    native.same_task(
      tf.DeviceSpec.from_string(device),
      tf.DeviceSpec.from_string(local),
    )
    == same
  )


@pytest.mark.integration  # starts a process
def test_a_saved_training_function_traced_with_the_kernels_runs_with_tensorflow_alone(tmp_path):
  """`tf.saved_model.save` traces it again, and then the engine keeps to TF's ops (the saved
  function loads where the package and its kernels are not)."""
  import tpu_embedding

  table = E.TableConfig(8, 2, name="t", initializer=tf.constant_initializer(0.5))
  module = tf.Module()
  module.layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), E.Adagrad(0.1))

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
  def train(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(module.layer(ids))
    tape.gradient(loss, module.layer.trainable_variables)
    return tf.identity(list(module.layer.embedding_tables.values())[0])

  module.train = train
  graph_ops = {op.type for op in train.get_concrete_function().graph.get_operations()}
  assert "TpuEmbeddingDedupLookup" in graph_ops
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tf.saved_model.save(module, str(tmp_path / "module"))
  # Saving traces the trap's gradient again: that is not a second gradient of a step.
  assert not [w for w in caught if "second gradient" in str(w.message)]
  code = (
    f"import sys, numpy as np, tensorflow as tf\n"
    f"loaded = tf.saved_model.load({str(tmp_path / 'module')!r})\n"
    f"np.save({str(tmp_path / 'table.npy')!r}, "
    f"loaded.train(tf.constant([1, 1, 3], tf.int64)).numpy())\n"
    f"assert not [m for m in sys.modules if m.startswith('tpu_embedding')]\n"
  )
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  # Reloaded, the function's gradient is a plain lookup's (no trap, no kernel op): tables change
  # only through an optimizer the user applies, as with tf-recommenders
  # (docs/differences-from-tfrs.md), so the table is still the one saved.
  np.testing.assert_array_equal(np.load(tmp_path / "table.npy"), np.full((8, 2), 0.5, np.float32))


def _phi(x):
  """The standard normal CDF, from math.erf."""
  return 0.5 * (1.0 + np.vectorize(math.erf)(np.asarray(x, np.float64) / math.sqrt(2.0)))


def _ks_distance(sample, cdf):
  """The Kolmogorov-Smirnov distance between `sample` and the distribution of `cdf`."""
  x = np.sort(np.asarray(sample, np.float64))
  n, f = len(x), cdf(x)
  return np.max(np.maximum(np.arange(1, n + 1) / n - f, f - np.arange(n) / n))


# Standard-normal CDF of each kind, from math.erf (truncated: renormalized to [-2, 2]).
_RESET_CDFS = {
  "normal": _phi,
  "truncated_normal": lambda z: (_phi(z) - _phi(-2.0)) / (_phi(2.0) - _phi(-2.0)),
}


@pytest.mark.parametrize("kind", ["normal", "truncated_normal", "uniform"])
def test_reset_rows_draws_each_kind_into_its_rows_and_nothing_else(kind):
  """40 000 draws against the distribution's CDF (Kolmogorov-Smirnov below its 0.1 % critical
  value 1.95 / sqrt(n)); moments as worked by hand (truncated normal: variance factor
  1 - 4 phi(2) / (Phi(2) - Phi(-2)) = 0.7737; uniform on [a, b): (b - a)^2 / 12), within five
  standard errors (a normal sample's variance: sqrt(2 / n) of sigma^2); the slot's rows get its
  constant; rows not named keep their values. Seeded, so that a run cannot fail by chance (unseeded,
  2.8 standard errors failed one CI run in a few hundred)."""
  table = tf.Variable(tf.fill([5000, 16], 7.0))
  slot = tf.Variable(tf.fill([5000, 16], 7.0))
  rows = tf.range(1, 5000, 2, dtype=tf.int64)
  first, second = (-0.5, 1.5) if kind == "uniform" else (0.5, 0.25)
  native.reset_rows(rows, [table, slot], [(kind, first, second), ("constant", 0.1, 0.0)], (3, 17))
  values, slots = table.numpy(), slot.numpy()
  np.testing.assert_array_equal(values[0::2], 7.0)
  np.testing.assert_array_equal(slots[0::2], 7.0)
  np.testing.assert_array_equal(slots[1::2], np.float32(0.1))
  x = values[1::2].ravel().astype(np.float64)
  n = len(x)
  if kind == "uniform":
    assert x.min() >= -0.5 and x.max() < 1.5
    distance = _ks_distance(x, lambda v: (v + 0.5) / 2.0)
    assert abs(x.var() - 4.0 / 12) < 0.01
  else:
    z = (x - 0.5) / 0.25
    distance = _ks_distance(z, _RESET_CDFS[kind])
    assert abs(x.mean() - 0.5) < 5 * 0.25 * math.sqrt(1.0 / n)
    factor = 0.7737 if kind == "truncated_normal" else 1.0
    assert abs(x.var() / 0.25**2 - factor) < 5 * math.sqrt(2.0 / n)
    if kind == "truncated_normal":
      assert np.abs(z).max() < 2.0
    else:
      assert np.abs(z).max() > 3.0  # the ziggurat's tail is drawn (P(|z| > 3) = 0.27 %)
  assert distance < 1.95 / math.sqrt(n)


def test_reset_rows_follows_tf_seeds():
  """Seeded kernels repeat their stream from its start (a new kernel per function) and
  continue it from call to call; unseeded ones differ."""

  def reset(seeds):
    table = tf.Variable(tf.zeros([300, 8]))
    draw = lambda: native.reset_rows(
      tf.constant([299, 0, 17], tf.int64), [table], [("truncated_normal", 0.0, 1.0)], seeds
    )
    return table, draw

  table, draw = reset((5, 9))
  tf.function(draw)()
  first = table.numpy()[[299, 0, 17]]
  assert np.all(first != 0)
  again, draw_again = reset((5, 9))
  twice = tf.function(draw_again)
  twice()
  np.testing.assert_array_equal(again.numpy()[[299, 0, 17]], first)  # a new kernel: same
  twice()
  assert not np.any(again.numpy()[[299, 0, 17]] == first)  # the same kernel goes on
  unseeded, draw_unseeded = reset((0, 0))
  tf.function(draw_unseeded)()
  assert not np.any(unseeded.numpy()[[299, 0, 17]] == first)


def test_reset_rows_refuses_rows_outside_and_variables_of_other_rows():
  table = tf.Variable(tf.fill([4, 2], 3.0))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"row 4 is not in \[0, 4\)"):
    native.reset_rows(tf.constant([1, 4], tf.int64), [table], [("constant", 0.0, 0.0)], (0, 0))
  other = tf.Variable(tf.zeros([5, 2]))
  with pytest.raises(tf.errors.InvalidArgumentError, match="every variable needs the same rows"):
    native.reset_rows(
      tf.constant([1], tf.int64), [table, other], [("constant", 0.0, 0.0)] * 2, (0, 0)
    )
  np.testing.assert_array_equal(table.numpy(), 3.0)  # nothing written


_OTHER_DTYPE_HELD = """
import tensorflow as tf
from tpu_embedding.engine import native
row = tf.constant([1], tf.int64)
for dtype in (tf.float64, tf.int32):
  variable = tf.Variable(tf.zeros([4, 3], dtype))
  held = variable.read_value()  # a second holder of its buffer: TF's lock helpers would copy it
  for call in (
    lambda: native.reset_rows(row, [variable], [("constant", 1.0, 0.0)], (0, 0)),
    lambda: native.dedup_lookup(variable, row, None, None, tf.constant(1)),
  ):
    try:
      call()
    except tf.errors.InvalidArgumentError as error:
      print("refused", "must be float32, got" in error.message)
"""


@pytest.mark.integration  # starts a process
def test_kernels_refuse_variables_of_another_dtype_without_aborting():
  """A float64 or int32 variable whose buffer is also held elsewhere: TF's locking helpers,
  instantiated for float32, would copy it as float32 and abort the process; the kernels refuse
  it first (in a child process, so that an abort cannot take the test run with it)."""
  out = child_process.run_python(_OTHER_DTYPE_HELD, timeout=120)
  assert out.split() == ["refused", "True"] * 4


def test_reset_rows_of_constants_needs_no_seed_under_op_determinism():
  """TF refuses unseeded random ops under op determinism; an op that only writes constants
  draws nothing and needs none."""
  from tensorflow.python.framework import config

  table = tf.Variable(tf.zeros([4, 2]))
  tf.config.experimental.enable_op_determinism()
  try:
    native.reset_rows(tf.constant([2], tf.int64), [table], [("constant", 0.25, 0.0)], (0, 0))
  finally:
    config.disable_op_determinism()
  np.testing.assert_array_equal(table.numpy()[2], [0.25, 0.25])


def test_reset_rows_keeps_uniform_draws_below_their_maximum():
  """On [100, 101) a float32 100 + u rounds up to 101 for u within 2^-18 of 1 (TF's own
  uniform returns 101 then): the kernel keeps its values below 101."""
  table = tf.Variable(tf.zeros([250000, 16]))
  native.reset_rows(tf.range(250000, dtype=tf.int64), [table], [("uniform", 100.0, 101.0)], (0, 0))
  values = table.numpy()
  assert values.min() >= 100.0 and values.max() < 101.0
  assert values.max() == np.nextafter(np.float32(101.0), np.float32(0.0))  # the top is reached
