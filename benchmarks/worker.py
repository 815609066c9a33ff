"""One measurement in one fresh process: `python -m benchmarks.worker '<json spec>'`.

The runner (`benchmarks.harness`) starts this module once per (case, implementation, round) so
that every implementation gets a clean interpreter, a clean TensorFlow runtime and its own
peak-RSS figure. It prints one line `RESULT {json}` on stdout.

Implementations (spec["impl"]):
  ours             tpu_embedding.TPUEmbedding, default engine (tables trained by the engine)
  ours-keras       tpu_embedding.TPUEmbedding(..., table_updates="keras")
  ours-partial     tpu_embedding.PartialTPUEmbedding(..., size_threshold=None): every table on
                   its replicated side
  tfrs             tensorflow-recommenders 0.7.7 tfrs.layers.embedding.TPUEmbedding (CPU path)
  keras-embedding  one tf_keras.layers.Embedding per table, trained by the same Keras optimizer
  dense-only       constant activations, no embedding work (DLRM workload only: the bound)

spec["jit_compile"] compiles the training step with XLA (`tf.function(jit_compile=True)`).

Workloads (spec["workload"]):
  dlrm   13 dense features -> bottom MLP 512-256-16; 26 embeddings; concat interaction;
         top MLP 512-256-1; binary cross-entropy
  emb    the embedding layer alone, loss = sum of squared activations
  limit  the machine's random-row gather / scatter bandwidth (NumPy and tf.gather)
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if SPEC.get("impl") == "tfrs":
  # tfrs 0.7.7 only imports with legacy Keras; must be set before TensorFlow is imported.
  os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402  (after the environment variable above)

ZIPF_A = 1.2
MULTI_HOT = (0, 1, 2)  # features with 1-5 ids each (ragged, sum combiner)
DENSE_FEATURES = 13  # the DLRM's, into its bottom MLP
LR = {"adagrad": 0.01, "adam": 0.001}


def vmhwm_bytes() -> int:
  """Peak resident set size of this process (VmHWM), in bytes."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return 0


