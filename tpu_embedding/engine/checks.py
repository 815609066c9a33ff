"""The hostile-input checks of a step's inputs: each bad input refused by feature name.

`inputs` converts ids and weights into bags and calls these on the way; they are kept apart
from the conversion because they are a concern of their own (what a hostile input could do
to a kernel, and the graph-safe way to refuse it: `require`). Every check leaves the input
unchanged and only lets it through once it holds; nothing later reads an input that failed.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tpu_embedding.config import Feature

if TYPE_CHECKING:
  from tpu_embedding.engine.inputs import Bags

Tensor = tf.Tensor


def checked_output_shape(bags: Bags) -> Bags:
  """Refuses an input whose sample count differs from the configured output_shape's."""
  configured = static_output_shape(bags.feature)
  if configured is None:
    return bags
  expected = configured.num_elements()
  (ids,) = require(
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


def as_id_tensor(name: str, ids: Any) -> Tensor:
  try:
    ids = tf.convert_to_tensor(ids)
  except (TypeError, ValueError) as e:
    raise TypeError(f"Feature {name!r}: could not convert its input to a tensor of ids: {e}") from e
  check_id_dtype(name, ids.dtype)
  return ids


def check_id_dtype(name: str, dtype: tf.DType) -> None:
  if not dtype.is_integer:
    raise TypeError(
      f"Feature {name!r}: ids must be of an integer dtype, got {dtype.name}. "
      "Map strings or floats to integer ids first (e.g. tf.keras StringLookup)."
    )


def ids_as_int64(ids: Tensor, compiled: bool) -> Tensor:
  """`ids` (of any integer dtype) as int64, the engine's id type, each id's value kept where
  int64 holds it. uint64 ids of 2**63 and more cannot be: they keep their bits (negative as
  int64), which the range check refuses, printing them unsigned (`Bags.unsigned`); under XLA,
  which cannot refuse, they become int64's largest, so that they are clamped to the table's
  last row like any other id too large, not to its first like a negative one."""
  if compiled and ids.dtype == tf.uint64:
    ids = tf.minimum(ids, tf.constant(np.iinfo(np.int64).max, tf.uint64))
  return tf.cast(ids, tf.int64)


def check_weights_kind(name: str, weights: Any, kind: type) -> None:
  if weights is not None and not isinstance(weights, kind):
    raise ValueError(
      f"Feature {name!r}: its ids are a {kind.__name__}, so its weights must be a "
      f"{kind.__name__} with the same layout; got {type(weights).__name__}."
    )
  if weights is not None and not weights.dtype.is_floating:
    raise TypeError(f"Feature {name!r}: weights must be floating point, got {weights.dtype.name}.")


def check_id_ranges(
  bags: Sequence[Bags], gathered_on_cpu: AbstractSet[str] = frozenset()
) -> list[Bags]:
  """`bags`, their ids let through only once all of them are in range.

  Graph mode makes one check for the whole step (an unsigned max per feature, so a negative id
  counts as too large); only when it fails does it find which feature and ids are at fault.
  `gathered_on_cpu`: names of tables whose lookup gathers every id of this step with TF's CPU
  gather (`lookup.gathered_on_cpu`), which refuses an id outside the table itself; their bags
  are left to it unless they hold ids it never gathers (past max_sequence_length) or uint64 ids
  (the gather would print those past 2**63 negative).
  """
  if tf.executing_eagerly():
    for bag in bags:
      ids = _all_ids(bag)
      in_range = tf.logical_and(ids >= 0, ids < bag.feature.table.vocabulary_size)
      if not bool(tf.reduce_all(in_range)):
        offending = tf.boolean_mask(ids, tf.logical_not(in_range))[:5]
        if bag.unsigned:
          offending = tf.bitcast(offending, tf.uint64)
        offending = offending.numpy().tolist()
        raise ValueError(f"{_range_message(bag)} Offending ids: {offending}.")
    return list(bags)
  left_to_gather = [
    bag.feature.table.name in gathered_on_cpu and bag.truncated_ids is None and not bag.unsigned
    for bag in bags
  ]
  if all(left_to_gather):
    return list(bags)
  if any(left_to_gather):
    to_check = [bag for bag, left in zip(bags, left_to_gather) if not left]
    checked = iter(check_id_ranges(to_check))
    return [bag if left else next(checked) for bag, left in zip(bags, left_to_gather)]
  checked = _range_check()(
    [bag.ids for bag in bags],
    [bag.truncated_ids for bag in bags if bag.truncated_ids is not None],
    tuple(i for i, bag in enumerate(bags) if bag.truncated_ids is not None),
    tf.constant([bag.feature.table.vocabulary_size for bag in bags], tf.uint64),
    tf.constant([_range_message(bag) for bag in bags]),
    tf.constant([bag.unsigned for bag in bags]),
  )
  return [dataclasses.replace(bag, ids=ids) for bag, ids in zip(bags, checked)]


def gather_scope(feature: Feature) -> str:
  """The name scope of a feature's gather: what a graph error names when the gather fails."""
  name = f"feature_{feature.name}.table_{feature.table.name}"
  return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


# One check per strategy: every step that checks the same number of features under it calls the
# same function, so each trace of a step (Keras traces a training step twice, and
# PartialTPUEmbedding checks each side) adds one call instead of building the check again. Not one
# for the whole process: a function is sent to a cluster's tasks only when it is first made, so a
# function made under one ParameterServerStrategy is unknown to the tasks of a strategy made later
# on another cluster ("Failed to find function" on its workers).
_RANGE_CHECKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _range_check() -> Callable[..., list[Tensor]]:
  """The range check of the current strategy's steps (made at its first use)."""
  strategy = tf.distribute.get_strategy()
  if strategy not in _RANGE_CHECKS:
    _RANGE_CHECKS[strategy] = _new_range_check(strategy.num_replicas_in_sync > 1)
  return _RANGE_CHECKS[strategy]


def _new_range_check(replicated: bool) -> Callable[..., list[Tensor]]:
  """The check; with `replicated` (a step of several replicas) its failure branch is inlined:
  failing in a function call of its own, a replica's refusal reached the user as another
  replica's `CancelledError: RecvAsync is cancelled` (TF keeps the cancelled transfer's status
  and drops the call's), and the layer's message only in TF's log."""
  refuse = _refuse_out_of_range
  if not replicated:
    refuse = tf.function(
      _refuse_out_of_range,
      autograph=False,
      reduce_retracing=True,
      # Never inlined: TF lowers a `tf.cond` in a function to Switch/Merge, so an inlined
      # failure branch stays in the graph every request runs, where each of its ~65 ops is
      # visited as dead (most of the serving latency above a plain gather). Kept a function,
      # it is one dead call.
      experimental_attributes={"_noinline": True},
    )
  return tf.function(
    functools.partial(_ids_in_range, refuse), autograph=False, reduce_retracing=True
  )


def _ids_in_range(
  refuse: Callable[..., Tensor],
  ids: list[Tensor],
  truncated: list[Tensor],
  truncated_of: tuple[int, ...],
  sizes: Tensor,
  messages: Tensor,
  unsigned: Tensor,
) -> list[Tensor]:
  """`ids` once every feature's ids, with the ids cut off by max_sequence_length
  (`truncated[j]` belongs to feature `truncated_of[j]`), are known to be in range (else
  `refuse`, `_refuse_out_of_range` as a function, fails). `unsigned[i]`: feature i's ids came as
  uint64 (printed so)."""
  every = [tf.reshape(i, [-1]) for i in ids]
  for position, cut in zip(truncated_of, truncated):
    every[position] = tf.concat([every[position], cut], 0)
  largest = tf.stack([tf.reduce_max(tf.bitcast(i, tf.uint64)) for i in every])

  checked = tf.cond(
    tf.reduce_all(largest < sizes),
    lambda: tf.constant(True),
    lambda: refuse(every, sizes, messages, unsigned),
  )
  with tf.control_dependencies([checked]):
    return tf.identity_n(ids)


def _refuse_out_of_range(
  every: list[Tensor], sizes: Tensor, messages: Tensor, unsigned: Tensor
) -> Tensor:
  """Fails with the first feature at fault and its offending ids; run only on bad ids.

  One Assert over all features' ids at once, so that the check does not grow with the features.
  """
  flat = tf.concat(every, 0)
  owner = tf.repeat(tf.range(len(every)), tf.stack([tf.size(i) for i in every]))
  too_large = tf.bitcast(flat, tf.uint64) >= tf.gather(sizes, owner)
  at_fault = tf.gather(owner, tf.argmax(tf.cast(too_large, tf.int32)))
  offending = tf.boolean_mask(flat, tf.logical_and(too_large, tf.equal(owner, at_fault)))
  message = tf.gather(messages, at_fault)
  shown = tf.where(
    tf.gather(unsigned, at_fault),
    tf.strings.as_string(tf.bitcast(offending, tf.uint64)),
    tf.strings.as_string(offending),
  )
  with tf.control_dependencies(
    [tf.debugging.Assert(False, [message, "Offending ids:", shown], summarize=5)]
  ):
    return tf.constant(False)


def _all_ids(bag: Bags) -> Tensor:
  """Every id of the bag's input, those past max_sequence_length included."""
  ids = tf.reshape(bag.ids, [-1])
  return ids if bag.truncated_ids is None else tf.concat([ids, bag.truncated_ids], 0)


def without_entries_outside(
  feature: Feature, indices: Tensor, ids: Tensor, dense_shape: Tensor
) -> tuple[Tensor, Tensor]:
  """(indices, ids) where every entry whose index lies outside `dense_shape` is dropped, for a
  step XLA compiles, where `checked_sparse` cannot refuse it: its sample becomes the first one
  past the input (which the lookup's segment sums drop) and its id the first past the table
  (whose gradient every update drops). Shapes stay fixed, as XLA needs."""
  outside = tf.reduce_any(tf.logical_or(indices < 0, indices >= dense_shape[None, :]), axis=1)
  past_the_input = tf.one_hot(0, tf.size(dense_shape), dtype=tf.int64) * dense_shape[0]
  indices = tf.where(outside[:, None], past_the_input[None, :], indices)
  return indices, tf.where(outside, tf.constant(feature.table.vocabulary_size, tf.int64), ids)


def _range_message(bag: Bags) -> str:
  table = bag.feature.table
  return (
    f"Feature {bag.feature.name!r} (table {table.name!r}, vocabulary_size="
    f"{table.vocabulary_size}): every id must be in [0, {table.vocabulary_size})."
  )


def static_output_shape(feature: Feature) -> Optional[tf.TensorShape]:
  shape = feature.config.output_shape
  return shape if shape.rank is not None else None


# Samples and unique rows are int32 coordinates in the engine's sparse matrices and kernels.
MAX_SAMPLES = 2**31 - 1


def check_static_samples(
  feature: Feature, shape: tf.TensorShape, bag_rank: int, positions: int
) -> None:
  """Refuses, while tracing, a shape already known to hold too many samples for the engine."""
  known = [d for d in shape[:bag_rank] if d is not None] if shape.rank is not None else []
  if any(d < 0 for d in known) or float(np.prod(known, dtype=np.float64)) * positions > MAX_SAMPLES:
    raise ValueError(
      f"Feature {feature.name!r}: its SparseTensor's dense_shape {shape} must be "
      f"non-negative and hold at most {MAX_SAMPLES} samples (every dimension "
      "but the last)."
    )


def checked_sparse(
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
  return require(
    feature,
    [
      (
        well_formed,
        "its SparseTensor's indices must be [N, rank] with one row per value "
        "(N values) and rank = len(dense_shape).",
        [entries, tf.size(values)],
      ),
      (
        tf.logical_and(tf.reduce_all(dense_shape >= 0), samples <= MAX_SAMPLES),
        f"its SparseTensor's dense_shape must be non-negative and hold at most {MAX_SAMPLES} "
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


def sparse_weight_values(
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
      same_tensor(weights.dense_shape, dense_shape), same_tensor(weights.indices, indices)
    )
    checks.append(
      (
        same,
        "its weights must have the same indices and dense_shape as its ids "
        "(FeatureConfig.validate_weights_and_indices is True).",
        [weights.dense_shape, dense_shape],
      )
    )
  return require(feature, checks, [weights.values])[0]


def same_tensor(a: Tensor, b: Tensor) -> Tensor:
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


def require(
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

  # A check the trace already knows to hold (a sample count from a static shape) costs no ops:
  # each `tf.cond` below traces two branch functions, which per feature slowed the first step.
  checks = [check for check in checks if not _holds_statically(check[0])]
  if not checks:
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


def _holds_statically(ok: Tensor) -> bool:
  known = tf.get_static_value(ok)
  return known is not None and bool(np.all(known))


def ragged_weight_values(
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
        same_tensor(lengths, id_lengths),
        "its weights must have the same row lengths as its ids "
        "(FeatureConfig.validate_weights_and_indices is True).",
        [lengths, id_lengths],
      )
    )
  return require(feature, checks, [weights.values])[0]
