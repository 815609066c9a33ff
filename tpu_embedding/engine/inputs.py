"""A step's inputs, validated and converted into bags: what the lookup and its gradient read.

Every input kind (dense, SparseTensor, RaggedTensor, sequence or not) is reduced here to *bags*:
parallel arrays of (row id, output sample, gain), where the gain already holds the per-id weight
times the combiner's per-sample scale (SPEC §3.2). From there the forward pass and the gradient
to each touched row are the same for every kind (`lookup`). Every bad input is refused here,
naming its feature, before any op reads a table.

Rules chosen where TF's own CPU lookups disagree with each other (documented in the README):
* weights are used as given: zero or negative weights are never dropped, for sparse and ragged
  alike; a `mean`/`sqrtn` bag whose weight sum is 0 gives a zero activation and zero gradient
  (what SparseCore does);
* dense `[B, 1]` ids give `[B, D]` like the TPU, not `[B, 1, D]` like `embedding_lookup`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.util import nest as tf_nest  # path-aware flattening, as in config.py

from tpu_embedding import config as config_lib
from tpu_embedding.config import Feature

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


# ---------------------------------------------------------------------------------------------
# Input conversion


def to_bags(feature: Feature, ids: Any, weights: Any = None) -> Bags:
  """Validates one feature's ids' type (and weights) and turns them into bags.

  The ids' range is checked once for all features by `check_id_ranges`.
  """
  name = feature.name
  if isinstance(ids, tf.SparseTensor):
    _check_weights_kind(name, weights, tf.SparseTensor)
    bags = _sparse_bags(feature, ids, weights)
  elif isinstance(ids, tf.RaggedTensor):
    _check_weights_kind(name, weights, tf.RaggedTensor)
    bags = _ragged_bags(feature, ids, weights)
  else:
    if weights is not None:
      raise ValueError(
        f"Feature {name!r}: weights were given for a dense Tensor input. Each dense id is its "
        "own sample, so no combiner uses weights; pass the ids as a SparseTensor or "
        "RaggedTensor to weight them, or pass None for this feature's weights."
      )
    bags = _dense_bags(feature, _as_id_tensor(name, ids))
  return _with_checked_output_shape(bags)


def _with_checked_output_shape(bags: Bags) -> Bags:
  """Refuses an input whose sample count differs from the configured output_shape's."""
  configured = _static_output_shape(bags.feature)
  if configured is None:
    return bags
  expected = configured.num_elements()
  (ids,) = _require(
    bags.feature,
    [
      (
        tf.equal(bags.num_samples, expected),
        f"FeatureConfig.output_shape {configured.as_list()} holds {expected} samples, which the "
        "input must have too (its batch, or batch x sequence length).",
        [bags.num_samples],
      )
    ],
    [bags.ids],
  )
  return dataclasses.replace(bags, ids=ids)


def _as_id_tensor(name: str, ids: Any) -> Tensor:
  try:
    ids = tf.convert_to_tensor(ids)
  except (TypeError, ValueError) as e:
    raise TypeError(f"Feature {name!r}: could not convert its input to a tensor of ids: {e}") from e
  _check_id_dtype(name, ids.dtype)
  return ids


def _check_id_dtype(name: str, dtype: tf.DType) -> None:
  if not dtype.is_integer:
    raise TypeError(
      f"Feature {name!r}: ids must be of an integer dtype, got {dtype.name}. "
      "Map strings or floats to integer ids first (e.g. tf.keras StringLookup)."
    )


def _check_weights_kind(name: str, weights: Any, kind: type) -> None:
  if weights is not None and not isinstance(weights, kind):
    raise ValueError(
      f"Feature {name!r}: its ids are a {kind.__name__}, so its weights must be a "
      f"{kind.__name__} with the same layout; got {type(weights).__name__}."
    )
  if weights is not None and not weights.dtype.is_floating:
    raise TypeError(f"Feature {name!r}: weights must be floating point, got {weights.dtype.name}.")


