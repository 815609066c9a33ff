"""Where SparseCore sends each id: TF's stacking, each chip's slice of a batch, and the
partition (one SparseCore of one chip) that serves each id.

Learned from TF 2.21's `TPUEmbeddingV2` and its preprocessing kernels (no CPU kernel ships in
the pip wheel, so nothing here can call them):

* each feature's `output_shape` is per chip; a batch is the global batch, and chip c takes
  samples [c*S, (c+1)*S) of it (S the feature's samples per chip), each of its SparseCores an
  equal run of those;
* a dense id tensor is one sample per element (TF flattens it), a ragged or 2-D sparse one a
  sample per row;
* TF's stacker (called through `tf_internals`, never re-derived) gives each table a stacked
  table, a row offset and a shard rotation; id i of a table moves to column
  `((i + rotation) & (N-1)) + (i & ~(N-1)) + N * offset` of its stack, and that column's partition
  is `column mod N`, N = chips * SparseCores per chip (a power of two);
* a sample's repeated ids count once (TF sums their weights), whatever their order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import tensorflow as tf

from tpu_embedding import tf_internals

emb = tf.tpu.experimental.embedding


@dataclasses.dataclass(frozen=True)
class FeatureRoute:
  """One feature's place in TF's layout."""

  path: str  # the feature's path in the config, as TF joins it ("/")
  table: str
  stack: str  # the stacked table's name (the table's own when not stacked)
  vocabulary_size: int
  col_offset: int  # N * the table's row offset in each shard of its stack
  col_shift: int  # the table's shard rotation
  samples_per_chip: int


@dataclasses.dataclass(frozen=True)
class Routing:
  """TF's layout for a feature config on `num_chips` chips."""

  num_chips: int
  sparse_cores_per_chip: int
  features: tuple[FeatureRoute, ...]  # in TF's (tf.nest) order
  stacks: Mapping[str, tuple[str, ...]]  # stacked table -> its tables, sorted
  stack_samples_per_chip: Mapping[str, int]  # what TF sizes the per-chip buffer by

  @property
  def partitions(self) -> int:
    return self.num_chips * self.sparse_cores_per_chip


class StackEntries:
  """A stacked table's ids in one batch, a sample's repeated ids once (as TF counts them):
  each field an array with an element per id, joined from its features' on first use (counting
  needs only `block`, `partition` and `column`)."""

  FIELDS = ("block", "column", "feature", "sample", "id")

  def __init__(self, pieces: list[tuple[np.ndarray, ...]], partitions: int):
    self._pieces = pieces  # per feature, arrays in FIELDS' order
    self._partitions = partitions

  def _joined(self, field: str) -> np.ndarray:
    return np.concatenate([piece[self.FIELDS.index(field)] for piece in self._pieces])

  @functools.cached_property
  def block(self) -> np.ndarray:  # chip * SparseCores per chip + SparseCore
    return self._joined("block")

  @functools.cached_property
  def column(self) -> np.ndarray:  # in the stack's columns
    return self._joined("column")

  @functools.cached_property
  def partition(self) -> np.ndarray:
    return self.column & (self._partitions - 1)

  @functools.cached_property
  def feature(self) -> np.ndarray:  # index into `Routing.features`
    return self._joined("feature")

  @functools.cached_property
  def sample(self) -> np.ndarray:  # the sample in the global batch
    return self._joined("sample")

  @functools.cached_property
  def id(self) -> np.ndarray:  # the id in its own table
    return self._joined("id")


