"""Forward lookup and gradient assembly with the TPU's semantics, on any device.

Every input kind (dense, SparseTensor, RaggedTensor, sequence or not) is first reduced to *bags*:
parallel arrays of (row id, output sample, gain), where the gain already holds the per-id weight
times the combiner's per-sample scale (spec section 3.2). From there, the forward pass and the
gradient to each touched row are the same two segment sums for every kind, and all features that
share a table are deduplicated together once per step (ids looked up once, updated once).

Rules chosen where TF's own CPU lookups disagree with each other (documented in the README):
* weights are used as given: zero or negative weights are never dropped, for sparse and ragged
  alike; a `mean`/`sqrtn` bag whose weight sum is 0 gives a zero activation and zero gradient
  (what SparseCore does);
* dense `[B, 1]` ids give `[B, D]` like the TPU, not `[B, 1, D]` like `embedding_lookup`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf
from tensorflow.python.eager import record  # whether a gradient tape may be recording

from tpu_embedding import config as config_lib
from tpu_embedding.config import Feature
from tpu_embedding.engine import native

Tensor = tf.Tensor


@dataclasses.dataclass
class Bags:
  """One feature's input as (id, sample, gain) triples.

  `samples` is None when each id is its own sample in order (one-hot or per-position lookups),
  which lets the common case skip both segment sums. `gains` is None when every gain is 1.
  """

  feature: Feature
  ids: Tensor                 # int64 [N]
  samples: Optional[Tensor]   # int64 [N], index into the flattened activation rows
  gains: Optional[Tensor]     # float32 [N]
  num_samples: Tensor         # int64 scalar
  output_shape: Tensor        # int64 [k], activation shape without the embedding dim
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
          "RaggedTensor to weight them, or pass None for this feature's weights.")
    bags = _dense_bags(feature, _as_id_tensor(name, ids))
  return bags


def _as_id_tensor(name: str, ids: Any) -> Tensor:
  try:
    ids = tf.convert_to_tensor(ids)
  except (TypeError, ValueError) as e:
    raise TypeError(f"Feature {name!r}: could not convert its input to a tensor of ids: {e}") from e
  _check_id_dtype(name, ids.dtype)
  return ids


def _check_id_dtype(name: str, dtype: tf.DType) -> None:
  if not dtype.is_integer:
    raise TypeError(f"Feature {name!r}: ids must be integers (int32 or int64), got {dtype.name}. "
                    "Map strings or floats to integer ids first (e.g. tf.keras StringLookup).")


def _check_weights_kind(name: str, weights: Any, kind: type) -> None:
  if weights is not None and not isinstance(weights, kind):
    raise ValueError(f"Feature {name!r}: its ids are a {kind.__name__}, so its weights must be a "
                     f"{kind.__name__} with the same layout; got {type(weights).__name__}.")
  if weights is not None and not weights.dtype.is_floating:
    raise TypeError(f"Feature {name!r}: weights must be floating point, got {weights.dtype.name}.")


def check_id_ranges(bags: Sequence[Bags]) -> None:
  """Lets every bag's ids through only once all of them are in range.

  Graph mode makes one check for the whole step (an unsigned max per feature, so a negative id
  counts as too large); only when it fails does it find which feature and ids are at fault.
  """
  if tf.executing_eagerly():
    for bag in bags:
      in_range = _in_range(bag)
      if not bool(tf.reduce_all(in_range)):
        offending = tf.boolean_mask(bag.ids, tf.logical_not(in_range))[:5].numpy().tolist()
        raise ValueError(f"{_range_message(bag)} Offending ids: {offending}.")
    return
  if not bags:
    return
  largest = tf.stack([tf.reduce_max(tf.bitcast(bag.ids, tf.uint64)) for bag in bags])
  sizes = tf.constant([bag.feature.table.vocabulary_size for bag in bags], tf.uint64)

  def fail():
    asserts = []
    for bag in bags:
      in_range = _in_range(bag)
      offending = tf.boolean_mask(bag.ids, tf.logical_not(in_range))
      asserts.append(tf.debugging.Assert(
          tf.reduce_all(in_range), [_range_message(bag), "Offending ids:", offending],
          summarize=5))
    with tf.control_dependencies(asserts):
      return tf.constant(False)

  checked = tf.cond(tf.reduce_all(largest < sizes), lambda: tf.constant(True), fail)
  with tf.control_dependencies([checked]):
    for bag in bags:
      bag.ids = tf.identity(bag.ids)


def _in_range(bag: Bags) -> Tensor:
  return tf.logical_and(bag.ids >= 0, bag.ids < bag.feature.table.vocabulary_size)


def _range_message(bag: Bags) -> str:
  table = bag.feature.table
  return (f"Feature {bag.feature.name!r} (table {table.name!r}, vocabulary_size="
          f"{table.vocabulary_size}): every id must be in [0, {table.vocabulary_size}).")


def _static_output_shape(feature: Feature) -> Optional[tf.TensorShape]:
  shape = feature.config.output_shape
  return shape if shape.rank is not None else None


def _sequence_length(feature: Feature) -> int:
  """L > 0 when the feature is a sequence feature whose shape comes from max_sequence_length."""
  if _static_output_shape(feature) is not None:
    return 0
  return feature.config.max_sequence_length


def _with_output_shape(feature: Feature, natural: Tensor,
                       natural_static: tf.TensorShape) -> tuple[Tensor, tf.TensorShape]:
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
  if seq_len and ids.shape.rank == 2 and ids.shape[-1] != 1:
    # A dense [B, n] sequence: truncate to L positions, missing positions stay zero.
    kept = ids[:, :seq_len]
    batch = shape[0]
    positions = tf.range(tf.shape(kept, out_type=tf.int64)[1])
    samples = tf.reshape(tf.range(batch)[:, None] * seq_len + positions[None, :], [-1])
    return Bags(feature, tf.reshape(kept, [-1]), samples, None, batch * seq_len,
                tf.stack([batch, tf.constant(seq_len, tf.int64)]),
                tf.TensorShape([ids.shape[0], seq_len]))
  static = ids.shape
  if ids.shape.rank >= 2 and ids.shape[-1] == 1:
    shape, static = shape[:-1], static[:-1]  # the TPU gives [B, D] for [B, 1] ids
  return Bags(feature, tf.reshape(ids, [-1]), None, None, tf.reduce_prod(shape),
              *_with_output_shape(feature, shape, static))


def _sparse_bags(feature: Feature, sp: tf.SparseTensor, weights: Optional[tf.SparseTensor]) -> Bags:
  _check_id_dtype(feature.name, sp.values.dtype)
  rank = sp.shape.rank
  ids = tf.cast(sp.values, tf.int64)
  indices = sp.indices
  dense_shape = sp.dense_shape
  if rank == 1:
    # [B] with at most one id per position (e.g. a Keras Input(shape=(), sparse=True)).
    samples, batch = indices[:, 0], dense_shape[0]
    values = None if weights is None else weights.values
    return Bags(feature, ids, samples, _gains(feature, values, samples, batch), batch,
                *_with_output_shape(feature, dense_shape, sp.shape))
  seq_len = _sequence_length(feature)
  if seq_len and rank == 2:
    _refuse_sequence_weights(feature, weights)
    keep = indices[:, 1] < seq_len
    kept = tf.boolean_mask(indices, keep)
    batch = dense_shape[0]
    samples = kept[:, 0] * seq_len + kept[:, 1]
    return Bags(feature, tf.boolean_mask(ids, keep), samples, None, batch * seq_len,
                tf.stack([batch, tf.constant(seq_len, tf.int64)]),
                tf.TensorShape([sp.shape[0], seq_len]))
  # The sample is every index column but the last; combine over the last one.
  bag_shape = dense_shape[:-1]
  strides = tf.math.cumprod(bag_shape, exclusive=True, reverse=True)
  samples = tf.reduce_sum(indices[:, :-1] * strides[None, :], axis=1)
  num = tf.reduce_prod(bag_shape)
  values = None if weights is None else weights.values
  static = sp.shape[:-1] if rank is not None else tf.TensorShape(None)
  return Bags(feature, ids, samples, _gains(feature, values, samples, num), num,
              *_with_output_shape(feature, bag_shape, static))


def _ragged_bags(feature: Feature, rt: tf.RaggedTensor, weights: Optional[tf.RaggedTensor]) -> Bags:
  _check_id_dtype(feature.name, rt.values.dtype)
  if rt.ragged_rank != 1 or rt.shape.rank != 2:
    raise ValueError(f"Feature {feature.name!r}: a RaggedTensor input must have rank 2 "
                     f"(batch, ids), got shape {rt.shape}.")
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
            f"neither the batch size {static_batch} nor a multiple of it.")
      seq_len = total // static_batch
  if seq_len:
    _refuse_sequence_weights(feature, weights)
    positions = tf.range(tf.size(ids, out_type=tf.int64)) - tf.gather(rt.row_starts(), rows)
    keep = positions < seq_len
    samples = tf.boolean_mask(rows * seq_len + positions, keep)
    natural = tf.stack([batch, tf.constant(seq_len, tf.int64)])
    return Bags(feature, tf.boolean_mask(ids, keep), samples, None, batch * seq_len,
                *_with_output_shape(feature, natural, tf.TensorShape([rt.shape[0], seq_len])))
  values = None if weights is None else weights.values
  return Bags(feature, ids, rows, _gains(feature, values, rows, batch), batch,
              *_with_output_shape(feature, batch[None], rt.shape[:1]))


def _refuse_sequence_weights(feature: Feature, weights: Any) -> None:
  if weights is not None:
    raise ValueError(f"Feature {feature.name!r} is a sequence feature (max_sequence_length="
                     f"{feature.config.max_sequence_length}); each position is its own sample, "
                     "so weights are not allowed. Pass None for its weights.")


def _gains(feature: Feature, weights: Optional[Tensor], samples: Tensor,
           num_samples: Tensor) -> Optional[Tensor]:
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


# ---------------------------------------------------------------------------------------------
# One table's step: dedupe once, look up, assemble row gradients


class TableBatch:
  """All bags of one table in one step; ids are deduplicated (once) only when training.

  Combining and gradient assembly are both products with one sparse matrix S
  [samples of all bags, unique rows] whose entries are the gains: activations = S @ rows and
  row gradients = S^T @ activation gradients. On CPU one sparse matmul is far cheaper than the
  gather, multiply and segment sum it replaces (measured ~14x for a 4096 x 16 batch).
  """

  def __init__(self, bags: Sequence[Bags]):
    self.bags = list(bags)
    self.looked_up_rows: Optional[Tensor] = None  # the table's unique rows, as training read them
    self._native = False  # whether the compiled kernels did the lookup (and so the dedupe)

  @functools.cached_property
  def _deduplicated(self) -> tuple[Tensor, Tensor]:
    return tuple(tf.unique(_concat([b.ids for b in self.bags]), out_idx=tf.int64))

  @property
  def unique_ids(self) -> Tensor:
    """int64 [U]: the rows this step touches."""
    return self._deduplicated[0]

  @property
  def index(self) -> Tensor:
    """int64 [N_total]: position of each occurrence in `unique_ids`."""
    return self._deduplicated[1]

  @functools.cached_property
  def _occurrences(self) -> tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """(sample rows, gains, number of samples) of all bags' occurrences, in bag order.

    Sample rows count across the bags' activations stacked in order; None where each
    occurrence is its own sample (rows) or every gain is 1 (gains).
    """
    if len(self.bags) == 1:
      bag = self.bags[0]
      return bag.samples, bag.gains, bag.num_samples
    offsets = tf.cumsum(tf.stack([b.num_samples for b in self.bags]), exclusive=True)
    rows = [_sample_rows(bag) + offset
            for bag, offset in zip(self.bags, tf.unstack(offsets, num=len(self.bags)))]
    gains = None
    if any(b.gains is not None for b in self.bags):
      gains = tf.concat([_gains_or_ones(b) for b in self.bags], 0)
    return tf.concat(rows, 0), gains, offsets[-1] + self.bags[-1].num_samples

  @functools.cached_property
  def _sample_matrix(self) -> "SampleMatrix":
    """S [samples of all bags, U]: one entry (sample, unique row) = gain per occurrence."""
    rows, gains, total = self._occurrences
    ids = self.index
    if rows is None:
      rows = tf.range(tf.size(ids, out_type=tf.int64))
    if gains is None:
      gains = tf.ones(tf.shape(ids), tf.float32)
    return SampleMatrix.build(rows, ids, gains, total,
                              tf.size(self.unique_ids, out_type=tf.int64))

  def activations(self, table: Any, deduplicate: bool) -> list[Tensor]:
    """Combined activations of each bag.

    Training reads each touched row once and reuses the deduplication for the update; inference
    (nothing to update) skips it and gathers every occurrence directly. Where the compiled
    kernels may run, one of them does the training lookup, but only under a recording gradient
    tape: a function traced without one (a serving signature) keeps TF's ops, so that it can be
    exported and loaded with TensorFlow alone.
    """
    if not deduplicate:
      return [_combine(bag, quantize(tf.gather(table, bag.ids), self._table))
              for bag in self.bags]
    if (self._table.quantization_config is None and record.could_possibly_record() and
        native.runs_on([table])):
      rows, gains, total = self._occurrences
      flat, unique_ids, index = native.dedup_lookup(
          table, _concat([b.ids for b in self.bags]), rows, gains, total)
      self._deduplicated, self._native = (unique_ids, index), True
    else:
      self.looked_up_rows = tf.gather(table, self.unique_ids)
      unique_rows = quantize(self.looked_up_rows, self._table)
      one_id_per_sample = all(b.samples is None and b.gains is None for b in self.bags)
      if one_id_per_sample and _needs_blocks(unique_rows):
        # One id per sample, weight 1, wide rows: a gather beats the blocked sparse matmul.
        flat = tf.gather(unique_rows, self.index)
      else:
        flat = self._sample_matrix.matmul(unique_rows)
    parts = self._split(flat, [b.num_samples for b in self.bags])
    return [shape_activations(bag, part) for bag, part in zip(self.bags, parts)]

  def _split(self, flat: Tensor, sizes: list[Tensor]) -> list[Tensor]:
    if len(self.bags) == 1:
      return [flat]
    return tf.split(flat, tf.stack(sizes), num=len(self.bags))

  @property
  def _table(self):
    return self.bags[0].feature.table

  def occurrence_gradients(self, upstream: Sequence[Optional[Tensor]], dim: int) -> Tensor:
    """Each occurrence's gradient contribution (gain x its sample's activation gradient)."""
    parts = []
    for bag, grad in zip(self.bags, upstream):
      if grad is None:  # an unused output still touches its rows, with a zero gradient
        parts.append(tf.zeros([tf.size(bag.ids), dim], tf.float32))
        continue
      grad = tf.reshape(tf.cast(grad, tf.float32), [-1, dim])
      if bag.samples is not None:
        grad = tf.gather(grad, bag.samples)
      if bag.gains is not None:
        grad = grad * bag.gains[:, None]
      parts.append(grad)
    return _concat(parts)

  def row_gradients(self, upstream: Sequence[Optional[Tensor]], dim: int) -> Tensor:
    """The summed gradient of each unique row [U, D] (spec 2.1), never a dense table gradient."""
    grads = _concat([tf.zeros([bag.num_samples, dim]) if g is None
                     else tf.reshape(tf.cast(g, tf.float32), [-1, dim])
                     for bag, g in zip(self.bags, upstream)])
    if self._native:
      rows, gains, _ = self._occurrences
      return native.row_gradients(self.index, rows, gains, grads,
                                  tf.size(self.unique_ids, out_type=tf.int64))
    return self._sample_matrix.matmul(grads, adjoint=True)

  @property
  def occurrence_ids(self) -> Tensor:
    return tf.gather(self.unique_ids, self.index)


def _concat(parts: Sequence[Tensor]) -> Tensor:
  return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def _sample_rows(bag: Bags) -> Tensor:
  """int64 [N]: the activation row each of the bag's ids goes to."""
  if bag.samples is None:
    return tf.range(tf.size(bag.ids, out_type=tf.int64))
  return bag.samples


