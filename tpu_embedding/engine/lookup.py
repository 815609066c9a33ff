"""The forward lookup and its gradient assembly with the TPU's semantics, on any device.

A step's bags (`inputs`) are looked up table by table. Training deduplicates all features that
share a table together, once per step (each row read once, updated once), and hands its backward
pass an explicit record of that forward pass (`TableLookup`): the bags, unique ids, index, the
rows read and which kernel read them. Combining and gradient assembly are both products with one
sparse matrix S [samples of all bags, unique rows] whose entries are the gains: activations =
S @ rows and row gradients = S^T @ activation gradients (SPEC §2.1, §3.2).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import sys
import types
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.engine import checks, native, sharded
from tpu_embedding.engine.inputs import Bags, Step

Tensor = tf.Tensor


class Kernel(enum.Enum):
  """What read a table's rows in the forward pass, and so what assembles its row gradients."""

  COMPILED = "the engine's compiled kernels (native)"
  TF_OPS = "TensorFlow's ops"
  PER_OCCURRENCE = "TensorFlow's ops, one gather per occurrence: no deduplication to reuse"
  XLA = "ops XLA compiles (static_path): no deduplication"


@dataclasses.dataclass(frozen=True, eq=False)
class Occurrences:
  """All of one table's bags' id occurrences, in bag order."""

  samples: Optional[Tensor]  # int64 [N], activation row across the bags stacked; None: row k
  gains: Optional[Tensor]  # float32 [N]; None: every gain is 1
  num_samples: Tensor  # int64 scalar: rows of the bags' activations stacked

  @classmethod
  def of(cls, bags: Sequence[Bags]) -> "Occurrences":
    if len(bags) == 1:
      return cls(bags[0].samples, bags[0].gains, bags[0].num_samples)
    offsets = tf.cumsum(tf.stack([b.num_samples for b in bags]), exclusive=True)
    samples = [
      _sample_rows(bag) + offset for bag, offset in zip(bags, tf.unstack(offsets, num=len(bags)))
    ]
    gains = None
    if any(b.gains is not None for b in bags):
      gains = tf.concat([_gains_or_ones(b) for b in bags], 0)
    return cls(tf.concat(samples, 0), gains, offsets[-1] + bags[-1].num_samples)


@dataclasses.dataclass(frozen=True, eq=False)
class TableLookup:
  """One table's forward pass in one step, as its backward pass receives it.

  `unique_ids`, `index` and `occurrences` are set where the lookup deduplicated (training off
  XLA); `looked_up_rows` where TF's ops read the unique rows, which the update may reuse.
  """

  bags: tuple[Bags, ...]
  kernel: Kernel
  unique_ids: Optional[Tensor] = None  # int64 [U]: the rows this step touches
  index: Optional[Tensor] = None  # int64 [N]: position of each occurrence in `unique_ids`
  occurrences: Optional[Occurrences] = None
  looked_up_rows: Optional[Tensor] = None  # the table's unique rows, as training read them

  @functools.cached_property
  def sample_matrix(self) -> "SampleMatrix":
    """S [samples of all bags, U]: one entry (sample, unique row) = gain per occurrence."""
    samples, gains = self.occurrences.samples, self.occurrences.gains
    if samples is None:
      samples = tf.range(tf.size(self.index, out_type=tf.int64))
    if gains is None:
      gains = tf.ones(tf.shape(self.index), tf.float32)
    return SampleMatrix.build(
      samples,
      self.index,
      gains,
      self.occurrences.num_samples,
      tf.size(self.unique_ids, out_type=tf.int64),
    )

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
    return concat(parts)

  def row_gradients(self, upstream: Sequence[Optional[Tensor]], dim: int) -> Tensor:
    """The summed gradient of each unique row [U, D] (SPEC §2.1), never a dense table gradient."""
    grads = concat(
      [
        tf.zeros([bag.num_samples, dim])
        if g is None
        else tf.reshape(tf.cast(g, tf.float32), [-1, dim])
        for bag, g in zip(self.bags, upstream)
      ]
    )
    if self.kernel is Kernel.COMPILED:
      return native.row_gradients(
        self.index,
        self.occurrences.samples,
        self.occurrences.gains,
        grads,
        tf.size(self.unique_ids, out_type=tf.int64),
      )
    return self.sample_matrix.matmul(grads, adjoint=True)

  @property
  def occurrence_ids(self) -> Tensor:
    return tf.gather(self.unique_ids, self.index)

  def for_update(self) -> "TableLookup":
    """This lookup with the deduplication an update needs: a per-occurrence forward pass (a
    function traced where no tape recorded, differentiated later) is deduplicated here, in the
    backward pass; the rows are read again by the update."""
    if self.kernel is not Kernel.PER_OCCURRENCE:
      return self
    unique_ids, index = tf.unique(concat([b.ids for b in self.bags]), out_idx=tf.int64)
    return TableLookup(self.bags, Kernel.TF_OPS, unique_ids, index, Occurrences.of(self.bags))