def zipf_ids(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
  return ((rng.zipf(ZIPF_A, n) - 1) % vocab).astype(np.int64)


def make_id_batches(sizes, batch, num_batches, multi_hot, seed=0):
  """[{feature: (ids, row_lengths or None)}]: the same ids for every implementation."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(num_batches):
    feats = {}
    for i, vocab in enumerate(sizes):
      if i in multi_hot:
        lens = rng.integers(1, 6, batch)
        feats[f"f{i}"] = (zipf_ids(rng, vocab, int(lens.sum())), lens)
      else:
        feats[f"f{i}"] = (zipf_ids(rng, vocab, batch), None)
    batches.append(feats)
  return batches


def unique_rows(batches) -> float:
  """Mean number of distinct (table, row) pairs touched per step."""
  return float(np.mean([sum(len(np.unique(ids)) for ids, _ in b.values()) for b in batches]))


def run_limit(spec) -> dict:
  """Random-row gather and scatter bandwidth of this machine, GB/s (row bytes moved / s)."""
  rng = np.random.default_rng(0)
  out = {f"{rows}x{dim}": _limit_of_shape(rows, dim, spec, rng) for rows, dim in spec["shapes"]}
  return {"limit": out, "vmhwm": vmhwm_bytes()}


def _limit_of_shape(rows: int, dim: int, spec, rng) -> dict:
  """The bandwidths for one table shape; its table is freed on return, before the next one."""
  import tensorflow as tf

  table = np.ones((rows, dim), np.float32)
  n = spec["n_rows"]
  idx = rng.integers(0, rows, n)
  uidx = np.unique(idx)
  vals = np.ones((len(uidx), dim), np.float32)
  tt = tf.Variable(table)
  tidx = tf.constant(idx)

  def best(fn, reps=spec["reps"]):  # all repetitions, not just the best
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    return times

  row_bytes = dim * 4
  out_rows = np.empty((n, dim), np.float32)
  tk = best(lambda: np.take(table, idx, axis=0, out=out_rows))
  g = best(lambda: table[idx])
  s = best(lambda: table.__setitem__(uidx, vals))
  gather = tf.function(lambda: tf.reduce_sum(tf.gather(tt, tidx)[:, 0]))
  gather()
  tg = best(lambda: gather().numpy())
  return {
    "numpy_take_gbs": [n * row_bytes / t / 1e9 for t in tk],
    "numpy_gather_gbs": [n * row_bytes / t / 1e9 for t in g],
    "numpy_scatter_gbs": [len(uidx) * row_bytes / t / 1e9 for t in s],
    "tf_gather_gbs": [n * row_bytes / t / 1e9 for t in tg],
  }


def build(spec):
  """(layer, keras optimizer, feature dict -> activations list, list of table configs)."""
  import tensorflow as tf
  import tf_keras

  e = tf.tpu.experimental.embedding
  impl, opt = spec["impl"], spec["opt"]
  fc = feature_configs(tf, spec["sizes"], spec["dim"])
  tables = [f.table for f in fc.values()]
  lr = LR[opt]
  k = (tf.keras if impl == "tfrs" else tf_keras).optimizers
  # The legacy optimizers' sparse updates deduplicate with tf.unique, which XLA cannot compile:
  # Keras Embedding tables under XLA take the current ones (every other variable is dense).
  k = k if spec.get("jit_compile") and impl == "keras-embedding" else k.legacy
  keras_opt = k.Adagrad(lr) if opt == "adagrad" else k.Adam(lr)
  mid_opt = e.Adagrad(lr) if opt == "adagrad" else e.Adam(lr)
  if impl == "ours":
    import tpu_embedding

    layer = tpu_embedding.TPUEmbedding(fc, mid_opt)
  elif impl == "ours-keras":
    import tpu_embedding

    layer = tpu_embedding.TPUEmbedding(fc, mid_opt, table_updates="keras")
  elif impl == "ours-partial":
    import tpu_embedding

    layer = tpu_embedding.PartialTPUEmbedding(fc, mid_opt, size_threshold=None)
  elif impl == "tfrs":
    import tensorflow_recommenders as tfrs

    layer = tfrs.layers.embedding.TPUEmbedding(fc, keras_opt)
  elif impl == "keras-embedding":
    layer = KerasEmbeddings(tables, tf_keras)
  elif impl == "dense-only":
    layer = ConstantActivations(spec["dim"])
  else:
    raise ValueError(impl)
  return layer, keras_opt


def feature_configs(tf, sizes, dim: int, initializer=None) -> dict:
  """{"f<i>": FeatureConfig of table "t<i>" with sizes[i] rows}, sum combiner. The initializer
  defaults to the workloads' RandomUniform(-0.05, 0.05), the same values' law for every
  implementation; not TF's default TruncatedNormal: both peak at table + 2 temporaries while
  initialising, but TruncatedNormal takes 2.5x longer."""
  e = tf.tpu.experimental.embedding
  init = initializer or tf.initializers.RandomUniform(-0.05, 0.05)
  tables = [
    e.TableConfig(vocabulary_size=int(v), dim=dim, name=f"t{i}", combiner="sum", initializer=init)
    for i, v in enumerate(sizes)
  ]
  return {f"f{i}": e.FeatureConfig(table=t, name=f"f{i}") for i, t in enumerate(tables)}


def feature_tensor(tf, ids: np.ndarray, lengths):
  """One feature's ids as a tensor: dense, or ragged by `lengths` (ids per sample) if given."""
  if lengths is None:
    return tf.constant(ids)
  return tf.RaggedTensor.from_row_lengths(tf.constant(ids), tf.constant(lengths))


def dlrm_towers(tf_keras, bottom=(512, 256, 16), top=(512, 256, 1)) -> tuple:
  """(bottom MLP or None, top MLP, loss): the DLRM workload's dense part. Relu after every
  layer but the top's last, which gives the logit."""

  def mlp(units):
    last = units[-1]
    return tf_keras.Sequential(
      [tf_keras.layers.Dense(u, activation="relu") for u in units[:-1]]
      + [tf_keras.layers.Dense(last, activation="relu" if last > 1 else None)]
    )

  bce = tf_keras.losses.BinaryCrossentropy(from_logits=True)
  return (mlp(bottom) if bottom else None), mlp(top), bce


def dlrm_loss(tf, towers: tuple, activations: list, dense, labels):
  """Concat interaction: the bottom MLP's output on the dense features (if there is a bottom)
  beside every feature's activations, through the top MLP; binary cross-entropy."""
  bottom, top, bce = towers
  x = tf.concat(([bottom(dense)] if bottom is not None else []) + activations, axis=1)
  return bce(labels, top(x))


def tower_variables(towers: tuple) -> list:
  return [v for tower in towers[:2] if tower is not None for v in tower.trainable_variables]


class KerasEmbeddings:
  """Plain `tf_keras.layers.Embedding` per table; ragged multi-hot features summed."""

  def __init__(self, tables, tf_keras):
    import tensorflow as tf

    self._tf = tf
    self.layers = {
      f"f{i}": tf_keras.layers.Embedding(
        t.vocabulary_size, t.dim, embeddings_initializer=t.initializer, name=t.name
      )
      for i, t in enumerate(tables)
    }

  def __call__(self, feats):
    out = {}
    for name, x in feats.items():
      y = self.layers[name](x)
      out[name] = self._tf.reduce_sum(y, axis=1) if isinstance(x, self._tf.RaggedTensor) else y
    return out

  @property
  def trainable_variables(self):
    return [v for layer in self.layers.values() for v in layer.trainable_variables]


class ConstantActivations:
  """The DLRM's embedding inputs as constants: the model's dense part alone."""

  trainable_variables = ()

  def __init__(self, dim: int):
    self._dim = dim

  def __call__(self, feats):
    import tensorflow as tf

    batch = lambda x: x.nrows() if isinstance(x, tf.RaggedTensor) else tf.shape(x, tf.int64)[0]
    return {name: tf.fill(tf.stack([batch(x), self._dim]), 0.01) for name, x in feats.items()}


def run_train(spec) -> dict:
  """Builds each table group once, then measures its workloads in order.

  spec: impl, opt, dim, warmup, reps, rep_seconds, max_steps, budget_s and
  groups: [{"sizes": [rows per table], "multi_hot": [feature indices],
            "measure": [{"workload": "emb"|"dlrm", "batch": int}, ...]}].
  Returns {"measurements": [...], ...}; each measurement has its own VmHWM, read right after it
  (the first group's figure is the clean peak of a fresh process, building included).
  """
  t_start = time.perf_counter()
  import gc

  import tensorflow as tf
  import tf_keras

  t_import = time.perf_counter() - t_start
  rss_after_import = vmhwm_bytes()
  results = []
  for group in spec["groups"]:
    sizes = group["sizes"]
    t0 = time.perf_counter()
    layer, opt = build(dict(spec, sizes=sizes, dim=group.get("dim", spec["dim"])))
    t_construct = time.perf_counter() - t0
    models = {}
    for m in group["measure"]:
      res = measure(tf, tf_keras, spec, layer, opt, models, sizes, group, m)
      res["construct_s"] = t_construct
      res["kind"] = group.get("kind", "")
      res["load_avg"] = os.getloadavg()[0]
      results.append(res)
    del layer, opt, models
    gc.collect()
  return {"measurements": results, "import_s": t_import, "rss_after_import": rss_after_import}


def prepare(tf, tf_keras, spec, layer, opt, models, sizes, group, m):
  """(batches, the tf.function training step, unique rows per step) for one measurement."""
  batch, workload = m["batch"], m["workload"]
  multi = tuple(group.get("multi_hot", ()))
  raw = make_id_batches(sizes, batch, spec["num_batches"], multi, seed=spec.get("seed", 0))
  uniq = unique_rows(raw)
  rng = np.random.default_rng(1)

  def to_tf(b):
    feats = {}
    for name, (ids, lens) in b.items():
      feats[name] = feature_tensor(tf, ids, lens)
    dense = tf.constant(rng.standard_normal((batch, DENSE_FEATURES)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 2, (batch, 1)).astype(np.float32))
    return feats, dense, labels

  batches = [to_tf(b) for b in raw]
  del raw
  dlrm = workload == "dlrm"
  if dlrm and "mlp" not in models:
    models["mlp"] = dlrm_towers(tf_keras)

  @tf.function(jit_compile=spec.get("jit_compile", False))
  def step(feats, dense, labels):
    with tf.GradientTape() as tape:
      acts = layer(feats)
      flat = [acts[k] for k in sorted(acts, key=lambda s: int(s[1:]))]
      if dlrm:
        loss = dlrm_loss(tf, models["mlp"], flat, dense, labels)
      else:
        loss = tf.add_n([tf.reduce_sum(tf.square(a)) for a in flat])
    variables = list(layer.trainable_variables)
    if dlrm:
      variables += tower_variables(models["mlp"])
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, variables))
    return loss

  return batches, step, uniq