def _gains_or_ones(bag: Bags) -> Tensor:
  return tf.ones(tf.shape(bag.ids), tf.float32) if bag.gains is None else bag.gains


_MATMUL_BLOCK = 16
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclasses.dataclass
class SampleMatrix:
  """A sparse [rows, columns] matrix in the layout of TF's sparse-dense matmul kernel."""

  indices: Tensor  # [nnz, 2] (row, column), int32 where they fit, else int64
  values: Tensor   # float32 [nnz]
  shape: Tensor    # int64 [2]

  @classmethod
  def build(cls, rows: Tensor, columns: Tensor, values: Tensor, num_rows: Tensor,
            num_columns: Tensor) -> "SampleMatrix":
    """From int64 coordinates, which must be below 2**31 (they count samples and rows)."""
    if _LITTLE_ENDIAN:
      # (row, column) int32 pairs are the two halves of row + column * 2**32: one add and one
      # shift instead of stacking two columns, which TF's CPU kernels do element by element.
      indices = tf.bitcast(rows + tf.bitwise.left_shift(columns, tf.constant(32, tf.int64)),
                           tf.int32)
    else:
      indices = tf.stack([rows, columns], axis=1)
    return cls(indices, values, tf.stack([tf.cast(num_rows, tf.int64),
                                          tf.cast(num_columns, tf.int64)]))

  def matmul(self, dense: Tensor, adjoint: bool = False) -> Tensor:
    """`self @ dense` (or its adjoint), in column blocks of 16.

    TF's CPU kernel vectorises only over fewer than 32 columns and takes a per-row path above;
    blocks keep it on the fast path (measured 2x faster at dim 32 and 64). Columns are
    independent, so the result is bit-identical.
    """
    product = functools.partial(tf.raw_ops.SparseTensorDenseMatMul, a_indices=self.indices,
                                a_values=self.values, a_shape=self.shape, adjoint_a=adjoint)
    if not _needs_blocks(dense):
      return product(b=dense)
    width = dense.shape[-1]
    blocks = tf.split(
        dense, [min(_MATMUL_BLOCK, width - c) for c in range(0, width, _MATMUL_BLOCK)], axis=1)
    return tf.concat([product(b=b) for b in blocks], axis=1)