def check_id_ranges(bags: Sequence[Bags]) -> list[Bags]:
  """`bags`, their ids let through only once all of them are in range.

  Graph mode makes one check for the whole step (an unsigned max per feature, so a negative id
  counts as too large); only when it fails does it find which feature and ids are at fault.
  """
  if tf.executing_eagerly():
    for bag in bags:
      in_range = _in_range(bag)
      if not bool(tf.reduce_all(in_range)):
        offending = tf.boolean_mask(bag.ids, tf.logical_not(in_range))[:5].numpy().tolist()
        raise ValueError(f"{_range_message(bag)} Offending ids: {offending}.")
    return list(bags)
  if not bags:
    return []
  checked = _ids_in_range(
    [bag.ids for bag in bags],
    tf.constant([bag.feature.table.vocabulary_size for bag in bags], tf.uint64),
    tf.constant([_range_message(bag) for bag in bags]),
  )
  return [dataclasses.replace(bag, ids=ids) for bag, ids in zip(bags, checked)]


# One function for every step that checks the same number of features: each trace of a step
# (Keras traces a training step twice, and PartialTPUEmbedding checks each side) adds one call
# instead of building the check again.
@tf.function(autograph=False, reduce_retracing=True)
def _ids_in_range(ids: list[Tensor], sizes: Tensor, messages: Tensor) -> list[Tensor]:
  largest = tf.stack([tf.reduce_max(tf.bitcast(i, tf.uint64)) for i in ids])

  def fail():
    # Run only on bad ids: one Assert over all features' ids at once (naming the first
    # feature at fault), so that the check does not grow with the features.
    flat = tf.concat([tf.reshape(i, [-1]) for i in ids], 0)
    owner = tf.repeat(tf.range(len(ids)), tf.stack([tf.size(i) for i in ids]))
    too_large = tf.bitcast(flat, tf.uint64) >= tf.gather(sizes, owner)
    at_fault = tf.gather(owner, tf.argmax(tf.cast(too_large, tf.int32)))
    offending = tf.boolean_mask(flat, tf.logical_and(too_large, tf.equal(owner, at_fault)))
    message = tf.gather(messages, at_fault)
    with tf.control_dependencies(
      [tf.debugging.Assert(False, [message, "Offending ids:", offending], summarize=5)]
    ):
      return tf.constant(False)

  checked = tf.cond(tf.reduce_all(largest < sizes), lambda: tf.constant(True), fail)
  with tf.control_dependencies([checked]):
    return tf.identity_n(ids)


def _in_range(bag: Bags) -> Tensor:
  return tf.logical_and(bag.ids >= 0, bag.ids < bag.feature.table.vocabulary_size)


def _range_message(bag: Bags) -> str:
  table = bag.feature.table
  return (
    f"Feature {bag.feature.name!r} (table {table.name!r}, vocabulary_size="
    f"{table.vocabulary_size}): every id must be in [0, {table.vocabulary_size})."
  )


def _static_output_shape(feature: Feature) -> Optional[tf.TensorShape]:
  shape = feature.config.output_shape
  return shape if shape.rank is not None else None


def _sequence_length(feature: Feature) -> int:
  """L > 0 when the feature is a sequence feature whose shape comes from max_sequence_length."""
  if _static_output_shape(feature) is not None:
    return 0
  return feature.config.max_sequence_length


def _with_output_shape(
  feature: Feature, natural: Tensor, natural_static: tf.TensorShape
) -> tuple[Tensor, tf.TensorShape]:
  """The activation shape: the configured output_shape if any, else the input's natural one."""
  configured = _static_output_shape(feature)
  if configured is None:
    return natural, natural_static
  if not configured.is_fully_defined():
    raise ValueError(f"Feature {feature.name!r}: output_shape {configured} must be fully defined.")
  return tf.constant(configured.as_list(), tf.int64), configured