def validate_chips(num_chips: Any, sparse_cores_per_chip: Any) -> None:
  """TF's own conditions: whole numbers >= 1, and chips * SparseCores a power of two (its
  kernels mask partitions with N - 1)."""
  for name, value in (("num_chips", num_chips), ("sparse_cores_per_chip", sparse_cores_per_chip)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a whole number >= 1; got {value!r}.")
  n = num_chips * sparse_cores_per_chip
  if n & (n - 1):
    raise ValueError(
      f"num_chips * sparse_cores_per_chip = {num_chips} * {sparse_cores_per_chip} = {n} is not a "
      "power of two; TF's SparseCore preprocessing requires one (its num_sc_shards)."
    )


def peek(batches: Iterable[Any]) -> tuple[Any, Iterator[Any]]:
  """The first batch, and an iterator over all of them (works for one-pass generators)."""
  iterator = iter(batches)
  try:
    first = next(iterator)
  except StopIteration:
    raise ValueError("batches is empty: there is nothing to compute statistics from.") from None

  def everything():
    yield first
    yield from iterator

  return first, everything()


def flat_batch(feature_config: Any, batch: Any) -> list[Any]:
  """The batch's features in the config's order; a clear error where the two do not match."""
  if isinstance(feature_config, Mapping):
    if not isinstance(batch, Mapping):
      raise ValueError(f"A batch must be a dict of features like the config; got {type(batch)}.")
    missing, extra = (
      sorted(set(feature_config) - set(batch)),
      sorted(set(batch) - set(feature_config)),
    )
    if missing or extra:
      raise ValueError(
        f"The batch's features do not match the config: missing {missing}, not configured {extra}."
      )
  try:
    return tf_internals.flatten_up_to(feature_config, batch)
  except (TypeError, ValueError) as error:
    raise ValueError(f"The batch does not have the feature config's structure: {error}") from None


def routing(
  feature_config: Any,
  first_batch: Any,
  *,
  num_chips: int,
  sparse_cores_per_chip: int,
  stacking: bool,
  optimizer: Any = None,
) -> Routing:
  """TF's layout for `feature_config`, each feature's samples per chip taken from its
  `output_shape` or, where that is unset, from `first_batch` (its samples / num_chips)."""
  validate_chips(num_chips, sparse_cores_per_chip)
  flat = tf_internals.flatten_with_paths(feature_config)
  values = flat_batch(feature_config, first_batch)
  shaped = []
  for (path, feature), value in zip(flat, values):
    if not isinstance(feature, emb.FeatureConfig):
      raise ValueError(f"Feature {path!r} is a {type(feature)}, not a FeatureConfig.")
    per_chip = _samples_per_chip(feature, path, sample_count(value), num_chips)
    if per_chip % sparse_cores_per_chip:
      raise ValueError(
        f"Feature {path!r}: {per_chip} samples per chip do not split evenly over "
        f"{sparse_cores_per_chip} SparseCores per chip, which TF requires."
      )
    clone = emb.FeatureConfig(
      feature.table, max_sequence_length=feature.max_sequence_length, output_shape=[per_chip]
    )
    shaped.append(clone)
  sc_config = tf_internals.sparse_core_config(disable_table_stacking=not stacking)
  stacked, flat_features = tf_internals.sparse_core_stacking(
    tf.nest.pack_sequence_as(feature_config, shaped),
    optimizer,
    num_chips,
    sparse_cores_per_chip,
    sc_config,
  )
  features = []
  for (path, feature), original in zip(flat_features, flat):
    stack, col_offset, col_shift = stacked.table_to_stacked_table_offset[feature.table.name]
    features.append(
      FeatureRoute(
        path=path,
        table=feature.table.name,
        stack=stack,
        vocabulary_size=original[1].table.vocabulary_size,
        col_offset=int(col_offset),
        col_shift=int(col_shift),
        samples_per_chip=int(feature.output_shape[0]),
      )
    )
  stacks = {
    name: tuple(sorted(table.name for table in tables))
    for name, tables in stacked.stacked_table_to_tables.items()
  }
  return Routing(
    num_chips=num_chips,
    sparse_cores_per_chip=sparse_cores_per_chip,
    features=tuple(features),
    stacks=stacks,
    stack_samples_per_chip=dict(stacked.table_to_sample_count),
  )


def routed(
  feature_config: Any,
  batches: Iterable[Any],
  *,
  num_chips: int,
  sparse_cores_per_chip: int,
  stacking: bool,
  optimizer: Any,
) -> tuple[Routing, Iterator[Any]]:
  """`routing` from the first of `batches`, and an iterator over all of them."""
  first, everything = peek(batches)
  route = routing(
    feature_config,
    first,
    num_chips=num_chips,
    sparse_cores_per_chip=sparse_cores_per_chip,
    stacking=stacking,
    optimizer=optimizer,
  )
  return route, everything


def _samples_per_chip(feature: Any, path: str, samples: int, num_chips: int) -> int:
  if feature.output_shape.rank:
    return math.prod(int(d) for d in feature.output_shape)
  if samples % num_chips or samples == 0:
    raise ValueError(
      f"Feature {path!r}: the batch has {samples} samples, which do not split evenly over "
      f"{num_chips} chips (each chip takes an equal slice of the global batch)."
    )
  return samples // num_chips


@dataclasses.dataclass(frozen=True)
class HostRows:
  """A feature's ids already on the host (NumPy): each id with its sample, and how many samples
  (rows) the batch has, empty ones included."""

  ids: np.ndarray
  samples: np.ndarray  # non-decreasing
  rows: int
  one_per_sample: bool = False  # known to hold one id a sample (a dense tensor)


def host_rows(value: Any, path: str) -> HostRows:
  """Any accepted feature tensor read into `HostRows` (see the module docstring)."""
  if isinstance(value, HostRows):
    return value
  if isinstance(value, tf.RaggedTensor):
    if value.ragged_rank != 1:
      raise ValueError(f"Feature {path!r}: a RaggedTensor must have ragged_rank 1.")
    return ragged_rows(value.flat_values.numpy(), value.row_splits.numpy())
  if isinstance(value, tf.SparseTensor):
    indices = value.indices.numpy()
    if indices.shape[1] != 2:
      raise ValueError(
        f"Feature {path!r}: a SparseTensor must be 2-D ([samples, ids]); got rank "
        f"{indices.shape[1]}."
      )
    return HostRows(value.values.numpy(), indices[:, 0], int(value.dense_shape[0]))
  ids = np.asarray(value).reshape(-1)
  return HostRows(ids, np.arange(ids.size), ids.size, one_per_sample=True)


def ragged_rows(ids: np.ndarray, row_splits: np.ndarray) -> HostRows:
  rows = len(row_splits) - 1
  return HostRows(ids, np.repeat(np.arange(rows), np.diff(row_splits)), rows)


def sample_count(value: Any) -> int:
  """How many samples TF reads in one feature's tensor (see the module docstring)."""
  if isinstance(value, HostRows):
    return value.rows
  if isinstance(value, tf.RaggedTensor):
    return int(value.nrows())
  if isinstance(value, tf.SparseTensor):
    return int(value.dense_shape[0])
  return int(np.size(value))


def samples_and_ids(value: Any, route: FeatureRoute, num_chips: int) -> tuple[np.ndarray, ...]:
  """(sample in the global batch, id) of one feature's ids, checked, a sample's repeated ids
  once (in any order)."""
  path = route.path
  read = host_rows(value, path)
  ids, samples = read.ids, read.samples.astype(np.int64, copy=False)
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"Feature {path!r}: ids must be integers; got {ids.dtype}.")
  expected = route.samples_per_chip * num_chips
  if read.rows != expected:
    raise ValueError(
      f"Feature {path!r}: the batch has {read.rows} samples; the config and the first batch say "
      f"{expected} ({route.samples_per_chip} per chip on {num_chips} chips)."
    )
  if ids.size and (ids.min() < 0 or ids.max() >= route.vocabulary_size):
    bad = ids[(ids < 0) | (ids >= route.vocabulary_size)][0]
    raise ValueError(
      f"Feature {path!r}: id {bad} is outside table {route.table!r} "
      f"(vocabulary_size {route.vocabulary_size})."
    )
  ids = ids.astype(np.int64, copy=False)
  if read.one_per_sample:
    return samples, ids
  steps = np.diff(samples)
  if np.any(steps < 0):
    raise ValueError(
      f"Feature {path!r}: the SparseTensor's indices are not in row order (TF's kernel "
      "refuses them); apply tf.sparse.reorder first."
    )
  if np.all(steps > 0):  # one id a sample at most: nothing to deduplicate
    return samples, ids
  distinct = np.unique(samples * route.vocabulary_size + ids)
  return distinct // route.vocabulary_size, distinct % route.vocabulary_size


