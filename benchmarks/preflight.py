"""`python -m benchmarks preflight [--quick] [--data_dir ml-100k]`: SparseCore pre-flight.

Speed: `preflight.sparse_core_stats` over 10^7 ids (--quick: 10^6) of a Criteo-shaped stream
(26 one-hot Zipf features over the DLRM benchmark's table sizes, global batch 16384, 8 chips of
4 SparseCores) side by side with jax-tpu-embedding's host preprocessing on the same batches (in
its own environment, benchmarks/jax_sparse_core.py; its process start and input conversion not
timed), tables unstacked in both so that both count the same partitions (their maxima are
compared); ours stacked as TF stacks them beside it. Runs alternate, ours then JAX's.
Limits: for v5p-8 (4 chips, 4 SparseCores each) and v6e-8 (8 chips, 2 each) on MovieLens 100K
ids (the synthetic stand-in unless --data_dir names ml-100k) and on the Criteo-shaped stream:
the statistics, `sparse_core_config`'s limits (headroom 0.25), what TF's defaults and those limits
would do (`preview_limits`), also with `max_ids_per_chip_per_sample=1` (a buffer too small, to
show dropping's cost), and for MovieLens the test RMSE of a CPU model trained on the batches with
TF's dropping emulated (`emulate_id_dropping`).
Cost: a MovieLens tf-keras fit with `layer.collect_sparse_core_stats` off and on, alternating.
Writes RESULTS.md and results.json under benchmarks/results/preflight[-quick]/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Iterator, Optional

import numpy as np
import tensorflow as tf
import tf_keras

from benchmarks import cases, jax_sparse_core
from examples.data import movielens
from tpu_embedding import preflight
from tpu_embedding.layer import TPUEmbedding

emb = tf.tpu.experimental.embedding
TOPOLOGIES = {"v5p-8": (4, 4), "v6e-8": (8, 2)}  # chips, SparseCores per chip
CRITEO_BATCH = 16384
MOVIELENS_BATCH = 1024
ZIPF = 1.1
SEED = 42


def criteo_config() -> dict[str, Any]:
  tables = [
    emb.TableConfig(size, 16, name=f"table_{i:02d}") for i, size in enumerate(cases.dlrm_sizes())
  ]
  return {f"feature_{i:02d}": emb.FeatureConfig(table) for i, table in enumerate(tables)}


def criteo_stream(batches: int, batch: int = CRITEO_BATCH, seed: int = SEED) -> Iterator[dict]:
  """Global batches of 26 one-hot Zipf(1.1) features, ids folded into each table's rows."""
  rng = np.random.default_rng(seed)
  sizes = cases.dlrm_sizes()
  for _ in range(batches):
    yield {f"feature_{i:02d}": (rng.zipf(ZIPF, batch) - 1) % size for i, size in enumerate(sizes)}


def _median(values: list[float]) -> float:
  return statistics.median(values)