def _dense_bags(feature: Feature, ids: Tensor) -> Bags:
  if ids.shape.rank is None:
    raise ValueError(f"Feature {feature.name!r}: dense ids need a known rank.")
  ids = tf.cast(ids, tf.int64)
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
    return _sequence_bags(
      feature, None, tf.reshape(kept, [-1]), samples, batch, ids.shape[0], seq_len
    )
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
    tf.reduce_prod(shape),
    *_with_output_shape(feature, shape, static),
  )


def _sparse_bags(feature: Feature, sp: tf.SparseTensor, weights: Optional[tf.SparseTensor]) -> Bags:
  _check_id_dtype(feature.name, sp.values.dtype)
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
  _check_static_samples(
    feature, sp.shape, bag_rank if rank is not None else 0, seq_len if sequence else 1
  )
  indices, ids, dense_shape = _checked_sparse(feature, sp, bag_rank, seq_len if sequence else 1)
  weight_values = _sparse_weight_values(feature, sp, weights, indices, dense_shape)
  ids = tf.cast(ids, tf.int64)
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


# Samples and unique rows are int32 coordinates in the engine's sparse matrices and kernels.
_MAX_SAMPLES = 2**31 - 1


def _check_static_samples(
  feature: Feature, shape: tf.TensorShape, bag_rank: int, positions: int
) -> None:
  """Refuses, while tracing, a shape already known to hold too many samples for the engine."""
  known = [d for d in shape[:bag_rank] if d is not None] if shape.rank is not None else []
  if (
    any(d < 0 for d in known) or float(np.prod(known, dtype=np.float64)) * positions > _MAX_SAMPLES
  ):
    raise ValueError(
      f"Feature {feature.name!r}: its SparseTensor's dense_shape {shape} must be "
      f"non-negative and hold at most {_MAX_SAMPLES} samples (every dimension "
      "but the last)."
    )


def _checked_sparse(
  feature: Feature, sp: tf.SparseTensor, bag_rank: Any, positions: int
) -> tuple[Tensor, Tensor, Tensor]:
  """(indices, values, dense_shape) of `sp`, let through only if they describe a valid input.

  A hostile dense_shape (e.g. [2**61, 3]) would otherwise reach kernels that abort the process.
  """
  indices, values, dense_shape = sp.indices, sp.values, sp.dense_shape
  entries = tf.shape(indices, out_type=tf.int64)
  rank = tf.size(dense_shape, out_type=tf.int64)
  samples = tf.reduce_prod(tf.cast(dense_shape[:bag_rank], tf.float64)) * positions
  well_formed = tf.logical_and(
    tf.equal(entries[0], tf.size(values, out_type=tf.int64)), tf.equal(entries[1], rank)
  )
  # Only compared once the layout is consistent, so that the comparison itself cannot fail.
  inside = tf.cond(
    well_formed,
    lambda: tf.reduce_all(tf.logical_and(indices >= 0, indices < dense_shape[None, :])),
    lambda: tf.constant(False),
  )
  return _require(
    feature,
    [
      (
        well_formed,
        "its SparseTensor's indices must be [N, rank] with one row per value "
        "(N values) and rank = len(dense_shape).",
        [entries, tf.size(values)],
      ),
      (
        tf.logical_and(tf.reduce_all(dense_shape >= 0), samples <= _MAX_SAMPLES),
        f"its SparseTensor's dense_shape must be non-negative and hold at most {_MAX_SAMPLES} "
        "samples (every dimension but the last).",
        [dense_shape],
      ),
      (
        inside,
        "every index of its SparseTensor must lie inside dense_shape.",
        [dense_shape, lambda: _first_outside(indices, dense_shape, well_formed)],
      ),
    ],
    [indices, values, dense_shape],
  )


def _first_outside(indices: Tensor, dense_shape: Tensor, well_formed: Tensor) -> Tensor:
  """The first index row outside dense_shape (for the error message), or an empty one."""

  def first():
    outside = tf.reduce_any(tf.logical_or(indices < 0, indices >= dense_shape[None, :]), axis=1)
    return tf.boolean_mask(indices, outside)[:1]

  return tf.cond(well_formed, first, lambda: tf.zeros([0, 0], tf.int64))