def stack_entries(routing: Routing, flat_values: list[Any]) -> dict[str, StackEntries]:
  """Each stacked table's ids in one batch, a sample's repeated ids once, in no set order."""
  n = routing.partitions
  cores = routing.sparse_cores_per_chip
  parts: dict[str, list[tuple[np.ndarray, ...]]] = {name: [] for name in routing.stacks}
  for index, (route, value) in enumerate(zip(routing.features, flat_values)):
    samples, ids = samples_and_ids(value, route, routing.num_chips)
    block = samples // (route.samples_per_chip // cores)  # = chip * cores + SparseCore
    column = ((ids + route.col_shift) & (n - 1)) + (ids & ~(n - 1)) + route.col_offset
    feature = np.full(ids.shape, index, np.int64)
    parts[route.stack].append((block, column, feature, samples, ids))
  return {name: StackEntries(pieces, n) for name, pieces in parts.items()}


def in_packing_order(entries: StackEntries, n: int) -> StackEntries:
  """`entries` in the order TF's kernels pack them: (chip and SparseCore, partition, column,
  feature, sample)."""
  order = _packing_order(entries.block, entries.column, entries.feature, entries.sample, n)
  return StackEntries([tuple(getattr(entries, f)[order] for f in StackEntries.FIELDS)], n)


def _packing_order(
  block: np.ndarray, column: np.ndarray, feature: np.ndarray, sample: np.ndarray, n: int
) -> np.ndarray:
  """The permutation sorting by (block, partition, column, feature, sample), the order TF's
  kernels pack ids in. One int64 key where the fields fit in 62 bits (partition is the column's
  low bits, so the column's high bits follow it), else a lexsort."""
  if block.size == 0:
    return np.zeros(0, np.int64)
  low = n.bit_length() - 1
  keys = [sample, feature, column >> low, column & (n - 1), block]
  widths = [max(int(k.max()).bit_length(), 1) for k in keys]
  if sum(widths) > 62:
    return np.lexsort(keys)
  combined = np.zeros(block.shape, np.int64)
  shift = 0
  for key, width in zip(keys, widths):
    combined |= key << shift
    shift += width
  return np.argsort(combined, kind="stable")