@dataclasses.dataclass(frozen=True, eq=False)
class StepLookup:
  """One step's forward pass: every bag's activations in input order, and each table's lookup."""

  bags: tuple[Bags, ...]  # input order
  activations: list[Tensor]  # one per bag, input order
  tables: dict  # TableConfig -> TableLookup, tables in order of first appearance

  def upstream_by_table(
    self, upstream: Sequence[Optional[Tensor]]
  ) -> list[tuple[Any, TableLookup, list]]:
    """(table, its lookup, its bags' activation gradients) from per-bag gradients in input order."""
    by_bag = {id(bag): g for bag, g in zip(self.bags, upstream)}
    return [
      (table, found.for_update(), [by_bag[id(b)] for b in found.bags])
      for table, found in self.tables.items()
    ]


# How one table is looked up: (table, the variable to read, its bags) -> (what the backward pass
# receives, the bags' activations).
TableLookupFn = Callable[[Any, Tensor, tuple[Bags, ...]], tuple[TableLookup, list[Tensor]]]


def look_up(step: Step, read_table: Callable[[Any], Tensor], how: TableLookupFn) -> StepLookup:
  """Looks every table of `step` up with `how`, reading the table `read_table(table)`.

  `how` is `deduplicated` for training, `per_occurrence` for inference (nothing to update, so
  every occurrence is gathered directly), or the static path's, for steps XLA compiles.
  `for_training` chooses between the first two.
  """
  tables, by_bag = {}, {}
  for table, bags in step.tables.items():
    found, activations = how(table, read_table(table), tuple(bags))
    tables[table] = found
    by_bag.update({id(bag): a for bag, a in zip(bags, activations)})
  return StepLookup(tuple(step.bags), [by_bag[id(bag)] for bag in step.bags], tables)


def serving_lookup(config: Any, tables: Any, features: Any, weights: Any = None) -> Any:
  """Activations of `features` (any subset of `config`'s, in their own structure) read from
  `tables` ({table of `config`: its value}): no gradient trap, nothing to update."""
  step = Step.prepare(
    config, features, weights, subset=True, gathered_on_cpu=gathered_on_cpu(tables)
  )
  found = look_up(step, lambda table: tables[table], per_occurrence)
  return tf.nest.pack_sequence_as(features, found.activations)


_EXPORTING = contextvars.ContextVar("exporting", default=False)


@contextlib.contextmanager
def exporting() -> Iterator[None]:
  """Within it, functions are traced for an export served on CPU (`serving.export_for_serving`),
  with the fewest ops per request: every op of a check of our own costs a request more than the
  whole gap to a plain gather. So the layer's lookups have no gradient trap (an export saves no
  custom gradient: its trap would be an inert identity), and an unsharded table on CPU leaves
  its id-range check to TF's CPU gather, which refuses an id outside the table itself, naming
  the id, the table's size and the op (`checks.gather_scope`: the feature and table). Elsewhere
  the check is kept: a GPU gather returns zeros for such an id, and a sharded table's gather
  remaps ids first.
  """
  token = _EXPORTING.set(True)
  try:
    yield
  finally:
    _EXPORTING.reset(token)


def tracing_an_export() -> bool:
  return _EXPORTING.get() and not tf.executing_eagerly()


_READING: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
  "reading", default=types.MappingProxyType({})
)


@contextlib.contextmanager
def reading_tables(tables: Mapping[str, Any]) -> Iterator[None]:
  """Within it, the inference lookups (per occurrence) of the tables named in `tables` gather
  from `tables[name]`, an object whose `gather(ids)` gives float32 rows, instead of the table's
  variable: an export's low-precision tables (`quantization`)."""
  token = _READING.set(tables)
  try:
    yield
  finally:
    _READING.reset(token)


