"""Which way of updating touched rows is fastest on this machine, per optimizer.

Compares, for one table of dim 32 and a step of 4096 unique Zipf-distributed
row ids, the candidates `tpu_embedding.engine.updates` can choose from:

  gcs        gather rows -> TF ops -> ResourceScatterUpdate (the generic path)
  gcs+xla    same, with the compute part compiled by XLA (fixed batch shape)
  fused      TF's ResourceSparseApply* training kernel, where its maths is the spec's
  scatter_sub  SGD only: ResourceScatterSub(lr * g)
  kernel     our compiled kernel (engine/cc/apply_rows.cc), where it serves the optimizer
  chosen     `apply_sparse_update` itself

and prints ms per update and GB/s of table+slot rows moved (each row read and
written once), next to the machine's random-row gather bandwidth. Also checks
the Adam target t(1e7 rows) / t(1e4 rows) <= 1.3.

Usage: python benchmarks/update_kernels.py [--quick] [--rows 10000 1000000 10000000]
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from tpu_embedding.engine import native, updates
from tpu_embedding.engine.state import TableState

E = tf.tpu.experimental.embedding
DIM = 32
UNIQUE_IDS = 4096
NUM_BATCHES = 8  # distinct id batches cycled through, so rows are not all cache-hot


def _optimizers() -> Dict[str, object]:
  return {
    "sgd": E.SGD(learning_rate=0.1),
    "adagrad": E.Adagrad(learning_rate=0.1),
    "adagrad_momentum": E.AdagradMomentum(learning_rate=0.1, momentum=0.9),
    "adam": E.Adam(learning_rate=0.1),
    "ftrl": E.FTRL(
      learning_rate=0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.1, beta=0.5
    ),
    "adam_nonlazy": E.Adam(learning_rate=0.1, lazy_adam=False),
  }


def zipf_batches(vocab: int, rng: np.random.Generator) -> List[tf.Tensor]:
  """Batches of unique ids: Zipf(1.2) ranks scattered over the table by a hash."""
  batches = []
  for _ in range(NUM_BATCHES):
    seen: np.ndarray = np.zeros([0], np.int64)
    while seen.size < min(UNIQUE_IDS, vocab // 2):
      ranks = rng.zipf(1.2, size=4 * UNIQUE_IDS).astype(np.int64)
      ids = (ranks * 2654435761) % vocab
      seen = np.unique(np.concatenate([seen, ids]))
    batches.append(tf.constant(rng.permutation(seen)[:UNIQUE_IDS].astype(np.int32)))
  return batches


def _time_ms(fn: Callable[[int], None], iters: int, repeats: int = 5) -> float:
  """Best over `repeats` of the mean ms per call (min is stable on a shared machine)."""
  fn(0)
  fn(1)
  results = []
  for _ in range(repeats):
    start = time.perf_counter()
    for i in range(iters):
      fn(i)
    results.append((time.perf_counter() - start) / iters * 1e3)
  return min(results)


def _variables(optimizer, vocab: int):
  table = tf.Variable(tf.random.uniform([vocab, DIM], -0.05, 0.05))
  slots = {}
  names = optimizer._slot_names()
  inits = optimizer._slot_initializers()
  for name, init in zip(names, inits):
    slots[name] = tf.Variable(init(shape=[vocab, DIM], dtype=tf.float32))
  return table, slots


def _candidates(optimizer, table, slots) -> Dict[str, Callable]:
  """Update functions (row_ids, grads, lr) for each applicable candidate."""
  rule = updates.rule_for(optimizer)
  state = TableState.of({"parameters": table, **slots}, rule.slot_names)
  slot_vars = state.slots
  compiled = tf.function(rule.compute, jit_compile=True)

  def gcs(ids, g, lr):
    rows = updates.update_rows(rule, *updates.gather_rows(table, slot_vars, ids), g, lr)
    updates.scatter_rows(table, slot_vars, ids, rows)

  def gcs_xla(ids, g, lr):
    rows = compiled(*updates.gather_rows(table, slot_vars, ids), g, lr)
    updates.scatter_rows(table, slot_vars, ids, rows)

  def chosen(ids, g, lr):
    updates.apply_sparse_update(rule, state, ids, g, lr)

  out = {}
  if not rule.updates_every_row:
    out["gcs"] = gcs
    out["gcs+xla"] = gcs_xla
  kind = type(optimizer).__name__
  if kind == "SGD":
    out["fused"] = lambda ids, g, lr: tf.raw_ops.ResourceSparseApplyProximalGradientDescent(
      var=table.handle, alpha=lr, l1=0.0, l2=0.0, grad=g, indices=ids
    )
    out["scatter_sub"] = lambda ids, g, lr: tf.raw_ops.ResourceScatterSub(
      resource=table.handle, indices=ids, updates=lr * g
    )
  elif kind == "Adagrad":
    # AdagradV2 with epsilon 0 is the TPU rule (new accumulator, no epsilon).
    out["fused"] = lambda ids, g, lr: tf.raw_ops.ResourceSparseApplyAdagradV2(
      var=table.handle, accum=slot_vars[0].handle, lr=lr, epsilon=0.0, grad=g, indices=ids
    )
  elif kind == "FTRL":

    def ftrl_fused(ids, g, lr):
      o = optimizer
      tf.raw_ops.ResourceSparseApplyFtrl(
        var=table.handle,
        accum=slot_vars[0].handle,
        linear=slot_vars[1].handle,
        grad=g,
        indices=ids,
        lr=lr,
        l1=o.l1_regularization_strength,
        l2=o.l2_regularization_strength + o.beta / (2 * lr),
        lr_power=o.learning_rate_power,
        multiply_linear_by_lr=o.multiply_linear_by_learning_rate,
      )

    out["fused"] = ftrl_fused
  form = rule.native_form()
  if form is not None and native.runs_on((table,) + slot_vars):
    out["kernel"] = lambda ids, g, lr: native.apply_rows(
      *form,
      table,
      slot_vars,
      ids,
      g,
      lr,
      clip_gradient=(None, None),
      weight_decay=0.0,
      weight_decay_by_learning_rate=False,
      clip_weight=(None, None),
    )
  out["chosen"] = chosen
  return out


def _unrolled(
  update: Callable, batches: Sequence[tf.Tensor], grads: Sequence[tf.Tensor], lr: tf.Tensor
) -> Callable[[], None]:
  """One tf.function applying one update per batch, so call overhead is amortised."""

  @tf.function
  def step():
    for ids, g in zip(batches, grads):
      update(ids, g, lr)

  return step


def gather_bandwidth(table: tf.Variable, vocab: int, rng: np.random.Generator) -> float:
  """GB/s of a random-row gather of 64k rows (large enough to hide call overhead)."""
  ids = tf.constant(rng.integers(0, vocab, size=65536).astype(np.int32))
  gather = tf.function(lambda: tf.reduce_sum(table.sparse_read(ids)[:, :1]))
  ms = _time_ms(lambda _: gather(), iters=20)
  return 65536 * DIM * 4 / ms / 1e6


def _measure(
  optimizer, vocab: int, batches, grads, lr, iters: int, gather_gbs: float, name: str
) -> None:
  """Prints one line per candidate; everything holding the tables dies with this frame."""
  table, slots = _variables(optimizer, vocab)
  moved = 2 * (1 + len(slots)) * UNIQUE_IDS * DIM * 4  # read + write per row
  for cand_name, cand in _candidates(optimizer, table, slots).items():
    step = _unrolled(cand, batches, grads, lr)
    n = 1 if updates.rule_for(optimizer).updates_every_row else iters
    ms = _time_ms(lambda _: step(), n) / NUM_BATCHES
    gbs = moved / ms / 1e6
    print(
      f"{name:17s} {cand_name:12s} {vocab:9.0e} {ms:10.3f} {gbs:7.2f} {gbs / gather_gbs:8.2f}",
      flush=True,
    )


def adam_scaling(small: int, large: int, rng: np.random.Generator, rounds: int = 8) -> float:
  """t(large)/t(small) for the chosen Adam path, timed alternately so load hits both alike."""
  lr = tf.constant(0.1)
  steps = {}
  keep = []
  for vocab in (small, large):
    optimizer = E.Adam(learning_rate=0.1)
    table, slots = _variables(optimizer, vocab)
    batches = zipf_batches(vocab, rng)
    grads = [tf.random.normal([b.shape[0], DIM]) for b in batches]
    update = _candidates(optimizer, table, slots)["chosen"]
    steps[vocab] = _unrolled(update, batches, grads, lr)
    keep.append((table, slots))
  best = {vocab: float("inf") for vocab in steps}
  for _ in range(rounds):
    for vocab, step in steps.items():
      best[vocab] = min(best[vocab], _time_ms(lambda _: step(), 10, repeats=1) / NUM_BATCHES)
  print(
    f"\nAdam (chosen path), interleaved: {best[small]:.3f} ms at {small:.0e} rows, "
    f"{best[large]:.3f} ms at {large:.0e} rows"
  )
  return best[large] / best[small]


def run(row_counts: Sequence[int], iters: int, nonlazy_max_rows: int) -> None:
  rng = np.random.default_rng(0)
  lr = tf.constant(0.1)
  print(
    f"dim {DIM}, {UNIQUE_IDS} unique Zipf ids per update, {NUM_BATCHES} updates per "
    f"tf.function call, {os.cpu_count()} CPU cores, TF {tf.__version__}"
  )
  header = (
    f"{'optimizer':17s} {'candidate':12s} {'rows':>9s} {'ms/update':>10s} {'GB/s':>7s} "
    f"{'/gather':>8s}"
  )
  for vocab in row_counts:
    batches = zipf_batches(vocab, rng)
    grads = [tf.random.normal([b.shape[0], DIM]) for b in batches]
    probe = tf.Variable(tf.random.uniform([vocab, DIM]))
    gather_gbs = gather_bandwidth(probe, vocab, rng)
    del probe
    print(f"\nrows {vocab:.0e}: random-row gather bandwidth {gather_gbs:.2f} GB/s")
    print(header)
    for name, optimizer in _optimizers().items():
      if updates.rule_for(optimizer).updates_every_row and vocab > nonlazy_max_rows:
        print(f"{name:17s} (skipped: dense pass over all rows, see --nonlazy-max-rows)")
        continue
      _measure(optimizer, vocab, batches, grads, lr, iters, gather_gbs, name)
      gc.collect()
  if len(row_counts) > 1:
    small, large = min(row_counts), max(row_counts)
    ratio = adam_scaling(small, large, rng)
    print(f"Adam t({large:.0e})/t({small:.0e}) = {ratio:.2f} (target <= 1.3)")


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[10**4, 10**6, 10**7])
  parser.add_argument("--iters", type=int, default=50)
  parser.add_argument("--quick", action="store_true", help="1e4 and 1e6 rows, fewer iterations")
  parser.add_argument(
    "--nonlazy-max-rows",
    type=int,
    default=10**6,
    help="largest table for non-lazy Adam (it touches every row)",
  )
  args = parser.parse_args(argv)
  rows, iters = args.rows, args.iters
  if args.quick:
    rows, iters = [10**4, 10**6], 10
  run(rows, iters, args.nonlazy_max_rows)


if __name__ == "__main__":
  main()