def run_speed(quick: bool, rounds: int = 2) -> dict[str, Any]:
  ids = 10**6 if quick else 10**7
  count = -(-ids // (CRITEO_BATCH * 26))
  batches = list(criteo_stream(count))
  config = criteo_config()
  chips, cores = 8, 4
  result: dict[str, Any] = {"ids": count * CRITEO_BATCH * 26, "batches": count, "chips": chips}
  ours, ours_stacked, jax_seconds, jax_stats = [], [], [], None
  feature_tables = {name: feature.table.name for name, feature in config.items()}
  tables = {feature.table.name: feature.table.vocabulary_size for feature in config.values()}
  ragged = [{f: (v, np.ones(v.size, np.int64)) for f, v in b.items()} for b in batches]
  for _ in range(rounds):
    start = time.perf_counter()
    stats = preflight.sparse_core_stats(config, batches, num_chips=chips, stacking=False)
    ours.append(time.perf_counter() - start)
    start = time.perf_counter()
    preflight.sparse_core_stats(config, batches, num_chips=chips)
    ours_stacked.append(time.perf_counter() - start)
    if jax_sparse_core.jax_python() is not None:
      jax_stats = jax_sparse_core.run(
        ragged, tables, feature_tables, num_chips=chips, sparse_cores_per_chip=cores
      )
      jax_seconds += jax_stats["seconds"]
  result["ours_s"], result["ours_stacked_s"] = _median(ours), _median(ours_stacked)
  if jax_stats is None:
    result["jax"] = "no jax-tpu-embedding environment (make jax-env)"
  else:
    result["jax_s"] = _median(jax_seconds)
    result["same_maxima"] = all(
      stats[name] == {k: v for k, v in counts.items() if k != "dropped"}
      for name, counts in jax_stats["tables"].items()
    )
  return result


def movielens_data(data_dir: Optional[str]) -> tuple[movielens.MovieLens, movielens.MovieLens]:
  data = movielens.load_movielens(data_dir=data_dir, seed=SEED)
  return movielens.train_test_split(data, seed=SEED)


def movielens_config(data: movielens.MovieLens) -> dict[str, Any]:
  user = emb.TableConfig(data.num_users + 1, 16, name="user_id", combiner="sum")
  movie = emb.TableConfig(data.num_movies + 1, 16, name="movie_id", combiner="sum")
  return {"user_id": emb.FeatureConfig(user), "movie_id": emb.FeatureConfig(movie)}


def movielens_batches(data: movielens.MovieLens, seed: int = SEED) -> list[dict]:
  """Shuffled full global batches ({feature: ids}, labels), as a TPU run takes them."""
  order = np.random.default_rng(seed).permutation(len(data))
  usable = len(order) // MOVIELENS_BATCH * MOVIELENS_BATCH
  labels = movielens.rating_labels(data)
  ids = {"user_id": data.user_ids.astype(np.int64), "movie_id": data.movie_ids.astype(np.int64)}
  return [
    ({name: values[rows] for name, values in ids.items()}, labels[rows])
    for rows in np.split(order[:usable], usable // MOVIELENS_BATCH)
  ]


def _model(config: dict[str, Any], collect: Optional[int] = None) -> tuple[Any, Any]:
  layer = TPUEmbedding(config, optimizer=emb.Adagrad(0.1))
  if collect:
    layer.collect_sparse_core_stats(num_chips=collect)
  inputs = {
    name: tf_keras.Input(shape=(None,), ragged=True, dtype=tf.int64, name=name) for name in config
  }
  activations = layer(inputs)
  joined = tf_keras.layers.Concatenate()(list(activations.values()))
  hidden = tf_keras.layers.Dense(32, activation="relu")(joined)
  model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(hidden))
  model.compile(loss="mse", optimizer=tf_keras.optimizers.Adam(0.01))
  return model, layer


def _ragged(features: dict) -> dict:
  return {
    name: v if isinstance(v, tf.RaggedTensor) else tf.RaggedTensor.from_tensor(v[:, None])
    for name, v in features.items()
  }


def train_rmse(config, train_batches, test: movielens.MovieLens, epochs: int) -> float:
  """Test RMSE (label scale [0, 1]) of a CPU model trained on (features, labels) batches."""
  tf_keras.utils.set_random_seed(SEED)
  model, _ = _model(config)
  for _ in range(epochs):
    for features, labels in train_batches:
      model.train_on_batch(_ragged(features), labels)
  test_features = {
    "user_id": test.user_ids.astype(np.int64),
    "movie_id": test.movie_ids.astype(np.int64),
  }
  predicted = model.predict(_ragged(test_features), batch_size=4096, verbose=0)[:, 0]
  return float(np.sqrt(np.mean((movielens.rating_labels(test) - predicted) ** 2)))


def _preview_row(preview: preflight.LimitsPreview) -> dict[str, Any]:
  return {
    "failed_batches": len(preview.failed_batches),
    "batches": preview.batches,
    "dropped": sum(preview.dropped.values()),
    "ids": preview.ids,
    "worst": preview.failures[0].__dict__ if preview.failures else None,
  }


def run_limits(quick: bool, data_dir: Optional[str]) -> dict[str, Any]:
  train, test = movielens_data(data_dir)
  ml_config = movielens_config(train)
  ml_batches = movielens_batches(train)
  epochs = 1 if quick else 3
  result: dict[str, Any] = {"source": train.source, "movielens": {}, "criteo": {}}
  result["baseline_rmse"] = train_rmse(ml_config, ml_batches, test, epochs)
  criteo_batches = 2 if quick else 8
  for name, (chips, cores) in TOPOLOGIES.items():
    for dataset, config, batches in (
      ("movielens", ml_config, [f for f, _ in ml_batches]),
      ("criteo", criteo_config(), list(criteo_stream(criteo_batches))),
    ):
      kwargs = dict(num_chips=chips, sparse_cores_per_chip=cores)
      stats = preflight.sparse_core_stats(config, batches, **kwargs)
      limits = preflight.sparse_core_config(stats, allow_id_dropping=True)
      row = {"stats": stats, "limits": _config_dict(limits)}
      for setting, sc_config in (
        ("tf_defaults", emb.SparseCoreEmbeddingConfig(allow_id_dropping=True)),
        ("computed", limits),
        ("tight", dataclasses.replace(limits, max_ids_per_chip_per_sample=1)),
      ):
        preview = preflight.preview_limits(config, batches, sc_config, **kwargs)
        row[setting] = _preview_row(preview)
        if dataset == "movielens":
          row[setting]["rmse"] = _emulated_rmse(
            ml_config, ml_batches, sc_config, preview, test, epochs, kwargs
          )
      result[dataset][name] = row
  return result


def _emulated_rmse(config, batches, sc_config, preview, test, epochs, kwargs) -> Optional[float]:
  """The RMSE with TF's dropping emulated; None where a batch fails the step regardless."""
  if preview.failures:
    return None
  if not sum(preview.dropped.values()):
    return "= baseline"
  dropped = preflight.emulate_id_dropping(config, [f for f, _ in batches], sc_config, **kwargs)
  return train_rmse(config, [(f, y) for f, (_, y) in zip(dropped, batches)], test, epochs)


def _config_dict(config: Any) -> dict[str, Any]:
  return {
    "max_ids_per_chip_per_sample": config.max_ids_per_chip_per_sample,
    "max_ids_per_table": config.max_ids_per_table,
    "max_unique_ids_per_table": config.max_unique_ids_per_table,
  }


def run_cost(quick: bool, data_dir: Optional[str], rounds: int = 2) -> dict[str, Any]:
  """Seconds per epoch of a MovieLens fit, statistics collection off and on (A B A B)."""
  train, _ = movielens_data(data_dir)
  config = movielens_config(train)
  features = _ragged(
    {"user_id": train.user_ids.astype(np.int64), "movie_id": train.movie_ids.astype(np.int64)}
  )
  labels = movielens.rating_labels(train)
  if quick:
    features = {k: v[: 20 * MOVIELENS_BATCH] for k, v in features.items()}
    labels = labels[: 20 * MOVIELENS_BATCH]
  times: dict[str, list[float]] = {"off": [], "on": []}
  for _ in range(rounds):
    for setting in ("off", "on"):
      model, _ = _model(config, collect=4 if setting == "on" else None)
      model.fit(features, labels, batch_size=MOVIELENS_BATCH, epochs=1, verbose=0)  # traces
      start = time.perf_counter()
      model.fit(features, labels, batch_size=MOVIELENS_BATCH, epochs=1, verbose=0)
      times[setting].append(time.perf_counter() - start)
  steps = -(-len(labels) // MOVIELENS_BATCH)
  return {
    "steps": steps,
    "off_ms_per_step": 1000 * _median(times["off"]) / steps,
    "on_ms_per_step": 1000 * _median(times["on"]) / steps,
  }


def report(result: dict[str, Any]) -> str:
  s = result["speed"]
  lines = [
    "# SparseCore pre-flight",
    "",
    "Measured on a shared 2-core machine under load: times are indicative.",
    "",
    f"## Statistics over {s['ids']:,} ids ({s['batches']} Criteo-shaped global batches of "
    f"{CRITEO_BATCH} x 26 one-hot features, {s['chips']} chips x 4 SparseCores)",
    "",
    "| implementation | seconds (median) | ids/s |",
    "|---|---|---|",
    f"| tpu_embedding.preflight, unstacked | {s['ours_s']:.2f} | {s['ids'] / s['ours_s']:,.0f} |",
    f"| tpu_embedding.preflight, stacked as TF stacks | {s['ours_stacked_s']:.2f} | "
    f"{s['ids'] / s['ours_stacked_s']:,.0f} |",
  ]
  if "jax_s" in s:
    lines.append(
      f"| jax-tpu-embedding host preprocessing, unstacked | {s['jax_s']:.2f} | "
      f"{s['ids'] / s['jax_s']:,.0f} |"
    )
    lines += ["", f"Same per-table maxima as jax-tpu-embedding: {s['same_maxima']}."]
  else:
    lines += ["", f"jax-tpu-embedding: {s['jax']}."]
  limits = result["limits"]
  lines += [
    "",
    f"## Limits (MovieLens 100K: {limits['source']} source, global batch {MOVIELENS_BATCH}; "
    f"Criteo-shaped: global batch {CRITEO_BATCH})",
    "",
    "| data | topology | stats: max ids / unique per partition (per stack), per-chip figure "
    "| limits (headroom 0.25): ids / unique per partition; per chip "
    "| TF defaults: failed batches, dropped ids | computed limits "
    "| computed, max_ids_per_chip_per_sample=1 |",
    "|---|---|---|---|---|---|---|",
  ]
  for dataset in ("movielens", "criteo"):
    for name, row in limits[dataset].items():
      stats = row["stats"]
      tables = "; ".join(
        f"{_short(k)}: {v['max_ids_per_partition']} / {v['max_unique_ids_per_partition']}"
        for k, v in stats.items()
        if k != "max_ids_per_chip_per_sample"
      )
      cells = [
        f"{row[s]['failed_batches']}/{row[s]['batches']} failed, {row[s]['dropped']:,} of "
        f"{row[s]['ids']:,} dropped"
        + (f", RMSE {_fmt(row[s]['rmse'])}" if "rmse" in row[s] else "")
        for s in ("tf_defaults", "computed", "tight")
      ]
      lim = row["limits"]
      limits_cell = ", ".join(
        f"{_short(k)}: {lim['max_ids_per_table'][k]} / {lim['max_unique_ids_per_table'][k]}"
        for k in lim["max_ids_per_table"]
      )
      lines.append(
        f"| {dataset} | {name} | {tables}; {stats['max_ids_per_chip_per_sample']} | "
        f"{limits_cell}; {lim['max_ids_per_chip_per_sample']} | " + " | ".join(cells) + " |"
      )
  lines += ["", f"MovieLens test RMSE without dropping: {limits['baseline_rmse']:.4f}."]
  c = result["cost"]
  lines += [
    "",
    f"## Cost of `layer.collect_sparse_core_stats` (MovieLens fit, {c['steps']} steps of "
    f"{MOVIELENS_BATCH})",
    "",
    f"off: {c['off_ms_per_step']:.2f} ms/step; on: {c['on_ms_per_step']:.2f} ms/step.",
  ]
  return "\n".join(lines) + "\n"


def _short(stack: str) -> str:
  """A stacked table's name, shortened where it joins many tables."""
  tables = stack.count("_table") + 1 if stack.startswith("table_") else 0
  return f"{stack[:8]}..{stack[-8:]} ({tables} tables)" if len(stack) > 40 else stack


def _fmt(rmse: Any) -> str:
  if rmse is None:
    return "n/a (the step fails)"
  return rmse if isinstance(rmse, str) else f"{rmse:.4f}"


def main(quick: bool, out_dir: str, data_dir: Optional[str] = None) -> None:
  os.makedirs(out_dir, exist_ok=True)
  result = {
    "quick": quick,
    "speed": run_speed(quick),
    "limits": run_limits(quick, data_dir),
    "cost": run_cost(quick, data_dir),
  }
  with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, default=str)
  text = report(result)
  with open(os.path.join(out_dir, "RESULTS.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  print(f"Wrote {out_dir}", file=sys.stderr)