def _gather(table: Any, variable: Tensor, ids: Tensor) -> Tensor:
  """The rows of `ids`, from the replacement of `table` where `reading_tables` gives one."""
  replacement = _READING.get().get(table.name)
  if replacement is not None:
    return replacement.gather(ids)
  return sharded.gather(variable, ids)


def gathered_on_cpu(tables: Any) -> frozenset:
  """Names of the tables ({TableConfig: variable}) that a per-occurrence lookup traced now may
  leave to refuse out-of-range ids by itself (see `exporting`): unsharded variables on CPU."""
  if not tracing_an_export() or tf.distribute.has_strategy():
    return frozenset()
  return frozenset(
    table.name
    for table, variable in tables.items()
    if not sharded.is_sharded(variable)
    and tf.DeviceSpec.from_string(getattr(variable, "device", "") or "").device_type == "CPU"
  )


def per_occurrence(
  table: Any, variable: Tensor, bags: tuple[Bags, ...]
) -> tuple[TableLookup, list[Tensor]]:
  """The inference lookup: no deduplication, each occurrence's row gathered and combined.

  The activations are bit-identical to `deduplicated`'s: the same rows, summed with the same
  gains in the same occurrence order by the same sparse product.
  """
  activations = []
  for bag in bags:
    with tf.name_scope(checks.gather_scope(bag.feature)):  # named in the gather's errors
      rows = _gather(table, variable, bag.ids)
    activations.append(_combine(bag, quantize(rows, table)))
  return TableLookup(bags, Kernel.PER_OCCURRENCE), activations


def for_training() -> TableLookupFn:
  """The lookup of a step that may train: `deduplicated` where a gradient tape may record it,
  else `per_occurrence` (a serving signature or an inference function: the fewest ops; should
  such a function be differentiated after all, `TableLookup.for_update` deduplicates then)."""
  return deduplicated if tf_internals.could_possibly_record() else per_occurrence


def deduplicated(
  table: Any, variable: Tensor, bags: tuple[Bags, ...]
) -> tuple[TableLookup, list[Tensor]]:
  """The training lookup: each touched row read once, the deduplication kept for the update.

  Where the compiled kernels may run, one of them does it, but only under a recording gradient
  tape: a function traced without one (a serving signature) keeps TF's ops, so that it can be
  exported and loaded with TensorFlow alone.
  """
  occurrences = Occurrences.of(bags)
  ids = concat([b.ids for b in bags])
  if (
    table.quantization_config is None
    and tf_internals.could_possibly_record()
    and not sharded.is_sharded(variable)
    and native.runs_on([variable])
  ):
    flat, unique_ids, index = native.dedup_lookup(
      variable, ids, occurrences.samples, occurrences.gains, occurrences.num_samples
    )
    found = TableLookup(bags, Kernel.COMPILED, unique_ids, index, occurrences)
  else:
    unique_ids, index = tf.unique(ids, out_idx=tf.int64)
    rows = sharded.gather(variable, unique_ids)
    found = TableLookup(bags, Kernel.TF_OPS, unique_ids, index, occurrences, rows)
    unique_rows = quantize(rows, table)
    one_id_per_sample = all(b.samples is None and b.gains is None for b in bags)
    if one_id_per_sample and _needs_blocks(unique_rows):
      # One id per sample, weight 1, wide rows: a gather beats the blocked sparse matmul.
      flat = tf.gather(unique_rows, index)
    else:
      flat = found.sample_matrix.matmul(unique_rows)
  return found, [shape_activations(bag, part) for bag, part in zip(bags, _split(flat, bags))]


def _split(flat: Tensor, bags: Sequence[Bags]) -> list[Tensor]:
  """The bags' stacked activation rows, one part per bag."""
  if len(bags) == 1:
    return [flat]
  return tf.split(flat, tf.stack([b.num_samples for b in bags]), num=len(bags))