def _sparse_weight_values(
  feature: Feature,
  sp: tf.SparseTensor,
  weights: Optional[tf.SparseTensor],
  indices: Tensor,
  dense_shape: Tensor,
) -> Optional[Tensor]:
  """The weights' values, once they pair with the ids (one per id; same indices if validated)."""
  if weights is None:
    return None
  count = tf.size(weights.values, out_type=tf.int64)
  ids = tf.size(sp.values, out_type=tf.int64)
  checks = [(tf.equal(count, ids), "its weights must hold one value per id.", [count, ids])]
  if feature.config.validate_weights_and_indices:
    same = tf.logical_and(
      _same_tensor(weights.dense_shape, dense_shape), _same_tensor(weights.indices, indices)
    )
    checks.append(
      (
        same,
        "its weights must have the same indices and dense_shape as its ids "
        "(FeatureConfig.validate_weights_and_indices is True).",
        [weights.dense_shape, dense_shape],
      )
    )
  return _require(feature, checks, [weights.values])[0]


def _same_tensor(a: Tensor, b: Tensor) -> Tensor:
  """Whether two int64 tensors have the same shape and values (never an error)."""
  same_shape = (
    tf.reduce_all(tf.equal(tf.shape(a), tf.shape(b)))
    if a.shape.rank == b.shape.rank
    else tf.constant(False)
  )
  return tf.cond(
    same_shape,
    lambda: tf.reduce_all(tf.equal(a, tf.reshape(b, tf.shape(a)))),
    lambda: tf.constant(False),
  )


Data = Sequence[Any]  # tensors for the message, or callables building them only on failure


def _require(
  feature: Feature, checks: Sequence[tuple[Tensor, str, Data]], guarded: Sequence[Tensor]
) -> list[Tensor]:
  """`guarded`, let through only once every check (ok, message, data) holds.

  Eagerly the first failing check raises a ValueError naming the feature. In a graph the
  returned tensors depend on one test of all checks; only when it fails are the asserts that
  name the failing check (and the data they show) run, so no later op sees an input that failed.
  """
  prefix = f"Feature {feature.name!r}: "
  shown = lambda data: [d() if callable(d) else d for d in data]
  if tf.executing_eagerly():
    for ok, message, data in checks:
      if not bool(ok):
        got = ", ".join(str(d.numpy().tolist()) for d in shown(data))
        raise ValueError(f"{prefix}{message} Got: {got}.")
    return list(guarded)

  def fail():
    asserts = [
      tf.debugging.Assert(ok, [prefix + message, "Got:", *shown(data)], summarize=8)
      for ok, message, data in checks
    ]
    with tf.control_dependencies(asserts):
      return tf.constant(False)

  passed = tf.cond(
    tf.reduce_all(tf.stack([ok for ok, _, _ in checks])), lambda: tf.constant(True), fail
  )
  with tf.control_dependencies([passed]):
    return [tf.identity(t) for t in guarded]


def _ragged_bags(feature: Feature, rt: tf.RaggedTensor, weights: Optional[tf.RaggedTensor]) -> Bags:
  _check_id_dtype(feature.name, rt.values.dtype)
  if rt.ragged_rank != 1 or rt.shape.rank != 2:
    raise ValueError(
      f"Feature {feature.name!r}: a RaggedTensor input must have rank 2 "
      f"(batch, ids), got shape {rt.shape}."
    )
  weight_values = _ragged_weight_values(feature, rt, weights)
  ids = tf.cast(rt.values, tf.int64)
  rows = rt.value_rowids()
  batch = rt.nrows()
  seq_len = _sequence_length(feature)
  configured = _static_output_shape(feature)
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


