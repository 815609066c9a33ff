"""`python -m benchmarks managed [--quick] [--speed-only]`: managed ids' speed, memory, quality.

Speed: a DLRM-like model (T managed tables, one raw key per sample each, keys Zipf-distributed
over 10^8 distinct 64-bit values, maps full before timing) against the same model fed
pre-mapped row ids; beside them the same managed model with tables initialized to zeros (what
drawing the reset rows' initial values costs) and with min_count=2, the remap alone
(`layer.remap`), tf_keras's DynamicEmbedding and TFRA's dynamic embedding (in its own TF 2.16
environment, `TFRA_PYTHON`).
Memory: the map's bytes per row (variables and the compiled kernel's table and index, from their
sizes; without the kernels, TF's hash table measured as the process's resident-memory growth).
Quality: a stream of ratings whose item popularity drifts and whose items appear day by day,
scored before each batch is trained (progressive validation), at a capacity of half the distinct
items: managed ids vs the hashing trick (`key % capacity`) vs a full static vocabulary.
Writes RESULTS.md, results.json and quality.png under
benchmarks/results/managed[-quick][-speed]/.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
import tf_keras

import tpu_embedding
from benchmarks import cases, worker
from examples.data import drifting_ratings
from tpu_embedding.engine import native
from tpu_embedding.managed_ids import IdMap

E = tf.tpu.experimental.embedding
HERE = os.path.dirname(os.path.abspath(__file__))
DISTINCT_KEYS = 10**8
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Zipf ranks -> scattered 64-bit keys (odd: a bijection)


def speed_settings(quick: bool) -> dict:
  """The DLRM workload of `python -m benchmarks dlrm` (benchmarks/cases.py, worker.py): 26
  tables, ten of 10^6 rows and sixteen of 10^2..10^5, dim 16, features 0-2 multi-hot, 13 dense
  features through a bottom MLP 512-256-16, concat interaction, top MLP 512-256-1, Adagrad,
  batch 4096; its ten 10^6-row tables managed (issue 28)."""
  if quick:
    return dict(
      sizes=[20_000] * 3 + [100, 1_000], managed=3, multi_hot=(0,), dense=True, dim=16,
      batch=1024, warmup=5, steps=30,
    )  # fmt: skip
  return dict(
    sizes=cases.dlrm_sizes(), managed=10, multi_hot=worker.MULTI_HOT, dense=True, dim=16,
    batch=cases.DLRM_BATCH, warmup=10, steps=300,
  )  # fmt: skip


def stress_settings(quick: bool) -> dict:
  """Beyond the issue's workload: the managed tables alone, one id a sample, no dense features,
  a top MLP 64-1. Embeddings are all of its step, so the remap's cost stands out."""
  s = speed_settings(quick)
  return dict(s, sizes=s["sizes"][: s["managed"]], multi_hot=(), dense=False)