def _needs_blocks(dense: Tensor) -> bool:
  return dense.shape[-1] is not None and dense.shape[-1] >= 2 * _MATMUL_BLOCK


def sum_by_index(values: Tensor, index: Tensor, count: Tensor) -> Tensor:
  """out[i] = sum of values[k] where index[k] == i, as a sparse matmul (see TableBatch)."""
  size = tf.size(index, out_type=tf.int64)
  matrix = SampleMatrix.build(tf.range(size), index,
                              tf.ones([size], values.dtype), size, count)
  return matrix.matmul(values, adjoint=True)


def _combine(bag: Bags, rows: Tensor) -> Tensor:
  """Reduces each occurrence's row [N, D] into the bag's activations, shaped for the model."""
  if bag.samples is None and bag.gains is None:
    return shape_activations(bag, rows)
  occurrences = tf.range(tf.size(bag.ids, out_type=tf.int64))
  matrix = SampleMatrix.build(_sample_rows(bag), occurrences, _gains_or_ones(bag),
                              bag.num_samples, tf.size(bag.ids, out_type=tf.int64))
  return shape_activations(bag, matrix.matmul(rows))


def shape_activations(bag: Bags, flat: Tensor) -> Tensor:
  dim = tf.shape(flat, out_type=tf.int64)[1:]
  out = tf.reshape(flat, tf.concat([bag.output_shape, dim], axis=0))
  return _set_static_shape(out, bag, flat.shape[-1])


