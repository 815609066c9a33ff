"""A step's inputs, validated and converted into bags: what the lookup and its gradient read.

Every input kind (dense, SparseTensor, RaggedTensor, sequence or not) is reduced here to *bags*:
parallel arrays of (row id, output sample, gain), where the gain already holds the per-id weight
times the combiner's per-sample scale (SPEC §3.2). From there the forward pass and the gradient
to each touched row are the same for every kind (`lookup`). Every bad input is refused on the
way, naming its feature, before any op reads a table: the checks themselves are in `checks`.

Rules chosen where TF's own CPU lookups disagree with each other (documented in docs/inputs.md):
* weights are used as given: zero or negative weights are never dropped, for sparse and ragged
  alike; a `mean`/`sqrtn` bag whose weight sum is 0 gives a zero activation and zero gradient
  (what SparseCore does);
* dense `[B, 1]` ids give `[B, D]` like the TPU, not `[B, 1, D]` like `embedding_lookup`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import AbstractSet, Any, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding.config import Feature
from tpu_embedding.engine import checks

Tensor = tf.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class Bags:
  """One feature's input as (id, sample, gain) triples.

  `samples` is None when each id is its own sample in order (one-hot or per-position lookups),
  which lets the common case skip both segment sums. `gains` is None when every gain is 1.
  """

  feature: Feature
  ids: Tensor  # int64 [N]
  samples: Optional[Tensor]  # int64 [N], index into the flattened activation rows
  gains: Optional[Tensor]  # float32 [N]
  num_samples: Tensor  # int64 scalar
  output_shape: Tensor  # int64 [k], activation shape without the embedding dim
  static_shape: tf.TensorShape  # what is known of output_shape before running
  # int64 [M]: ids past max_sequence_length, which no lookup reads but whose range is checked
  # like the others' (a corrupt input is refused, not truncated away).
  truncated_ids: Optional[Tensor] = None
  # The input's ids were uint64: those of 2**63 and more keep their bits here (negative as
  # int64, so every range check refuses them), and the range check's message prints them
  # unsigned, as the user gave them.
  unsigned: bool = False


# ---------------------------------------------------------------------------------------------
# Input conversion


def to_bags(
  feature: Feature,
  ids: Any,
  weights: Any = None,
  compiled: bool = False,
  global_batch: bool = False,
) -> Bags:
  """Validates one feature's ids' type (and weights) and turns them into bags.

  The ids' range is checked once for all features by `checks.check_id_ranges`. `compiled`: XLA
  compiles the step, which cannot raise at run time (see `Step.prepare`). `global_batch`: the
  ids are every replica's (a managed table's remap ahead of the step), which the per-replica
  `output_shape` does not describe, so their sample count is not checked against it.
  """
  name = feature.name
  if isinstance(ids, tf.SparseTensor):
    checks.check_weights_kind(name, weights, tf.SparseTensor)
    bags = _sparse_bags(feature, ids, weights, compiled)
  elif isinstance(ids, tf.RaggedTensor):
    checks.check_weights_kind(name, weights, tf.RaggedTensor)
    bags = _ragged_bags(feature, ids, weights, compiled)
  else:
    if weights is not None:
      raise ValueError(
        f"Feature {name!r}: weights were given for a dense Tensor input. Each dense id is its "
        "own sample, so no combiner uses weights; pass the ids as a SparseTensor or "
        "RaggedTensor to weight them, or pass None for this feature's weights."
      )
    ids = checks.as_id_tensor(name, ids)
    bags = _dense_bags(feature, ids, compiled)
  if ids.dtype == tf.uint64:
    bags = dataclasses.replace(bags, unsigned=True)
  return bags if global_batch else checks.checked_output_shape(bags)


def _sequence_length(feature: Feature) -> int:
  """L > 0 when the feature is a sequence feature whose shape comes from max_sequence_length."""
  if checks.static_output_shape(feature) is not None:
    return 0
  return feature.config.max_sequence_length


def _with_output_shape(
  feature: Feature, natural: Tensor, natural_static: tf.TensorShape
) -> tuple[Tensor, tf.TensorShape]:
  """The activation shape: the configured output_shape if any, else the input's natural one."""
  configured = checks.static_output_shape(feature)
  if configured is None:
    return natural, natural_static
  if not configured.is_fully_defined():
    raise ValueError(f"Feature {feature.name!r}: output_shape {configured} must be fully defined.")
  return tf.constant(configured.as_list(), tf.int64), configured


