"""`python -m benchmarks managed --quality [--seeds N] [--out NAME] [--movielens-only]
[--splits time,random]`: which rows managed-id policies keep.

Each policy (`ManagedIds` settings) beside the hashing trick (`key % capacity`) and a full
vocabulary, on two kinds of stream, at tables of 1/8, 1/4 and 1/2 of the distinct ids:
- MovieLens 100K (the package's loader: a local ml-100k copy named by `MOVIELENS_DIR`, else its
  synthetic stand-in of the same shape), ids scrambled into sparse 64-bit keys, split at random
  or in time order (the last 20 % of ratings by timestamp as the test set; "user_time": each
  user's last 20 %, the rest trained in time order); two epochs of a dot product model (user
  and movie tables, dim 8); test RMSE on the [0, 1] rating scale.
- The drifting synthetic stream (`examples.data.drifting_ratings`): items appear day by day
  and fade; progressive log loss (each batch scored before it trains).
Per cell the median over seeds and the spread (max - min), and each policy's share of the
hashing-to-full-vocabulary gap it closes. The default `ManagedIds()` is the policy of best mean
rank over the cells (docs/managed-ids.md, "Policies"). Runs are short (two epochs, six days).
Writes RESULTS.md, results.json and policies.png under benchmarks/results/managed-quality/
(`--out NAME`: benchmarks/results/NAME/; `--movielens-only` leaves out the drifting stream;
`--splits time,random,user_time` picks the MovieLens splits, by default time and random).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Callable, NamedTuple, Optional

import numpy as np
import tensorflow as tf

import tpu_embedding
from examples.data import drifting_ratings, movielens

E = tf.tpu.experimental.embedding
HERE = os.path.dirname(os.path.abspath(__file__))
FRACTIONS = (1 / 8, 1 / 4, 1 / 2)
HASHING, FULL = "hashing trick", "full vocabulary"
POLICIES = {
  "lfu": dict(eviction="lfu", admission="always"),
  "lru": dict(eviction="lru"),
  "lfu min_count=2": dict(eviction="lfu", admission="always", min_count=2),
  "lfu compete": dict(eviction="lfu", admission="compete"),
  "distance_lfu compete": dict(eviction="distance_lfu", admission="compete"),
}
_MIX = np.uint64(0x9E3779B97F4A7C15)  # ids -> scattered 64-bit keys (odd: a bijection)
DIM, BATCH, LEARNING_RATE, EPOCHS = 8, 256, 0.3, 2
DRIFT = dict(days=6, batches_per_day=10, batch=512, new_items_per_day=300)


class Keys(NamedTuple):
  """One table's part of a batch: raw 64-bit keys, their dense ids, and the hashed ids."""

  keys: np.ndarray
  ids: np.ndarray
  hashed: np.ndarray


def _keys(ids: np.ndarray) -> np.ndarray:
  return (ids.astype(np.uint64) * _MIX).view(np.int64)


def _hashed(ids: np.ndarray, capacity: int) -> np.ndarray:
  return (_keys(ids).view(np.uint64) % np.uint64(capacity)).astype(np.int64)


def model_layer(rows: dict, managed: Optional[tpu_embedding.ManagedIds], seed: int):
  """A layer of tables {name: rows}, each managed by `managed` if given."""
  tables = {}
  for name, size in rows.items():
    init = tf.random_normal_initializer(0.0, 0.1, seed=seed)
    tables[name] = E.TableConfig(size, DIM, initializer=init, name=name)
  features = {name: E.FeatureConfig(table, name=name) for name, table in tables.items()}
  managed_ids = {} if managed is None else {name: managed for name in rows}
  return tpu_embedding.TPUEmbedding(
    features, optimizer=E.Adagrad(LEARNING_RATE), managed_ids=managed_ids
  )


class Feed:
  """What one variant's steps train on: its layer, and each batch's features from the batch's
  `Keys` per table. Here the managed variants pass raw keys (the layer's call remaps them), the
  hashing trick its hashed ids, the full vocabulary the dense ids. Subclasses give other rows
  (benchmarks/torchrec_managed.py): `remapped` says the features are rows already."""

  remapped = False

  def __init__(self, variant: str, capacities: dict, full_sizes: dict, seed: int):
    self.variant = variant
    rows = full_sizes if variant == FULL else capacities
    policy = POLICIES.get(variant)
    self.layer = model_layer(
      rows, None if policy is None else tpu_embedding.ManagedIds(**policy), seed
    )

  def train(self, batch: dict) -> dict:
    """The features of one training step (called once per step, in order)."""
    return self._ids(batch)

  def test(self, batch: dict) -> dict:
    """The features of the held-out examples (after training)."""
    return self._ids(batch)

  def _ids(self, batch: dict) -> dict:
    pick = {FULL: "ids", HASHING: "hashed"}.get(self.variant, "keys")
    return {name: tf.constant(getattr(keys, pick)) for name, keys in batch.items()}