def _ragged_weight_values(
  feature: Feature, rt: tf.RaggedTensor, weights: Optional[tf.RaggedTensor]
) -> Optional[Tensor]:
  """The weights' values, once they pair with the ids (one per id; same rows if validated)."""
  if weights is None:
    return None
  if weights.ragged_rank != rt.ragged_rank:
    raise ValueError(
      f"Feature {feature.name!r}: its weights must be a RaggedTensor of the same "
      f"ragged rank as its ids ({rt.ragged_rank}), got {weights.ragged_rank}."
    )
  count = tf.size(weights.values, out_type=tf.int64)
  ids = tf.size(rt.values, out_type=tf.int64)
  checks = [(tf.equal(count, ids), "its weights must hold one value per id.", [count, ids])]
  if feature.config.validate_weights_and_indices:
    lengths, id_lengths = weights.row_lengths(), rt.row_lengths()
    checks.append(
      (
        _same_tensor(lengths, id_lengths),
        "its weights must have the same row lengths as its ids "
        "(FeatureConfig.validate_weights_and_indices is True).",
        [lengths, id_lengths],
      )
    )
  return _require(feature, checks, [weights.values])[0]


def _positions_below(
  ids: Tensor, rows: Tensor, positions: Tensor, seq_len: int
) -> tuple[Tensor, Tensor]:
  """(ids, samples) of the ids at positions below L, each its own sample row * L + position."""
  keep = positions < seq_len
  return tf.boolean_mask(ids, keep), tf.boolean_mask(rows * seq_len + positions, keep)


def _sequence_bags(
  feature: Feature,
  weights: Any,
  ids: Tensor,
  samples: Tensor,
  batch: Tensor,
  static_batch: Optional[int],
  seq_len: int,
) -> Bags:
  """A sequence input's bags, for every input kind: the activations are [B, L, D], each of the
  B x L positions its own sample (missing positions stay zero), so weights are refused.

  `ids` and `samples` hold only the positions below L (longer sequences are truncated).
  """
  if weights is not None:
    raise ValueError(
      f"Feature {feature.name!r} is a sequence feature (max_sequence_length="
      f"{feature.config.max_sequence_length}); each position is its own sample, "
      "so weights are not allowed. Pass None for its weights."
    )
  natural = tf.stack([batch, tf.constant(seq_len, tf.int64)])
  static = tf.TensorShape([static_batch, seq_len])
  return Bags(
    feature, ids, samples, None, batch * seq_len, *_with_output_shape(feature, natural, static)
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
    check_ranges: bool = True,
  ) -> "Step":
    """Validates `features`/`weights` against `config` (a subset of its features if `subset`).

    `check_ranges=False` leaves out the id-range check, for steps XLA compiles: they cannot
    raise at run time (the static path clamps such ids instead).
    """
    pairs = config_lib.match_structure(config, features, "features", subset=subset)
    bags = [
      to_bags(feature, ids, w)
      for (feature, ids), w in zip(pairs, weight_leaves(features, weights, len(pairs)))
    ]
    return cls(check_id_ranges(bags) if check_ranges else bags)

  @functools.cached_property
  def tables(self) -> dict[Any, list[Bags]]:
    """TableConfig -> the bags that read it, tables in order of first appearance: each table is
    looked up (and deduplicated) once per step, for all its features together."""
    grouped: dict = {}
    for bag in self.bags:
      grouped.setdefault(bag.feature.table, []).append(bag)
    return grouped


def weight_leaves(features: Any, weights: Any, count: int) -> list[Any]:
  """One weight (or None) per feature leaf, after checking both nests have one structure."""
  if weights is None:
    return [None] * count
  # Same keys, not only the same number of leaves: a misspelt key would otherwise pair a
  # weight with whichever feature sorts at its position.
  paths = lambda nest: [path for path, _ in tf_nest.flatten_with_joined_string_paths(nest)]
  try:
    tf.nest.assert_same_structure(features, weights, check_types=False)
    same = paths(features) == paths(weights)
  except (TypeError, ValueError):
    same = False
  if not same:
    kinds = lambda nest: tf.nest.map_structure(lambda x: type(x).__name__, nest)
    raise ValueError(
      "The structure of weights does not match the structure of features: pass one weight "
      f"(or None) per feature, under the same keys.\n  features: {kinds(features)}\n  "
      f"weights:  {kinds(weights)}"
    )
  return tf.nest.flatten(weights)