def _set_static_shape(out: Tensor, bag: Bags, dim: Optional[int]) -> Tensor:
  """Restores the static shape the reshape lost, so Keras sees [B, D] where it can."""
  if bag.static_shape.rank is not None:
    out.set_shape(bag.static_shape.concatenate([dim]))
  return out


def quantize(rows: Tensor, table) -> Tensor:
  """Simulated quantization of gathered rows (forward only, spec 3.8); identity if unset."""
  config = table.quantization_config
  if config is None:
    return rows
  step = (config.upper - config.lower) / (config.num_buckets - 1)
  clipped = tf.clip_by_value(rows, config.lower, config.upper)
  quantized = tf.floor((clipped - config.lower) / step + 0.5) * step + config.lower
  return rows + tf.stop_gradient(quantized - rows)


@dataclasses.dataclass
class Step:
  """One call's inputs, converted and grouped per table: what forward and backward share."""

  bags: list[Bags]
  batches: dict  # TableConfig -> TableBatch, tables in order of first appearance

  @classmethod
  def prepare(cls, config: config_lib.EmbeddingConfig, features: Any, weights: Any = None,
              subset: bool = False) -> "Step":
    """Validates `features`/`weights` against `config` (a subset of its features if `subset`)."""
    pairs = config_lib.match_structure(config, features, "features", subset=subset)
    bags = [to_bags(feature, ids, w)
            for (feature, ids), w in zip(pairs, weight_leaves(features, weights, len(pairs)))]
    check_id_ranges(bags)
    grouped: dict = {}
    for bag in bags:
      grouped.setdefault(bag.feature.table, []).append(bag)
    return cls(bags, {table: TableBatch(b) for table, b in grouped.items()})

  def activations(self, read_table: Callable[[Any], Tensor],
                  deduplicate: bool = False) -> list[Tensor]:
    """Activations of every bag, in input order; `read_table(table)` gives the table to read."""
    by_bag = {}
    for table, batch in self.batches.items():
      for bag, activation in zip(batch.bags, batch.activations(read_table(table), deduplicate)):
        by_bag[id(bag)] = activation
    return [by_bag[id(bag)] for bag in self.bags]

  def upstream_by_table(self, upstream: Sequence[Optional[Tensor]]) -> list[tuple[Any, "TableBatch", list]]:
    """Regroups per-bag activation gradients (input order) per table."""
    by_bag = {id(bag): g for bag, g in zip(self.bags, upstream)}
    return [(table, batch, [by_bag[id(b)] for b in batch.bags])
            for table, batch in self.batches.items()]


def weight_leaves(features: Any, weights: Any, count: int) -> list[Any]:
  """One weight (or None) per feature leaf, after checking both nests have one structure."""
  if weights is None:
    return [None] * count
  try:
    tf.nest.assert_same_structure(features, weights, check_types=False)
  except (TypeError, ValueError):
    kinds = lambda nest: tf.nest.map_structure(lambda x: type(x).__name__, nest)
    raise ValueError(
        "The structure of weights does not match the structure of features: pass one weight "
        f"(or None) per feature.\n  features: {kinds(features)}\n  weights:  {kinds(weights)}"
    ) from None
  return tf.nest.flatten(weights)