def first_steps(tf, tf_keras, spec, layer, opt, models, sizes, group, m, steps) -> dict:
  """Seconds of the first step (tracing, compiling, building) and of the `steps - 1` next."""
  batches, step, _ = prepare(tf, tf_keras, spec, layer, opt, models, sizes, group, m)
  t0 = time.perf_counter()
  float(step(*batches[0]).numpy())
  t_first = time.perf_counter() - t0
  t0 = time.perf_counter()
  loss = None
  for k in range(1, steps):
    loss = step(*batches[k % len(batches)])
  if loss is not None:
    float(loss.numpy())
  return {"first_step_s": t_first, "next_steps_s": time.perf_counter() - t0}


def measure(tf, tf_keras, spec, layer, opt, models, sizes, group, m) -> dict:
  """Warm-up, then up to spec["reps"] timed repetitions of `steps` steps each."""
  batch, workload = m["batch"], m["workload"]
  batches, step, uniq = prepare(tf, tf_keras, spec, layer, opt, models, sizes, group, m)
  t0 = time.perf_counter()
  float(step(*batches[0]).numpy())  # traces (and, the first time, builds the tables)
  t_first = time.perf_counter() - t0
  if spec.get("jit_compile"):
    # XLA compiles once per input shape, and ragged batches differ in shape: compile each
    # batch's program before timing (a training run reuses them for its whole length).
    for b in batches[1:]:
      float(step(*b).numpy())
  t0 = time.perf_counter()
  n_warm = 0
  # At least one warm-up step after the tracing one; more while they fit in a quarter budget.
  while n_warm < max(1, spec["warmup"]) and (
    n_warm == 0 or time.perf_counter() - t0 < spec["budget_s"] / 4
  ):
    n_warm += 1
    loss = step(*batches[n_warm % len(batches)])
    float(loss.numpy())
  t_one = (time.perf_counter() - t0) / n_warm
  steps = int(max(1, min(spec["max_steps"], round(spec["rep_seconds"] / max(t_one, 1e-6)))))
  deadline = time.perf_counter() + spec["budget_s"]
  times, k = [], 0
  for _ in range(spec["reps"]):
    if times and time.perf_counter() + steps * t_one > deadline:
      break
    t0 = time.perf_counter()
    for _ in range(steps):
      loss = step(*batches[k % len(batches)])
      k += 1
    float(loss.numpy())  # wait for the last step
    times.append((time.perf_counter() - t0) / steps)
  return {
    "workload": workload,
    "batch": batch,
    "sizes": sizes,
    "step_s": times,
    "steps_per_rep": steps,
    "warmup_steps": n_warm,
    "warmup_step_s": t_one,
    "first_step_s": t_first,
    "unique_rows": uniq,
    "vmhwm": vmhwm_bytes(),
    "partial": len(times) < spec["reps"],
  }


def main() -> None:
  spec = SPEC
  t0 = time.perf_counter()
  result = run_limit(spec) if spec.get("workload") == "limit" else run_train(spec)
  result["wall_s"] = time.perf_counter() - t0
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