def _dense_bags(feature: Feature, ids: Tensor, compiled: bool) -> Bags:
  if ids.shape.rank is None:
    raise ValueError(f"Feature {feature.name!r}: dense ids need a known rank.")
  ids = checks.ids_as_int64(ids, compiled)
  shape = tf.shape(ids, out_type=tf.int64)
  seq_len = _sequence_length(feature)
  last = ids.shape[-1] if ids.shape.rank else 1
  if seq_len and ids.shape.rank == 2 and last is None:
    raise ValueError(
      f"Feature {feature.name!r} is a sequence feature (max_sequence_length={seq_len}), but "
      "this trace does not know the last dimension of its dense ids, which decides the output: "
      "[B, 1] ids give [B, D] and [B, n] ids give [B, L, D]. Give the input a known last "
      "dimension, e.g. tf.TensorSpec([None, 1]) or tf.TensorSpec([None, n])."
    )
  if seq_len and ids.shape.rank == 2 and last != 1:
    # A dense [B, n] sequence: a slice drops the positions from L on.
    kept = ids[:, :seq_len]
    batch = shape[0]
    positions = tf.range(tf.shape(kept, out_type=tf.int64)[1])
    samples = tf.reshape(tf.range(batch)[:, None] * seq_len + positions[None, :], [-1])
    kept_and_dropped = (tf.reshape(kept, [-1]), tf.reshape(ids[:, seq_len:], [-1]))
    return _sequence_bags(feature, None, kept_and_dropped, samples, batch, ids.shape[0], seq_len)
  static = ids.shape
  if ids.shape.rank >= 2 and last == 1:
    shape, static = shape[:-1], static[:-1]  # the TPU gives [B, D] for [B, 1] ids
  elif ids.shape.rank >= 2 and last is None:
    # Decided when the step runs, so a trace that does not know the last dimension gives the
    # same answer as one that does; the output's rank is then unknown to the trace.
    shape = tf.cond(tf.equal(shape[-1], 1), lambda: shape[:-1], lambda: shape)
    static = tf.TensorShape(None)
  return Bags(
    feature,
    ids if ids.shape.rank == 1 else tf.reshape(ids, [-1]),
    None,
    None,
    _count(shape, static),
    *_with_output_shape(feature, shape, static),
  )


def _count(shape: Tensor, static: tf.TensorShape) -> Tensor:
  """The number of elements of `shape`: a constant when the trace knows it, so that a check of
  it (a configured output_shape's) is decided while tracing instead of built into the graph."""
  known = static.num_elements()
  return tf.reduce_prod(shape) if known is None else tf.constant(known, tf.int64)


def _sparse_bags(
  feature: Feature, sp: tf.SparseTensor, weights: Optional[tf.SparseTensor], compiled: bool
) -> Bags:
  checks.check_id_dtype(feature.name, sp.values.dtype)
  rank = sp.shape.rank
  if rank == 0:
    raise ValueError(
      f"Feature {feature.name!r}: a SparseTensor input needs rank >= 1, got a scalar dense_shape."
    )
  seq_len = _sequence_length(feature)
  if seq_len and rank is None:
    raise ValueError(
      f"Feature {feature.name!r} is a sequence feature (max_sequence_length={seq_len}), but "
      "this trace does not know its SparseTensor's rank, which decides whether the output is "
      "[B, L, D] (rank 2) or combined (other ranks). Give the input a known rank, e.g. "
      "tf.SparseTensorSpec([None, None], tf.int64)."
    )
  # The sample is every index column but the last (the only one at rank 1); combine over the
  # last. Rank 1 is [B] with at most one id per position (e.g. Input(shape=(), sparse=True)).
  if rank is not None:
    bag_rank = max(rank - 1, 1)
  else:
    bag_rank = tf.maximum(tf.size(sp.dense_shape, out_type=tf.int64) - 1, 1)
  sequence = bool(seq_len) and rank == 2
  checks.check_static_samples(
    feature, sp.shape, bag_rank if rank is not None else 0, seq_len if sequence else 1
  )
  indices, ids, dense_shape = checks.checked_sparse(
    feature, sp, bag_rank, seq_len if sequence else 1
  )
  weight_values = checks.sparse_weight_values(feature, sp, weights, indices, dense_shape)
  ids = checks.ids_as_int64(ids, compiled)
  if compiled:
    indices, ids = checks.without_entries_outside(feature, indices, ids, dense_shape)
  if sequence:
    kept, samples = _positions_below(ids, indices[:, 0], indices[:, 1], seq_len)
    return _sequence_bags(feature, weights, kept, samples, dense_shape[0], sp.shape[0], seq_len)
  bag_shape = dense_shape[:bag_rank]
  strides = tf.math.cumprod(bag_shape, exclusive=True, reverse=True)
  samples = tf.reduce_sum(indices[:, :bag_rank] * strides[None, :], axis=1)
  num = tf.reduce_prod(bag_shape)
  static = sp.shape[:bag_rank] if rank is not None else tf.TensorShape(None)
  return Bags(
    feature,
    ids,
    samples,
    _gains(feature, weight_values, samples, num),
    num,
    *_with_output_shape(feature, bag_shape, static),
  )