def zipf_keys(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
  """(raw 64-bit keys, their Zipf ranks) over DISTINCT_KEYS values."""
  ranks = (rng.zipf(1.1, size=size).astype(np.uint64) - np.uint64(1)) % np.uint64(DISTINCT_KEYS)
  with np.errstate(over="ignore"):
    keys = (ranks * _MIX).view(np.int64)
  return keys, ranks.astype(np.int64)


def model_parts(s: dict, managed: bool, initializer=None, min_count: int = 1) -> tuple:
  """(layer, DLRM towers, their optimizer) of the workload `s`. `initializer`: the tables'
  (None: the workloads' RandomUniform); `min_count`: the maps'."""
  features = worker.feature_configs(tf, s["sizes"], s["dim"], initializer)
  kwargs = {}
  if managed:
    spec = tpu_embedding.ManagedIds(eviction="lfu", min_count=min_count)
    kwargs["managed_ids"] = {f"t{i}": spec for i in range(s["managed"])}
  learning_rate = worker.LR["adagrad"]
  layer = tpu_embedding.TPUEmbedding(features, optimizer=E.Adagrad(learning_rate), **kwargs)
  towers = (
    worker.dlrm_towers(tf_keras) if s["dense"] else worker.dlrm_towers(tf_keras, None, (64, 1))
  )
  return layer, towers, tf_keras.optimizers.legacy.Adagrad(learning_rate)


def train_step(parts: tuple, s: dict, inputs, dense, labels, remapped: bool = False):
  """One training step of `model_parts`' model on one batch; its loss."""
  layer, towers, optimizer = parts
  with tf.GradientTape() as tape:
    out = layer(inputs, remapped=remapped)
    flat = [out[f"f{i}"] for i in range(len(s["sizes"]))]
    loss = worker.dlrm_loss(tf, towers, flat, dense, labels)
  variables = layer.trainable_variables + worker.tower_variables(towers)
  optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
  return loss


def _model(s: dict, managed: bool, initializer=None, min_count: int = 1):
  """(layer, training step, embedding-only step) of the workload `s` (`model_parts`): the
  second trains the layer alone on the sum of its outputs, the embedding part's own step."""
  parts = model_parts(s, managed, initializer, min_count)
  layer = parts[0]

  @tf.function
  def step(inputs, dense, labels, remapped=False):
    return train_step(parts, s, inputs, dense, labels, remapped)

  @tf.function
  def embedding_step(inputs):
    with tf.GradientTape() as tape:
      loss = tf.add_n([tf.reduce_sum(v) for v in layer(inputs).values()])
    tape.gradient(loss, layer.trainable_variables)  # the layer applies its own update
    return loss

  return layer, step, embedding_step


def batches(s: dict, count: int, seed: int):
  """(raw keys, pre-mapped ids, dense features, labels) of `count` batches. A managed table's
  feature takes raw keys (`zipf_keys`); pre-mapped, their Zipf ranks modulo its rows. Other
  features take the DLRM workload's ids in both. Features in `multi_hot`: 1-5 ids a sample."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    raw, ranks = {}, {}
    for i, rows in enumerate(s["sizes"]):
      lengths = rng.integers(1, 6, s["batch"]) if i in s["multi_hot"] else None
      size = s["batch"] if lengths is None else int(lengths.sum())
      if i < s["managed"]:
        keys, rank = zipf_keys(rng, size)
        rank %= rows
      else:
        keys = rank = worker.zipf_ids(rng, rows, size)
      raw[f"f{i}"], ranks[f"f{i}"] = (
        worker.feature_tensor(tf, keys, lengths),
        worker.feature_tensor(tf, rank, lengths),
      )
    dense = tf.constant(rng.standard_normal((s["batch"], worker.DENSE_FEATURES)).astype("f4"))
    labels = tf.constant(rng.integers(0, 2, (s["batch"], 1)).astype("f4"))
    yield raw, ranks, dense, labels


def timed(fn, *args) -> tuple[float, float]:
  """(wall, CPU of the whole process) seconds of one call, results fetched (a ragged result
  by its component tensors: its `numpy()` builds one array per row, ~8 ms at batch 4096)."""
  wall, cpu = time.perf_counter(), time.process_time()
  tf.nest.map_structure(lambda t: t.numpy(), fn(*args), expand_composites=True)
  return time.perf_counter() - wall, time.process_time() - cpu


def summary(times: dict) -> dict:
  """{name}_ms, _cpu_ms (medians of wall and process CPU) and _mean_ms (mean wall) of the
  timed steps {name: [(wall, cpu) seconds]}, in milliseconds."""
  result = {}
  for name, pairs in times.items():
    result[f"{name}_ms"] = 1e3 * statistics.median(w for w, _ in pairs)
    result[f"{name}_cpu_ms"] = 1e3 * statistics.median(c for _, c in pairs)
    result[f"{name}_mean_ms"] = 1e3 * statistics.mean(w for w, _ in pairs)
  return result


def fill(layer, s: dict, min_count: int = 1) -> None:
  """Gives every row of every map a key first, so that timed steps evict as a full map does
  (at 10^6 rows a Zipf stream of a few thousand keys a step would take hundreds of steps): each
  key `min_count` times, the maps' admission count."""
  rng = np.random.default_rng(2)
  keys = {f"f{i}": rng.integers(-(2**62), 2**62, s["sizes"][i] - 1) for i in range(s["managed"])}
  layer.remap({name: np.repeat(k, min_count) for name, k in keys.items()})


def run_speed(s: dict) -> dict:
  """Each batch runs through every variant in turn (interleaved, so that a change in the
  machine's load hits all of them alike); medians and means of wall and of process CPU time."""
  data = list(batches(s, s["warmup"] + s["steps"], seed=0))
  _, premapped_step, embedding_step = _model(s, managed=False)
  _, map_rows_step, map_rows_embedding_step = _model(s, managed=False)  # its own tables
  layer, managed_step, _ = _model(s, managed=True)
  remap_layer, _, _ = _model(s, managed=True)
  zeros_layer, zeros_step, _ = _model(s, managed=True, initializer=tf.zeros_initializer())
  twice_layer, twice_step, _ = _model(s, managed=True, min_count=2)
  for filled in (layer, remap_layer, zeros_layer):
    fill(filled, s)
  fill(twice_layer, s, min_count=2)
  remap = tf.function(remap_layer.remap)
  given = {}  # the rows the remap just gave this batch (the managed model's rows)

  def remapped(raw):
    given["rows"] = remap(raw)
    return given["rows"]

  variants = {
    "premapped": lambda raw, ranks, x, y: premapped_step(ranks, x, y),
    "managed": lambda raw, ranks, x, y: managed_step(raw, x, y),
    "managed_zeros": lambda raw, ranks, x, y: zeros_step(raw, x, y),
    "managed_twice": lambda raw, ranks, x, y: twice_step(raw, x, y),
    "embedding": lambda raw, ranks, x, y: embedding_step(ranks),
    "remap": lambda raw, ranks, x, y: remapped(raw),
    # The same two steps on the rows the map gave: the same lookups as the managed model, so
    # the difference is the remap's own cost (the map gives new keys neighbouring rows, which
    # read faster than rank-ordered ids whose long tail wraps over every row).
    "premapped_map_rows": lambda raw, ranks, x, y: map_rows_step(given["rows"], x, y),
    "embedding_map_rows": lambda raw, ranks, x, y: map_rows_embedding_step(given["rows"]),
  }
  times = {name: [] for name in variants}
  for i, batch in enumerate(data):
    for name, fn in variants.items():
      took = timed(fn, *batch)
      if i >= s["warmup"]:
        times[name].append(took)
  result = dict(settings=s, load_average=os.getloadavg(), **summary(times))
  result.update(
    keys_held_t0=int(layer.managed_ids["t0"].size()),
    keys_held_t0_min_count_2=int(twice_layer.managed_ids["t0"].size()),
    rows_t0=s["sizes"][0] - 1,
  )
  return result


def run_pipelined(s: dict, blocks: int = 3) -> dict:
  """The managed model with its remap as a `tf.data` map (`defer_resets`, prefetch 2: the maps
  run ahead, overlapping the steps) and each batch's resets written in its step's function,
  against the pre-mapped model's loop over the same batches (ids from a prefetching `tf.data`
  too); blocks of each alternate. Mean wall and process CPU time a step."""
  per_block = s["steps"] // blocks
  data = list(batches(s, s["warmup"] + blocks * per_block, seed=1))
  raw, ranks, dense, labels = (tf.nest.map_structure(_stacked, *part) for part in zip(*data))
  _, premapped_step, _ = _model(s, managed=False)
  layer, step, _ = _model(s, managed=True)
  fill(layer, s)

  # Resets are padded to the batch's keys, whose number multi-hot features vary: one trace for
  # every length.
  @tf.function(reduce_retracing=True)
  def train(rows, resets, x, y):
    layer.reset_rows(resets)  # before the step's lookup: ordered as written
    return step(rows, x, y, True)

  options = tf.data.Options()
  options.autotune.enabled = False  # a sequential, stateful map: nothing for it to tune
  premapped = tf.data.Dataset.from_tensor_slices((ranks, dense, labels)).with_options(options)
  pipelined = (
    tf.data.Dataset.from_tensor_slices((raw, dense, labels))
    .map(lambda keys, x, y: (layer.remap(keys, defer_resets=True), x, y))
    .with_options(options)
  )
  loops = {  # made once: a dataset traces its map function when it is made
    "premapped": (iter(premapped.prefetch(2)), premapped_step),
    "pipelined": (iter(pipelined.prefetch(2)), lambda batch, x, y: train(*batch, x, y)),
  }
  totals = {name: [0.0, 0.0] for name in loops}
  for block in range(-1, blocks):  # block -1: the warm-up batches, not counted
    for name, (iterator, step_of) in loops.items():
      wall, cpu = _timed_loop(iterator, step_of, s["warmup"] if block < 0 else per_block)
      if block >= 0:
        totals[name][0] += wall
        totals[name][1] += cpu
  result = {}
  for name, (wall, cpu) in totals.items():
    result[f"{name}_mean_ms"] = 1e3 * wall / (blocks * per_block)
    result[f"{name}_cpu_ms"] = 1e3 * cpu / (blocks * per_block)
  return result


def _stacked(*tensors: tf.Tensor) -> tf.Tensor:
  """One batch's tensors stacked along a new first axis (ragged ones as ragged)."""
  if isinstance(tensors[0], tf.RaggedTensor):
    return tf.ragged.stack(list(tensors))
  return tf.stack(tensors)


def _timed_loop(batches, step, count: int) -> tuple[float, float]:
  """(wall, process CPU seconds) of `step` on the next `count` batches of the iterator
  `batches`, results fetched."""
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(count):
    loss = step(*next(batches))
  loss.numpy()
  return time.perf_counter() - wall, time.process_time() - cpu


# DynamicLookup compares every key with every vocabulary entry ([batch, rows] booleans per
# table and step): above this many it would not fit in memory here.
_DYNAMIC_EMBEDDING_MAX_CELLS = 5 * 10**7
_DYNAMIC_EMBEDDING_STEPS = 5  # timed, after one warm-up step


def run_dynamic_embedding(s: dict) -> dict:
  """tf_keras's DynamicEmbedding in the stress model: keys as decimal strings (its vocabulary
  rebuild concatenates a string "UNK" token, so int64 keys fail there); the step learns the
  vocabulary's counts, `update_embeddings` (its callback's periodic rebuild) is timed apart."""
  from tf_keras.layers.experimental import DynamicEmbedding

  rows = s["sizes"][0]
  cells = s["batch"] * rows
  if cells > _DYNAMIC_EMBEDDING_MAX_CELLS:
    return dict(
      skipped=f"its lookup compares each key with each vocabulary entry: {cells:.1e} booleans "
      f"per table and step (batch {s['batch']} x {rows} rows) do not fit here"
    )
  layers = [DynamicEmbedding(rows, s["dim"], tf.string) for _ in s["sizes"]]
  towers = worker.dlrm_towers(tf_keras, None, (64, 1))
  optimizer = tf_keras.optimizers.legacy.Adagrad(worker.LR["adagrad"])

  @tf.function
  def step(inputs, dense, labels):
    with tf.GradientTape() as tape:
      out = [layer(inputs[f"f{i}"]) for i, layer in enumerate(layers)]
      loss = worker.dlrm_loss(tf, towers, out, dense, labels)
    variables = [v for x in layers for v in x.trainable_variables]
    variables += worker.tower_variables(towers)
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  data = [
    ({k: tf.strings.as_string(v) for k, v in raw.items()}, x, y)
    for raw, _, x, y in batches(s, _DYNAMIC_EMBEDDING_STEPS + 1, seed=0)
  ]
  times = [timed(step, *batch)[0] for batch in data][1:]  # seconds a step: a few suffice
  start = time.perf_counter()
  for layer in layers:
    layer.update_embeddings(tf.distribute.get_strategy())
  return dict(step_ms=1e3 * statistics.median(times), rebuild_s=time.perf_counter() - start)


# TFRA 0.8.1 (its newest cp311 wheel) requires tensorflow >= 2.11, <= 2.16.2: it cannot install
# beside this package's TensorFlow, so it runs in an environment of its own.
TFRA_ENV = "TFRA_PYTHON"


def run_tfra(s: dict) -> dict:
  """benchmarks/managed_tfra.py under the interpreter `$TFRA_PYTHON` names, if any."""
  python = os.environ.get(TFRA_ENV)
  if not python:
    return dict(
      skipped=f"set {TFRA_ENV} to a Python with tensorflow-cpu==2.16.2 and "
      "tensorflow-recommenders-addons==0.8.1 (TFRA needs TF <= 2.16.2)"
    )
  settings = {k: s[k] for k in ("dim", "batch", "warmup", "steps")}
  settings.update(tables=len(s["sizes"]), distinct=DISTINCT_KEYS)
  done = subprocess.run(
    [python, os.path.join(HERE, "managed_tfra.py"), json.dumps(settings)],
    capture_output=True,
    text=True,
    timeout=1800,
  )
  if done.returncode != 0:
    return dict(skipped=f"failed: {done.stderr.strip().splitlines()[-1:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def run_mirrored(s: dict) -> dict:
  """benchmarks/managed_mirrored.py in its own process (2 logical CPUs, MirroredStrategy)."""
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.managed_mirrored", json.dumps(s)],
    cwd=os.path.dirname(HERE),
    capture_output=True,
    text=True,
    timeout=3600,
  )
  if done.returncode != 0:
    return dict(skipped=f"failed: {done.stderr.strip().splitlines()[-1:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def run_memory(rows: int, batch: int) -> dict:
  """Bytes per row of a full map: variables exactly; the compiled kernel's key -> row table and
  eviction index from their sizes (exact, and the index's bound); without the kernels, TF's
  hash table as the resident-memory growth of filling it at once."""
  full = IdMap(tpu_embedding.ManagedIds(), "m", rows)
  variables = (full.keys, full.counts, full.last_seen)
  variable_bytes = sum(v.dtype.size * int(np.prod(v.shape)) for v in variables)
  on_kernels = native.enabled()
  if on_kernels:
    table_bytes, index_bytes = _table_bytes(rows), _index_bound(rows, batch)
  else:
    keys = tf.constant(np.random.default_rng(1).integers(-(2**62), 2**62, size=rows - 1))
    values = tf.range(1, rows, dtype=tf.int64)  # made before, so only the table's growth counts
    before = _rss_bytes()
    full.rows_of_keys.insert(keys, values)
    table_bytes, index_bytes = max(_rss_bytes() - before, 0), 0
  return dict(
    rows=rows,
    table="the kernel's (exact)" if on_kernels else "TF's MutableHashTable (resident growth)",
    variables_bytes_per_row=variable_bytes / rows,
    hash_table_bytes_per_row=table_bytes / rows,
    index_bytes_per_row=index_bytes / rows,
    key_bytes=8,
  )


def _table_bytes(rows: int) -> int:
  """The kernel's key -> row table (engine/cc/managed_ids.cc, `RowTable::SlotsFor`): a power of
  two of 8-byte slots (row, hash), at least 8, at most 70 % used."""
  slots = 8
  while slots * 7 < rows * 10:
    slots *= 2
  return 8 * slots


def _index_bound(rows: int, batch: int) -> int:
  """Most bytes of one map's eviction index under LFU/LRU (engine/cc/managed_ids.cc): a pool of
  `pool` entries of 12 B, compacted beyond twice that; `pool` = rows / 4 within [1024, 2**18]
  (at most `rows`), or 2 * wanted + seen rows when a step wants more. TTL adds 8 B per row
  freed below the free-row cursor."""
  pool = max(min(rows, max(1024, min(rows // 4, 1 << 18))), 3 * batch)
  return 2 * pool * 12


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize()


# ---------------------------------------------------------------------------------------------
# Quality: progressive validation on a drifting stream


def quality_settings(quick: bool) -> dict:
  if quick:
    return dict(days=10, batches_per_day=20, batch=512, new_items_per_day=200)
  return dict(days=30, batches_per_day=40, batch=1024, new_items_per_day=1000)


def _quality_model(capacity: int, managed: bool):
  table = E.TableConfig(capacity, 1, initializer=tf.zeros_initializer(), name="items")
  kwargs = {}
  if managed:
    kwargs["managed_ids"] = {
      "items": tpu_embedding.ManagedIds(eviction="lfu", min_count=2, lfu_half_life_steps=20)
    }
  layer = tpu_embedding.TPUEmbedding(
    {"item": E.FeatureConfig(table, name="item")}, optimizer=E.Adagrad(0.2), **kwargs
  )

  @tf.function
  def step(ids, labels):
    with tf.GradientTape() as tape:
      logits = layer({"item": ids})["item"][:, 0]
      losses = tf.nn.sigmoid_cross_entropy_with_logits(labels, logits)
      loss = tf.reduce_sum(losses)  # per-example gradients: each item's own evidence counts
    tape.gradient(loss, layer.trainable_variables)
    return tf.reduce_mean(losses)  # scored before this batch's update reaches the table

  return step


def run_quality(s: dict) -> dict:
  total = s["days"] * s["new_items_per_day"]
  capacity = total // 2
  variants = {
    "managed ids": (_quality_model(capacity, True), lambda keys, items: keys),
    "hashing trick": (_quality_model(capacity, False), lambda keys, items: keys % capacity),
    "full vocabulary": (_quality_model(total, False), lambda keys, items: items),
  }
  curves = {name: [[] for _ in range(s["days"])] for name in variants}
  for day, keys, items, labels in drifting_ratings.rating_stream(**s):
    for name, (step, ids_of) in variants.items():
      curves[name][day].append(float(step(tf.constant(ids_of(keys, items)), labels)))
  return dict(
    settings=s,
    capacity=capacity,
    distinct_items=total,
    log_loss_by_day={n: [float(np.mean(d)) for d in c] for n, c in curves.items()},
  )


def plot(quality: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for name, curve in quality["log_loss_by_day"].items():
    ax.plot(range(1, len(curve) + 1), curve, label=name)
  ax.set_xlabel("day")
  ax.set_ylabel("progressive log loss (lower is better)")
  ax.set_title(
    f"capacity {quality['capacity']} rows for {quality['distinct_items']} distinct items"
  )
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def report(result: dict) -> str:
  sp, stress, mem, q = result["speed"], result["stress"], result["memory"], result["quality"]
  lines = [
    f"# Managed ids ({'quick' if result['quick'] else 'full'})",
    "",
    f"Keys of managed tables Zipf(1.1) over {DISTINCT_KEYS:.0e} 64-bit values, maps full before "
    "timing; variants interleaved batch by batch, medians and means; "
    f"{os.cpu_count()} CPUs.",
    "",
    f"## The DLRM workload ({_shape(sp['settings'])}), its managed tables' maps",
    "",
    *_speed_table(sp),
    f"Table t0's map held {sp['keys_held_t0']} keys in {sp['rows_t0']} rows at the end "
    f"({sp['keys_held_t0_min_count_2']} with min_count=2).",
    "",
    f"## Beyond the issue: the managed tables alone ({_shape(stress['settings'])})",
    "",
    *_speed_table(stress, result["dynamic"], result["tfra"]),
    f"Map memory at {mem['rows']} rows: {mem['variables_bytes_per_row']:.0f} B/row of variables "
    f"(key copy 8, count 4, last seen 4) + {mem['hash_table_bytes_per_row']:.0f} B/row of "
    f"{mem['table']} key -> row table + at most "
    f"{mem['index_bytes_per_row']:.1f} B/row of eviction index "
    f"= {_bytes_per_row(mem):.0f} B/row; keys {mem['key_bytes']} B.",
    "",
    "Targets (issue 28), on the DLRM workload:",
    *_verdicts(sp, "whole DLRM step"),
    _pipelined_verdict(result["pipelined"]),
    f"- map memory <= 48 B/row + key bytes ({48 + mem['key_bytes']} B): "
    f"{_bytes_per_row(mem):.0f} B/row: "
    f"{'MET' if _bytes_per_row(mem) <= 48 + mem['key_bytes'] else 'NOT MET'}",
    "The same, on the managed tables alone (no dense part: beyond the issue's workload):",
    *_verdicts(stress, "whole step of the managed tables alone"),
    "",
    *_mirrored_section(result.get("mirrored"), sp),
  ]
  if q is not None:
    lines += [
      "",
      f"Quality: {q['distinct_items']} items appearing over {q['settings']['days']} days, "
      f"capacity {q['capacity']}; mean progressive log loss over the last half of the days:",
      "",
      "| variant | log loss |",
      "|---|---|",
    ]
    half = q["settings"]["days"] // 2
    for name, curve in q["log_loss_by_day"].items():
      lines.append(f"| {name} | {np.mean(curve[half:]):.4f} |")
  for name, other in (("DynamicEmbedding", result["dynamic"]), ("TFRA", result["tfra"])):
    if "skipped" in other:
      lines += ["", f"{name} not run: {other['skipped']}."]
  if "rebuild_s" in result["dynamic"]:
    lines += [
      "",
      f"DynamicEmbedding's vocabulary rebuild (its callback's, every N seconds): "
      f"{result['dynamic']['rebuild_s']:.2f} s for all tables.",
    ]
  return "\n".join(lines) + "\n"


def _shape(s: dict) -> str:
  managed = s["sizes"][: s["managed"]]
  text = (
    f"{len(s['sizes'])} tables, {s['managed']} managed of {managed[0]} rows, dim {s['dim']}, "
    f"batch {s['batch']}, {s['steps']} steps"
  )
  if s["multi_hot"]:
    text += f", features {', '.join(map(str, s['multi_hot']))} multi-hot (1-5 ids)"
  if s["dense"]:
    text += ", 13 dense features, bottom MLP 512-256-16, top MLP 512-256-1"
  else:
    text += ", no dense features, top MLP 64-1"
  return text


def _speed_table(sp: dict, *others: dict) -> list[str]:
  premapped, premapped_cpu = sp["premapped_ms"], sp["premapped_cpu_ms"]
  lines = [
    "| variant | step ms (wall, median) | vs pre-mapped | process CPU ms | vs pre-mapped "
    "| mean wall ms | vs pre-mapped |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, key in (
    ("pre-mapped row ids (whole step)", "premapped"),
    ("managed ids (whole step, remap in the call)", "managed"),
    ("  the same, tables initialized to zeros (resets draw nothing)", "managed_zeros"),
    ("  the same, min_count=2 (keys seen once never get a row)", "managed_twice"),
    ("embedding part alone (pre-mapped ids)", "embedding"),
    ("remap alone (layer.remap, all managed tables)", "remap"),
    ("pre-mapped step fed the rows the map gave", "premapped_map_rows"),
    ("embedding part alone, the rows the map gave", "embedding_map_rows"),
  ):
    wall, cpu, mean = sp[f"{key}_ms"], sp[f"{key}_cpu_ms"], sp[f"{key}_mean_ms"]
    lines.append(
      f"| {name} | {wall:.1f} | {wall / premapped:.2f}x | {cpu:.1f} | {cpu / premapped_cpu:.2f}x "
      f"| {mean:.1f} | {mean / sp['premapped_mean_ms']:.2f}x |"
    )
  names = ("tf_keras DynamicEmbedding (string keys; rebuild apart)", "TFRA dynamic embedding "
           "(unbounded, TF 2.16)")  # fmt: skip
  lines += [_other_row(name, other, sp) for name, other in zip(names, others)]
  load = ", ".join(f"{x:.1f}" for x in sp["load_average"])
  return lines + ["", f"Load average at the end: {load}.", ""]


def _verdicts(sp: dict, whole: str) -> list[str]:
  return [
    _verdict(f"{whole} <= 1.15x the pre-mapped one", sp, "managed", "premapped", 1.15, "x"),
    _verdict("remap <= the embedding part's own step", sp, "remap", "embedding", 1.0, "x of it"),
    "  The same two against the steps fed the rows the map gave (the remap's own cost):",
    _verdict("  whole step <= 1.15x", sp, "managed", "premapped_map_rows", 1.15, "x"),
    _verdict("  remap <= the embedding part", sp, "remap", "embedding_map_rows", 1.0, "x of it"),
  ]


def _mirrored_section(mirrored: dict, single: dict) -> list[str]:
  """The DLRM workload under MirroredStrategy (issue 44) beside the single-device figures."""
  lines = ["## The DLRM workload under MirroredStrategy, 2 logical CPUs (issue 44)", ""]
  if mirrored is None or "skipped" in mirrored:
    return lines + [f"Not run: {(mirrored or {}).get('skipped', 'no result')}."]
  lines += [
    "Raw keys inside `strategy.run` (the replicas' keys gathered, one map step per global "
    "batch) against the same model fed pre-mapped rows; single-device figures of this run "
    "beside them.",
    "",
    "| | pre-mapped ms (median wall) | managed ms | ratio | ratio, process CPU "
    "| ratio, mean wall |",
    "|---|---|---|---|---|---|",
  ]
  for name, sp in (("MirroredStrategy, 2 replicas", mirrored), ("one device", single)):
    ratios = [sp[f"managed{p}"] / sp[f"premapped{p}"] for p in ("_ms", "_cpu_ms", "_mean_ms")]
    lines.append(
      f"| {name} | {sp['premapped_ms']:.1f} | {sp['managed_ms']:.1f} | "
      + " | ".join(f"{r:.2f}x" for r in ratios)
      + " |"
    )
  load = ", ".join(f"{x:.1f}" for x in mirrored["load_average"])
  return lines + [
    "",
    _verdict("MirroredStrategy step <= 1.15x the pre-mapped one", mirrored, "managed",
             "premapped", 1.15, "x"),
    f"Load average at its end: {load}.",
  ]  # fmt: skip


def _other_row(name: str, other: dict, speed: dict) -> str:
  if "skipped" in other:
    return f"| {name} | not run | | | | | |"
  ratio = other["step_ms"] / speed["premapped_ms"]
  return f"| {name} | {other['step_ms']:.1f} | {ratio:.2f}x | | | | |"


def _bytes_per_row(memory: dict) -> float:
  return sum(memory[f"{part}_bytes_per_row"] for part in ("variables", "hash_table", "index"))


def _pipelined_verdict(pipelined: dict) -> str:
  wall = pipelined["pipelined_mean_ms"] / pipelined["premapped_mean_ms"]
  cpu = pipelined["pipelined_cpu_ms"] / pipelined["premapped_cpu_ms"]
  met = lambda ratio: "MET" if ratio <= 1.15 else "NOT MET"
  return (
    f"- whole DLRM step <= 1.15x, the remap in the input pipeline (tf.data map, defer_resets; "
    f"loops over the same batches, mean of each): {pipelined['pipelined_mean_ms']:.1f} against "
    f"{pipelined['premapped_mean_ms']:.1f} ms, wall {wall:.2f}x ({met(wall)}), process CPU "
    f"{cpu:.2f}x ({met(cpu)})"
  )


def _verdict(target: str, speed: dict, key: str, base: str, bound: float, unit: str) -> str:
  """Met or not by the median wall time, the median process CPU time and the mean wall time
  (which counts the steps that rebuild an eviction pool)."""
  met = lambda ratio: "MET" if ratio <= bound else "NOT MET"
  ratios = [
    speed[f"{key}{part}"] / speed[f"{base}{part}"] for part in ("_ms", "_cpu_ms", "_mean_ms")
  ]
  wall, cpu, mean = ratios
  return (
    f"- {target}: wall {wall:.2f}{unit} ({met(wall)}), process CPU {cpu:.2f}{unit} ({met(cpu)}), "
    f"mean wall {mean:.2f}{unit} ({met(mean)})"
  )


def main(quick: bool, out_dir: str, speed_only: bool = False) -> None:
  """`speed_only` (`--speed-only`) leaves out the quality stream, the longest part."""
  os.makedirs(out_dir, exist_ok=True)
  result = dict(quick=quick)
  s, stress = speed_settings(quick), stress_settings(quick)
  result["memory"] = run_memory(200_000 if quick else 1_000_000, s["batch"])  # first: small heap
  result["quality"] = None if speed_only else run_quality(quality_settings(quick))
  result["speed"] = run_speed(s)
  gc.collect()  # each run's models hold GBs of tables in reference cycles (tf.function's)
  result["pipelined"] = run_pipelined(s)
  gc.collect()
  result["mirrored"] = run_mirrored(s)
  result["stress"] = run_speed(stress)
  result["dynamic"] = run_dynamic_embedding(stress)
  result["tfra"] = run_tfra(stress)
  with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  if result["quality"] is not None:
    plot(result["quality"], os.path.join(out_dir, "quality.png"))
  text = report(result)
  with open(os.path.join(out_dir, "RESULTS.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  print(f"Wrote {out_dir}", file=sys.stderr)
