"""Fresh values for rows given to new keys: what a newly created table and its slots hold."""

from __future__ import annotations

import dataclasses
import numbers
import zlib
from typing import Any, Callable, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import optimizer_specs

TableConfig = tf.tpu.experimental.embedding.TableConfig

# Initializers whose every element is drawn independently of the shape asked for: a fresh draw
# for just the reset rows has the distribution a fresh table's rows have. Others (fan-scaled,
# user callables, full-table constants) are evaluated at the full shape and the rows gathered.
_ROW_INDEPENDENT = frozenset({"RandomNormal", "RandomUniform", "TruncatedNormal", "Zeros", "Ones"})


def fresh_rows(table: TableConfig, rows: tf.Tensor) -> dict[str, tf.Tensor]:
  """{"parameters": [len(rows), dim], slot name: its [len(rows), ...]}: what a fresh table and
  its optimizer slots hold at `rows` (where each path writes them is its own business)."""
  values = {"parameters": _fresh(table.initializer, rows, [table.vocabulary_size, table.dim])}
  if table.optimizer is not None:
    initializers = optimizer_specs.slot_initializers(table.optimizer)
    for (name, shape), initializer in zip(config_lib.slot_shapes(table), initializers):
      values[name] = _fresh(initializer, rows, shape)
  return values


@dataclasses.dataclass(frozen=True)
class Draw:
  """How each element of a fresh variable is drawn, independently of the others: `kind`
  "constant" (`first`), "normal" or "truncated_normal" (mean `first`, standard deviation
  `second`; truncated at two of them, as TF truncates) or "uniform" (in [`first`, `second`))."""

  kind: str
  first: float
  second: float = 0.0


@dataclasses.dataclass(frozen=True)
class Draws:
  """The `Draw` of the table and of each slot ({"parameters"/slot name: Draw}) and the seeds
  (TF's op-level pair; (0, 0): random) that make the draws reproducible where TF's would be."""

  by_variable: dict[str, Draw]
  seeds: tuple[int, int]


# Initializer class -> (its Draw kind, the config keys of `first` and `second`).
_DISTRIBUTIONS = {
  "TruncatedNormal": ("truncated_normal", "mean", "stddev"),
  "RandomNormal": ("normal", "mean", "stddev"),
  "RandomUniform": ("uniform", "minval", "maxval"),
}


def draws(table: TableConfig) -> Optional[Draws]:
  """What `fresh_rows` draws, as `Draws` for a kernel that draws rows in place; None when an
  initializer is not one of the elementwise ones it knows (constants, normal, truncated normal,
  uniform) with numbers as parameters, or is seeded by something other than an integer."""
  initializers = {"parameters": table.initializer}
  if table.optimizer is not None:
    names = [name for name, _ in config_lib.slot_shapes(table)]
    initializers.update(zip(names, optimizer_specs.slot_initializers(table.optimizer)))
  by_variable, seeds = {}, []
  for name, initializer in initializers.items():
    value = _scalar_constant(initializer)
    if value is not None:
      by_variable[name] = Draw("constant", value)
      continue
    known = _DISTRIBUTIONS.get(type(initializer).__name__)
    config = initializer.get_config() if known else {}
    seed = config.get("seed")
    if not known or not (seed is None or isinstance(seed, int)):
      return None
    kind, first, second = known
    if not all(isinstance(config.get(key), numbers.Real) for key in (first, second)):
      return None  # e.g. a tensor: left to TF's ops, which take one
    by_variable[name] = Draw(kind, float(config[first]), float(config[second]))
    seeds.append(seed)
  return Draws(by_variable, _op_seeds(next((s for s in seeds if s is not None), None), table))


def _op_seeds(seed: Optional[int], table: TableConfig) -> tuple[int, int]:
  """TF's op-level seed pair for an initializer's `seed`, as TF's random ops derive it: random
  (0, 0) when neither it nor a global seed is set. An unseeded initializer under a global seed
  takes a fixed seed per table, so that the kernel, and its stream, are the same at every call
  (TF's per-call seeds would make a new kernel at each eager call)."""
  if seed is None:
    if tf.compat.v1.get_seed(None) == (None, None):
      return 0, 0
    seed = zlib.crc32(table.name.encode())
  first, second = tf.compat.v1.get_seed(seed)
  return int(first), int(second)


def _fresh(initializer: Callable, rows: tf.Tensor, full_shape: list[int]) -> tf.Tensor:
  shape = tf.concat([tf.shape(rows, tf.int64), tf.constant(full_shape[1:], tf.int64)], 0)
  value = _scalar_constant(initializer)
  if value is not None:
    return tf.fill(shape, tf.constant(value, tf.float32))
  if type(initializer).__name__ in _ROW_INDEPENDENT:
    return initializer(shape=shape, dtype=tf.float32)
  return tf.gather(initializer(shape=full_shape, dtype=tf.float32), rows)


def _scalar_constant(initializer: Callable) -> Any:
  """The value of a constant initializer of one value (zeros, ones, Constant(scalar))."""
  name = type(initializer).__name__
  if name == "Zeros":
    return 0.0
  if name == "Ones":
    return 1.0
  if name == "Constant":
    value = initializer.get_config().get("value")
    if isinstance(value, (int, float)):
      return float(value)
  return None