def concat(parts: Sequence[Tensor]) -> Tensor:
  """`parts` joined along rows, without an op when there is only one."""
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
  """A sparse [rows, columns] matrix in the layout of TF's sparse-dense matmul kernel.

  On CPU one sparse matmul is far cheaper than the gather, multiply and segment sum it replaces
  (measured ~14x for a 4096 x 16 batch).
  """

  indices: Tensor  # [nnz, 2] (row, column), int32 where they fit, else int64
  values: Tensor  # float32 [nnz]
  shape: Tensor  # int64 [2]

  @classmethod
  def build(
    cls, rows: Tensor, columns: Tensor, values: Tensor, num_rows: Tensor, num_columns: Tensor
  ) -> "SampleMatrix":
    """From int64 coordinates, which must be below 2**31 (they count samples and rows)."""
    if _LITTLE_ENDIAN:
      # (row, column) int32 pairs are the two halves of row + column * 2**32: one add and one
      # shift instead of stacking two columns, which TF's CPU kernels do element by element.
      indices = tf.bitcast(
        rows + tf.bitwise.left_shift(columns, tf.constant(32, tf.int64)), tf.int32
      )
    else:
      indices = tf.stack([rows, columns], axis=1)
    return cls(
      indices, values, tf.stack([tf.cast(num_rows, tf.int64), tf.cast(num_columns, tf.int64)])
    )

  def matmul(self, dense: Tensor, adjoint: bool = False) -> Tensor:
    """`self @ dense` (or its adjoint), in column blocks of 16.

    TF's CPU kernel vectorises only over fewer than 32 columns and takes a per-row path above;
    blocks keep it on the fast path (measured 2x faster at dim 32 and 64). Columns are
    independent, so the result is bit-identical.
    """
    product = functools.partial(
      tf.raw_ops.SparseTensorDenseMatMul,
      a_indices=self.indices,
      a_values=self.values,
      a_shape=self.shape,
      adjoint_a=adjoint,
    )
    if not _needs_blocks(dense):
      return product(b=dense)
    width = dense.shape[-1]
    blocks = tf.split(
      dense, [min(_MATMUL_BLOCK, width - c) for c in range(0, width, _MATMUL_BLOCK)], axis=1
    )
    return tf.concat([product(b=b) for b in blocks], axis=1)


def _needs_blocks(dense: Tensor) -> bool:
  return dense.shape[-1] is not None and dense.shape[-1] >= 2 * _MATMUL_BLOCK


def sum_by_index(values: Tensor, index: Tensor, count: Tensor) -> Tensor:
  """out[i] = sum of values[k] where index[k] == i, as a sparse matmul (see SampleMatrix)."""
  size = tf.size(index, out_type=tf.int64)
  matrix = SampleMatrix.build(tf.range(size), index, tf.ones([size], values.dtype), size, count)
  return matrix.matmul(values, adjoint=True)


def _combine(bag: Bags, rows: Tensor) -> Tensor:
  """Reduces each occurrence's row [N, D] into the bag's activations, shaped for the model."""
  if bag.samples is None and bag.gains is None:
    return shape_activations(bag, rows)
  occurrences = tf.range(tf.size(bag.ids, out_type=tf.int64))
  matrix = SampleMatrix.build(
    _sample_rows(bag),
    occurrences,
    _gains_or_ones(bag),
    bag.num_samples,
    tf.size(bag.ids, out_type=tf.int64),
  )
  return shape_activations(bag, matrix.matmul(rows))


def shape_activations(bag: Bags, flat: Tensor) -> Tensor:
  if bag.static_shape.rank == 1:  # one row per sample already: [N, D] is the activation
    return _set_static_shape(flat, bag, flat.shape[-1])
  dim = tf.shape(flat, out_type=tf.int64)[1:]
  out = tf.reshape(flat, tf.concat([bag.output_shape, dim], axis=0))
  return _set_static_shape(out, bag, flat.shape[-1])


def _set_static_shape(out: Tensor, bag: Bags, dim: Optional[int]) -> Tensor:
  """Restores the static shape the reshape lost, so Keras sees [B, D] where it can."""
  if bag.static_shape.rank is not None:
    out.set_shape(bag.static_shape.concatenate([dim]))
  return out


def quantize(rows: Tensor, table) -> Tensor:
  """Simulated quantization of gathered rows (forward only, SPEC §3.8); identity if unset."""
  config = table.quantization_config
  if config is None:
    return rows
  step = (config.upper - config.lower) / (config.num_buckets - 1)
  clipped = tf.clip_by_value(rows, config.lower, config.upper)
  quantized = tf.floor((clipped - config.lower) / step + 0.5) * step + config.lower
  return rows + tf.stop_gradient(quantized - rows)
