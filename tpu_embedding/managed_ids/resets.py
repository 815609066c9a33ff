"""Fresh values for rows given to new keys: what a newly created table and its slots hold.

An initializer whose elements are drawn independently (a constant, a normal, a truncated normal
or a uniform one with numeric parameters) is described as a `Draw`; the reset kernel draws those
in place (`row_resets`), and TF's ops draw them here the same way: a stream seeded as TF's
stateful random ops are, so that rows reset in different steps get different values (Keras's
initializers would give the same block again at every call). Other initializers are called.
"""

from __future__ import annotations

import dataclasses
import numbers
import zlib
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import optimizer_specs, tf_internals

TableConfig = tf.tpu.experimental.embedding.TableConfig

# Initializers whose every element is drawn independently of the shape asked for, where no
# `Draw` describes them (e.g. seeded by a Keras SeedGenerator): a fresh draw for just the reset
# rows has the distribution a fresh table's rows have. Others (fan-scaled, user callables,
# full-table constants) are evaluated at the full shape and the rows gathered.
_ROW_INDEPENDENT = frozenset({"RandomNormal", "RandomUniform", "TruncatedNormal"})


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
# TF's stateful op drawing each random kind's unit values (standard normal, truncated at two
# standard deviations, uniform in [0, 1)).
_UNIT_OPS = {
  "normal": tf.raw_ops.RandomStandardNormal,
  "truncated_normal": tf.raw_ops.TruncatedNormal,
  "uniform": tf.raw_ops.RandomUniform,
}


def fresh_rows(table: TableConfig, rows: tf.Tensor) -> dict[str, tf.Tensor]:
  """{"parameters": [len(rows), dim], slot name: its [len(rows), ...]}: what a fresh table and
  its optimizer slots hold at `rows` (where each path writes them is its own business)."""
  values = {}
  for name, (initializer, full_shape) in _initializers(table).items():
    shape = tf.concat([tf.shape(rows, tf.int64), tf.constant(full_shape[1:], tf.int64)], 0)
    described = _draw_of(initializer)
    seeds = described and _seeds_for(described, f"{table.name}/{name}")
    if seeds is not None:
      values[name] = _drawn(described[0], shape, seeds)
    elif type(initializer).__name__ in _ROW_INDEPENDENT:
      values[name] = initializer(shape=shape, dtype=tf.float32)
    else:
      values[name] = tf.gather(initializer(shape=full_shape, dtype=tf.float32), rows)
  return values


def draws(table: TableConfig) -> Optional[Draws]:
  """What `fresh_rows` draws, as `Draws` for a kernel that draws rows in place; None when an
  initializer is not one of the elementwise ones it knows (constants, normal, truncated normal,
  uniform) with numbers as parameters, is seeded by something other than an integer, or needs a
  seed that op determinism (`tf.config.experimental.enable_op_determinism`) finds missing."""
  by_variable, seeds = {}, []
  for name, (initializer, _) in _initializers(table).items():
    described = _draw_of(initializer)
    if described is None:
      return None
    by_variable[name] = described[0]
    if described[0].kind != "constant":
      seeds.append(described[1])
  if not seeds:
    return Draws(by_variable, (0, 0))  # nothing random: no seeds needed
  pair = _op_seeds(next((s for s in seeds if s is not None), None), table.name)
  return None if pair is None else Draws(by_variable, pair)


def _initializers(table: TableConfig) -> dict[str, tuple[Callable, list[int]]]:
  """{"parameters"/slot name: (its initializer, its full shape)}."""
  found = {"parameters": (table.initializer, [table.vocabulary_size, table.dim])}
  if table.optimizer is not None:
    initializers = optimizer_specs.slot_initializers(table.optimizer)
    for (name, shape), initializer in zip(config_lib.slot_shapes(table), initializers):
      found[name] = (initializer, shape)
  return found


def _draw_of(initializer: Callable) -> Optional[tuple[Draw, Optional[int]]]:
  """(the `Draw` of `initializer`, its seed), or None if it is not one `Draw` describes."""
  value = _scalar_constant(initializer)
  if value is not None:
    return Draw("constant", value), None
  known = _DISTRIBUTIONS.get(type(initializer).__name__)
  if known is None:
    return None
  config = initializer.get_config()
  seed = config.get("seed")
  kind, first, second = known
  if not (seed is None or isinstance(seed, numbers.Integral)):
    return None
  if not all(isinstance(config.get(key), numbers.Real) for key in (first, second)):
    return None  # e.g. a tensor: left to the initializer, which takes one
  return Draw(kind, float(config[first]), float(config[second])), (
    None if seed is None else int(seed)
  )


def _seeds_for(described: tuple[Draw, Optional[int]], stream: str) -> Optional[tuple]:
  draw, seed = described
  return (0, 0) if draw.kind == "constant" else _op_seeds(seed, stream)


def _drawn(draw: Draw, shape: tf.Tensor, seeds: tuple[int, int]) -> tf.Tensor:
  """Values of `shape` drawn as `draw` says, by TF's stateful random ops seeded `seeds`."""
  if draw.kind == "constant":
    return tf.fill(shape, tf.constant(draw.first, tf.float32))
  unit = _UNIT_OPS[draw.kind](shape=shape, dtype=tf.float32, seed=seeds[0], seed2=seeds[1])
  if draw.kind == "uniform":
    # first + (second - first) * u can round up to second when |first| >> second - first.
    below = np.nextafter(np.float32(draw.second), np.float32(draw.first))
    return tf.minimum(draw.first + (draw.second - draw.first) * unit, below)
  return draw.first + draw.second * unit


def _op_seeds(seed: Optional[int], stream: str) -> Optional[tuple[int, int]]:
  """TF's op-level seed pair for an initializer's `seed`, as TF's random ops derive it: random
  (0, 0) when neither it nor a global seed is set; None when op determinism requires one then.
  An unseeded initializer under a global seed takes a fixed seed per `stream` (a table, or one
  of its variables), so that the op, and its stream, are the same at every call (TF's per-call
  seeds would make a new kernel at each eager call) and two variables differ."""
  if seed is None:
    if tf_internals.global_seed() is None:
      # Without any seed: random, or, under op determinism, left to the initializer.
      return None if tf_internals.op_determinism_enabled() else (0, 0)
    seed = zlib.crc32(stream.encode())
  first, second = tf.compat.v1.get_seed(seed)
  return int(first), int(second)


def _scalar_constant(initializer: Callable) -> Any:
  """The value of a constant initializer of one value (zeros, ones, Constant(scalar))."""
  name = type(initializer).__name__
  if name == "Zeros":
    return 0.0
  if name == "Ones":
    return 1.0
  if name == "Constant":
    value = initializer.get_config().get("value")
    if isinstance(value, numbers.Real):  # numpy scalars too
      return float(value)
  return None