def _ragged_bags(
  feature: Feature, rt: tf.RaggedTensor, weights: Optional[tf.RaggedTensor], compiled: bool
) -> Bags:
  checks.check_id_dtype(feature.name, rt.values.dtype)
  if rt.ragged_rank != 1 or rt.shape.rank != 2:
    raise ValueError(
      f"Feature {feature.name!r}: a RaggedTensor input must have rank 2 "
      f"(batch, ids), got shape {rt.shape}."
    )
  weight_values = checks.ragged_weight_values(feature, rt, weights)
  ids = checks.ids_as_int64(rt.values, compiled)
  rows = rt.value_rowids()
  batch = rt.nrows()
  seq_len = _sequence_length(feature)
  configured = checks.static_output_shape(feature)
  if configured is not None and configured.is_fully_defined() and rt.shape[0] is not None:
    # A configured shape larger than the batch makes this a sequence of prod/batch positions.
    total, static_batch = configured.num_elements(), rt.shape[0]
    if total != static_batch:
      if total < static_batch or total % static_batch:
        raise ValueError(
          f"Feature {feature.name!r}: output_shape {configured} holds {total} samples, which is "
          f"neither the batch size {static_batch} nor a multiple of it."
        )
      seq_len = total // static_batch
  elif configured is not None and configured.is_fully_defined() and weights is None:
    return _ragged_bags_of_unknown_batch(feature, ids, rt, configured)
  if seq_len:
    positions = tf.range(tf.size(ids, out_type=tf.int64)) - tf.gather(rt.row_starts(), rows)
    kept, samples = _positions_below(ids, rows, positions, seq_len)
    return _sequence_bags(feature, weights, kept, samples, batch, rt.shape[0], seq_len)
  return Bags(
    feature,
    ids,
    rows,
    _gains(feature, weight_values, rows, batch),
    batch,
    *_with_output_shape(feature, batch[None], rt.shape[:1]),
  )