SPLITS = ("time", "random", "user_time")


def user_time_rows(data) -> tuple[np.ndarray, np.ndarray]:
  """(train rows, test rows), both in time order (timestamp, then row): each user's last 20 % of
  ratings (at least one) are tested. Unlike "time" (the last 20 % of all ratings, mostly users
  never seen in training on the real ml-100k), every tested user has a past to learn from."""
  order = np.lexsort((np.arange(len(data)), data.timestamps))
  users = data.user_ids[order]
  counts = np.bincount(users)
  seen = np.zeros_like(counts)
  rank = np.empty(len(order), dtype=np.int64)  # how many of the user's ratings came before
  for i, user in enumerate(users):
    rank[i] = seen[user]
    seen[user] += 1
  tested = rank >= counts[users] - np.maximum(1, counts[users] // 5)
  return order[~tested], order[tested]


def movielens_split(data, split: str, seed: int) -> tuple:
  """(train, test, the rows of `train` each training step takes, in order, over the epochs).

  `split`: "time" and "user_time" train in time order (keys arrive and fade as they did),
  "random" in a seeded shuffle; with "-seen" ("time-seen"), the test set keeps only the ratings
  whose user and movie both rate in training: the later time split's test is mostly users new
  to the model, whom every table serves from a row no training chose for them.
  """
  if split.endswith("-seen"):
    train, test, steps = movielens_split(data, split[: -len("-seen")], seed)
    seen = np.isin(test.user_ids, train.user_ids) & np.isin(test.movie_ids, train.movie_ids)
    return train, test.take(np.flatnonzero(seen)), steps
  if split not in SPLITS:
    raise ValueError(
      f"Unknown split {split!r}; expected one of {SPLITS}, each with or without '-seen'."
    )
  if split == "time":
    order = np.argsort(data.timestamps, kind="stable")
    cut = int(0.8 * len(data))
    train, test = data.take(order[:cut]), data.take(order[cut:])
  elif split == "user_time":
    train_rows, test_rows = user_time_rows(data)
    train, test = data.take(train_rows), data.take(test_rows)
  else:
    train, test = movielens.train_test_split(data, 0.2, seed=seed)
  rng = np.random.default_rng(seed)
  order = np.arange(len(train)) if split != "random" else rng.permutation(len(train))
  steps = [order[start : start + BATCH] for start in range(0, len(train), BATCH)]
  return train, test, steps * EPOCHS


def movielens_capacities(data, fraction: float) -> dict:
  distinct = {"users": len(np.unique(data.user_ids)), "movies": len(np.unique(data.movie_ids))}
  return {name: max(2, int(n * fraction)) for name, n in distinct.items()}


def movielens_rmse(
  variant: str, fraction: float, split: str, seed: int, data, feed: Callable = Feed
) -> float:
  """Test RMSE after two epochs of a dot product model on one split of MovieLens 100K."""
  train, test, steps = movielens_split(data, split, seed)
  full_sizes = {"users": data.num_users + 1, "movies": data.num_movies + 1}
  capacities = movielens_capacities(data, fraction)
  source = feed(variant, capacities, full_sizes, seed)
  layer = source.layer
  bias = tf.Variable(0.5)

  def batch(part, at):
    return {
      name: Keys(_keys(ids[at]), ids[at], _hashed(ids[at], capacities[name]))
      for name, ids in (("users", part.user_ids), ("movies", part.movie_ids))
    }

  @tf.function(reduce_retracing=True)
  def predict(inputs, training):
    out = layer(inputs, training=training, remapped=source.remapped)
    return tf.sigmoid(tf.reduce_sum(out["users"] * out["movies"], axis=1) + bias)

  @tf.function(reduce_retracing=True)
  def step(inputs, labels):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((predict(inputs, True) - labels) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables + [bias])
    bias.assign_sub(0.001 * grads[-1])

  labels = movielens.rating_labels(train)
  for at in steps:
    step(source.train(batch(train, at)), tf.constant(labels[at]))
  predicted = predict(source.test(batch(test, np.arange(len(test)))), False).numpy()
  return float(np.sqrt(np.mean((predicted - movielens.rating_labels(test)) ** 2)))


def drift_capacity(fraction: float, settings: dict) -> int:
  return max(2, int(settings["days"] * settings["new_items_per_day"] * fraction))


def drift_log_loss(
  variant: str, fraction: float, seed: int, settings: dict, feed: Callable = Feed
) -> float:
  """Mean progressive log loss over the drifting stream (each batch scored before it trains)."""
  total = settings["days"] * settings["new_items_per_day"]
  capacity = drift_capacity(fraction, settings)
  source = feed(variant, {"items": capacity}, {"items": total}, seed)
  layer = source.layer

  @tf.function(reduce_retracing=True)
  def step(ids, labels):
    with tf.GradientTape() as tape:
      logits = layer(ids, remapped=source.remapped)["items"][:, 0]
      losses = tf.nn.sigmoid_cross_entropy_with_logits(labels, logits)
      loss = tf.reduce_sum(losses)
    tape.gradient(loss, layer.trainable_variables)
    return tf.reduce_mean(losses)

  losses = []
  for _, keys, items, labels in drifting_ratings.rating_stream(**settings, seed=seed):
    ids = source.train({"items": Keys(keys, items, keys % capacity)})
    losses.append(float(step(ids, labels)))
  return float(np.mean(losses))


def run(seeds: int, drift_cells: bool = True, splits: tuple = ("time", "random")) -> dict:
  data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"))
  drift = DRIFT
  variants = list(POLICIES) + [HASHING, FULL]
  cells = {}
  for fraction in FRACTIONS:
    for split in splits:
      cells[f"MovieLens ({data.source}) {split}, 1/{round(1 / fraction)}"] = {
        v: [movielens_rmse(v, fraction, split, s, data) for s in range(seeds)] for v in variants
      }
    if not drift_cells:
      continue
    cells[f"drifting stream, 1/{round(1 / fraction)}"] = {
      v: [drift_log_loss(v, fraction, s, drift) for s in range(seeds)] for v in variants
    }
  return dict(seeds=seeds, movielens_source=data.source, drift=drift, cells=cells)


def summary(result: dict) -> dict:
  """Per cell: medians, spreads, gap closed; per policy: its mean rank over the cells."""
  out, ranks = {}, {p: [] for p in POLICIES}
  for cell, runs in result["cells"].items():
    median = {v: statistics.median(r) for v, r in runs.items()}
    gap = median[HASHING] - median[FULL]
    out[cell] = {
      v: dict(median=m, spread=max(runs[v]) - min(runs[v]), closed=(median[HASHING] - m) / gap)
      for v, m in median.items()
    }
    for rank, policy in enumerate(sorted(POLICIES, key=lambda p: median[p]), 1):
      ranks[policy].append(rank)
  mean_rank = {p: float(np.mean(r)) for p, r in ranks.items()}
  return dict(cells=out, mean_rank=mean_rank, best=min(mean_rank, key=mean_rank.get))


def report(result: dict, table: dict) -> str:
  variants = list(POLICIES) + [HASHING, FULL]
  lines = [
    f"Managed-id policies, {result['seeds']} seeds: median (spread max - min) and share of the "
    "hashing-to-full-vocabulary gap closed. MovieLens: test RMSE after two epochs; drifting "
    "stream: progressive log loss. Lower is better.",
    "",
    "| cell | " + " | ".join(variants) + " |",
    "|" + "---|" * (len(variants) + 1),
  ]
  for cell, by_variant in table["cells"].items():
    row = [
      f"{s['median']:.4f} ({s['spread']:.4f}, {100 * s['closed']:.0f}%)"
      for s in (by_variant[v] for v in variants)
    ]
    lines.append(f"| {cell} | " + " | ".join(row) + " |")
  ranks = ", ".join(
    f"{p} {r:.2f}" for p, r in sorted(table["mean_rank"].items(), key=lambda x: x[1])
  )
  lines += ["", f"Mean rank over the cells (1 best): {ranks}. Best: **{table['best']}**."]
  return "\n".join(lines)


def plot(table: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  cells = list(table["cells"])
  fig, ax = plt.subplots(figsize=(9, 4))
  width = 0.8 / len(POLICIES)
  for i, policy in enumerate(POLICIES):
    closed = [100 * table["cells"][c][policy]["closed"] for c in cells]
    ax.bar(np.arange(len(cells)) + i * width, closed, width, label=policy)
  ax.set_xticks(np.arange(len(cells)) + 0.4 - width / 2, cells, rotation=30, ha="right", fontsize=7)
  ax.set_ylabel("% of hashing -> full vocabulary gap closed")
  ax.axhline(0, color="black", linewidth=0.5)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(
  seeds: int = 5,
  name: str = "managed-quality",
  drift_cells: bool = True,
  splits: tuple = ("time", "random"),
) -> None:
  """Runs the cells and writes benchmarks/results/`name`/ (without the drifting stream's cells
  if not `drift_cells`: they do not read MovieLens, so a run on another copy need not redo them;
  MovieLens on `splits`, of SPLITS)."""
  result = run(seeds, drift_cells, splits)
  table = summary(result)
  out_dir = os.path.join(HERE, "results", name)
  write(out_dir, report(result, table), dict(result, summary=table))
  plot(table, os.path.join(out_dir, "policies.png"))


def write(out_dir: str, text: str, result: dict) -> None:
  """Prints `text` and writes it (RESULTS.md) and `result` (results.json) under `out_dir`."""
  os.makedirs(out_dir, exist_ok=True)
  print(text)
  with open(os.path.join(out_dir, "RESULTS.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(result, f, indent=1)