def _ragged_bags_of_unknown_batch(
  feature: Feature, ids: Tensor, rt: tf.RaggedTensor, configured: tf.TensorShape
) -> Bags:
  """A ragged input's bags where the trace does not know its batch B: as `_ragged_bags` decides
  from a known one, but when the step runs. An output_shape holding B samples combines each
  row; one holding a multiple k x B makes each row a sequence of k positions, each its own
  sample (longer rows truncated, and the input is refused if k x B is not the output's size).
  """
  rows, batch = rt.value_rowids(), rt.nrows()
  total = configured.num_elements()
  combined = tf.equal(batch, total)
  seq_len = tf.where(combined, tf.constant(1, tf.int64), total // tf.maximum(batch, 1))
  positions = tf.range(tf.size(ids, out_type=tf.int64)) - tf.gather(rt.row_starts(), rows)
  keep = tf.logical_or(combined, positions < seq_len)
  samples = tf.boolean_mask(tf.where(combined, rows, rows * seq_len + positions), keep)
  num_samples = batch * seq_len
  return Bags(
    feature,
    tf.boolean_mask(ids, keep),
    samples,
    # A sequence position holds one id, so the combiner's scale is 1 there.
    _gains(feature, None, samples, num_samples),
    num_samples,
    *_with_output_shape(feature, num_samples[None], configured),
    truncated_ids=tf.boolean_mask(ids, tf.logical_not(keep)),
  )


def _positions_below(
  ids: Tensor, rows: Tensor, positions: Tensor, seq_len: int
) -> tuple[tuple[Tensor, Tensor], Tensor]:
  """((ids at positions below L, the others), samples of the first, each its own sample
  row * L + position)."""
  keep = positions < seq_len
  kept_and_dropped = (tf.boolean_mask(ids, keep), tf.boolean_mask(ids, tf.logical_not(keep)))
  return kept_and_dropped, tf.boolean_mask(rows * seq_len + positions, keep)


def _sequence_bags(
  feature: Feature,
  weights: Any,
  ids: tuple[Tensor, Tensor],
  samples: Tensor,
  batch: Tensor,
  static_batch: Optional[int],
  seq_len: int,
) -> Bags:
  """A sequence input's bags, for every input kind: the activations are [B, L, D], each of the
  B x L positions its own sample (missing positions stay zero), so weights are refused.

  `ids` holds (the ids at positions below L, the ids past it) and `samples` the first's samples:
  longer sequences are truncated, after their ids' range is checked.
  """
  if weights is not None:
    raise ValueError(
      f"Feature {feature.name!r} is a sequence feature (max_sequence_length="
      f"{feature.config.max_sequence_length}); each position is its own sample, "
      "so weights are not allowed. Pass None for its weights."
    )
  natural = tf.stack([batch, tf.constant(seq_len, tf.int64)])
  static = tf.TensorShape([static_batch, seq_len])
  kept, dropped = ids
  return Bags(
    feature,
    kept,
    samples,
    None,
    batch * seq_len,
    *_with_output_shape(feature, natural, static),
    truncated_ids=dropped,
  )


def _gains(
  feature: Feature, weights: Optional[Tensor], samples: Tensor, num_samples: Tensor
) -> Optional[Tensor]:
  """Per-id gain = weight x the combiner's per-sample scale (0 where the scale's base is 0)."""
  combiner = feature.table.combiner
  if weights is None:
    if combiner == "sum":
      return None
    weights = tf.ones_like(samples, dtype=tf.float32)
  weights = tf.cast(weights, tf.float32)
  if combiner == "sum":
    return weights
  if combiner == "mean":
    base = tf.math.unsorted_segment_sum(weights, samples, num_samples)
  else:  # sqrtn
    base = tf.sqrt(tf.math.unsorted_segment_sum(tf.square(weights), samples, num_samples))
  scale = tf.math.divide_no_nan(tf.ones_like(base), base)
  return weights * tf.gather(scale, samples)


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """One call's inputs, converted: every feature's bags, in input order."""

  bags: list[Bags]

  @classmethod
  def prepare(
    cls,
    config: config_lib.EmbeddingConfig,
    features: Any,
    weights: Any = None,
    subset: bool = False,
    compiled: bool = False,
    gathered_on_cpu: AbstractSet[str] = frozenset(),
    global_batch: bool = False,
  ) -> "Step":
    """Validates `features`/`weights` against `config` (a subset of its features if `subset`).

    `compiled`: XLA compiles the step, which cannot raise at run time: the id-range check is
    left out (the static path clamps such ids instead), and `SparseTensor` entries outside their
    `dense_shape` are dropped rather than refused. `gathered_on_cpu`: tables whose lookup's
    own gather refuses an id outside them (`checks.check_id_ranges`). `global_batch`: see
    `to_bags`.
    """
    pairs = config_lib.match_structure(config, features, "features", subset=subset)
    bags = [
      to_bags(feature, ids, w, compiled, global_batch)
      for (feature, ids), w in zip(pairs, config_lib.weight_leaves(features, weights, len(pairs)))
    ]
    return cls(bags if compiled else checks.check_id_ranges(bags, gathered_on_cpu))

  @functools.cached_property
  def tables(self) -> dict[Any, list[Bags]]:
    """TableConfig -> the bags that read it, tables in order of first appearance: each table is
    looked up (and deduplicated) once per step, for all its features together."""
    grouped: dict = {}
    for bag in self.bags:
      grouped.setdefault(bag.feature.table, []).append(bag)
    return grouped
