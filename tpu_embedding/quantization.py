"""Low-precision tables for a serving export: float16, bfloat16, and row-wise int8 and int4.

Serving reads a few rows per request and needs no float32 rows, while the tables are most of an
export's bytes. A `LowPrecisionTable` holds a table's rows in one of these forms and gathers
them back as float32 (TensorFlow ops only, so the export still loads without this package):

* "float16", "bfloat16": each value cast, rounding to nearest (ties to even).
* "int8": FBGEMM's 8-bit rowwise form. Per row, bias = min, scale = (max - min) / 255, each
  value stored as the code q = round((x - bias) / scale) (float32 arithmetic, ties to even) in a
  uint8; it reads back as q * scale + bias, within scale / 2 of x. Scale and bias are float32.
* "int4": the same with scale = (max - min) / 15 (codes 0..15), two codes a byte (the even
  column in the low four bits); an odd row ends with a zero half byte. Scale and bias are
  float32 too: the error is then the 4-bit rounding alone (within (max - min) / 30), and a table
  of any finite range keeps it (float16 scales would save 4 bytes a row but add float16's own
  rounding and overflow beyond 65504).
An int8/int4 table is one variable "rows" in FBGEMM's fused rowwise layout: each row its code
bytes (zero-padded to a multiple of 4), then its scale and bias, the whole row viewed as float32
words ([rows, ceil(code bytes / 4) + 2]), so that a lookup reads a row's codes, scale and bias
in one gather (separate gathers for them cost more than the decode's arithmetic on CPU).
`LowPrecisionTable.stored()` unpacks it ({"codes", "scale", "bias"}), in an export too. (The
words hold the bytes in the writer's byte order: TensorFlow's byte swapping of a checkpoint read
on a big-endian machine would reorder the codes within each word.)
A row whose values are all equal gets scale 0 and codes 0: it reads back exactly.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import tensorflow as tf

FLOAT32 = "float32"


class Format(abc.ABC):
  """How a table's rows are stored: `encode` all rows once, `decode` gathered rows per request."""

  name: str

  @abc.abstractmethod
  def encode(self, values: tf.Tensor) -> dict[str, tf.Tensor]:
    """The stored variables' values ({"codes": [rows, dim]} or {"rows": fused rows})."""

  @abc.abstractmethod
  def decode(self, parts: Mapping[str, tf.Tensor], dim: int) -> tf.Tensor:
    """float32 rows [n, dim] from `parts` gathered for n rows."""

  @abc.abstractmethod
  def stored(self, parts: Mapping[str, tf.Tensor], dim: int) -> dict[str, tf.Tensor]:
    """What `parts` store: {"codes": [n, ...], and "scale", "bias": float32 [n, 1] if any}."""


class Cast(Format):
  """Each value cast to a 16-bit float."""

  def __init__(self, dtype: tf.DType):
    self.name = dtype.name
    self._dtype = dtype

  def encode(self, values: tf.Tensor) -> dict[str, tf.Tensor]:
    return {"codes": tf.cast(values, self._dtype)}

  def decode(self, parts: Mapping[str, tf.Tensor], dim: int) -> tf.Tensor:
    return tf.cast(parts["codes"], tf.float32)

  def stored(self, parts: Mapping[str, tf.Tensor], dim: int) -> dict[str, tf.Tensor]:
    return {"codes": parts["codes"]}


class Rowwise(Format):
  """Row-wise asymmetric integer codes of `bits` bits (8 or 4) in FBGEMM's fused rowwise layout."""

  def __init__(self, bits: int):
    self.name = f"int{bits}"
    self.levels = 2**bits - 1
    self._per_byte = 8 // bits

  def encode(self, values: tf.Tensor) -> dict[str, tf.Tensor]:
    bias = tf.reduce_min(values, axis=1, keepdims=True)
    scale = (tf.reduce_max(values, axis=1, keepdims=True) - bias) / self.levels
    codes = tf.round(tf.math.divide_no_nan(values - bias, scale))
    # A subnormal scale is rounded coarsely, which can push a code past the top level.
    codes = tf.cast(tf.clip_by_value(codes, 0, self.levels), tf.uint8)
    packed = self._pack(codes)
    packed = tf.pad(packed, [[0, 0], [0, -packed.shape[1] % 4]])
    quads = tf.reshape(packed, [tf.shape(packed)[0], packed.shape[1] // 4, 4])
    words = tf.bitcast(quads, tf.float32)
    return {"rows": tf.concat([words, scale, bias], 1)}

  def decode(self, parts: Mapping[str, tf.Tensor], dim: int) -> tf.Tensor:
    # One gathered row holds everything: split, view the words as bytes, unpack (int4), then
    # q * scale + bias (FBGEMM's dequantization; bit-identical to the NumPy reference).
    packed, scale, bias = self._unfuse(parts["rows"])
    codes = self._unpack(packed)
    if codes.shape[1] != dim:
      codes = codes[:, :dim]
    return tf.cast(codes, tf.float32) * scale + bias

  def stored(self, parts: Mapping[str, tf.Tensor], dim: int) -> dict[str, tf.Tensor]:
    packed, scale, bias = self._unfuse(parts["rows"])
    return {"codes": packed[:, : -(-dim // self._per_byte)], "scale": scale, "bias": bias}

  def _unfuse(self, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(code bytes uint8 [n, 4 * words], scale [n, 1], bias [n, 1]) of fused `rows`."""
    words = rows.shape[1] - 2
    words_part, scale, bias = tf.split(rows, [words, 1, 1], axis=1)
    packed = tf.reshape(tf.bitcast(words_part, tf.uint8), [-1, 4 * words])  # no Shape op
    return packed, scale, bias

  def _pack(self, codes: tf.Tensor) -> tf.Tensor:
    if self._per_byte == 1:
      return codes
    if codes.shape[1] % 2:
      codes = tf.pad(codes, [[0, 0], [0, 1]])
    pairs = tf.reshape(codes, [tf.shape(codes)[0], -1, 2])
    return pairs[:, :, 0] + tf.bitwise.left_shift(pairs[:, :, 1], 4)

  def _unpack(self, packed: tf.Tensor) -> tf.Tensor:
    if self._per_byte == 1:
      return packed
    pairs = tf.stack([tf.bitwise.bitwise_and(packed, 15), tf.bitwise.right_shift(packed, 4)], -1)
    return tf.reshape(pairs, [-1, 2 * packed.shape[1]])


FORMATS: dict[str, Format] = {
  f.name: f for f in (Cast(tf.float16), Cast(tf.bfloat16), Rowwise(8), Rowwise(4))
}
DTYPES = (FLOAT32, *FORMATS)


def formats_by_table(
  table_dtype: Any, tables: Iterable[str], name_of: Callable[[Any], str]
) -> dict[str, Format]:
  """{table name: its low-precision format} for `export_for_serving(table_dtype=...)`: one
  dtype for every table in `tables`, or {table name or TableConfig: dtype} (tables not named
  stay float32). `name_of` resolves a TableConfig key to its table's name."""
  tables = sorted(tables)
  if table_dtype is None or isinstance(table_dtype, str):
    chosen = format_of(table_dtype, "table_dtype")
    return {name: chosen for name in tables} if chosen else {}
  if not isinstance(table_dtype, Mapping):
    raise TypeError(
      f"table_dtype={table_dtype!r}: expected None, one of {list(DTYPES)}, or a dict "
      "{table name: dtype}. Nothing was written."
    )
  formats = {}
  for key, dtype in table_dtype.items():
    name = key if isinstance(key, str) else name_of(key)
    if name not in tables:
      raise ValueError(
        f"table_dtype names table {name!r}, which no TPUEmbedding layer of the model has; its "
        f"tables are {tables}. Nothing was written."
      )
    chosen = format_of(dtype, f"table_dtype[{name!r}]")
    if chosen:
      formats[name] = chosen
  return formats


def format_of(dtype: Any, argument: str) -> Optional[Format]:
  """The format of `dtype` (None for float32); an unknown one is refused naming `argument`."""
  if dtype is None or dtype == FLOAT32:
    return None
  if isinstance(dtype, str) and dtype in FORMATS:
    return FORMATS[dtype]
  raise ValueError(
    f"{argument}={dtype!r}: expected one of {list(DTYPES)} (or None for float32). Nothing was "
    "written."
  )


class LowPrecisionTable(tf.Module):
  """A table stored in a low-precision `Format`.

  In an export (loaded or not), calling it gives the whole table as float32 and `stored()` its
  stored form ({"codes"}, and for int8/int4 "scale" and "bias" [rows, 1]); `parts` holds its
  variables ("codes" for float16/bfloat16, "rows" for int8/int4: the fused rows of the module
  docstring); `gather` builds a signature's lookup.
  """

  def __init__(self, table: str, values: tf.Tensor, format: Format):
    super().__init__(name=table)
    values = tf.convert_to_tensor(values, tf.float32)
    _check_values(table, values, format)
    parts = format.encode(values)
    _check_encoded(table, values, format.stored(parts, int(values.shape[1])), format)
    self.format = format
    self.dim = int(values.shape[1])
    self.parts = {k: tf.Variable(v, trainable=False, name=k) for k, v in parts.items()}

  def gather(self, ids: tf.Tensor) -> tf.Tensor:
    """float32 rows of `ids` (gathered in their stored form, then decoded)."""
    return self.format.decode({k: tf.gather(v, ids) for k, v in self.parts.items()}, self.dim)

  @tf.function(input_signature=[], autograph=False)
  def __call__(self) -> tf.Tensor:
    return self.format.decode(self._values(), self.dim)

  @tf.function(input_signature=[], autograph=False)
  def stored(self) -> dict[str, tf.Tensor]:
    return self.format.stored(self._values(), self.dim)

  def _values(self) -> dict[str, tf.Tensor]:
    return {k: tf.convert_to_tensor(v) for k, v in self.parts.items()}


def _check_values(table: str, values: tf.Tensor, format: Format) -> None:
  finite = tf.reduce_all(tf.math.is_finite(values), axis=1).numpy()
  if not finite.all():
    row = int(np.argmin(finite))
    raise ValueError(
      f"Table {table!r} holds NaN or inf (row {row} first): table_dtype={format.name!r} cannot "
      "store it. Fix the table or leave it float32 (table_dtype={table name: dtype} chooses "
      "per table). Nothing was written."
    )


def _check_encoded(
  table: str, values: tf.Tensor, parts: Mapping[str, tf.Tensor], format: Format
) -> None:
  """Refuses values beyond the format's range (float16's 65504, a row range over float32's);
  `parts` as `Format.stored` gives them."""
  stored = [p for p in parts.values() if p.dtype.is_floating]
  if all(tf.reduce_all(tf.math.is_finite(p)).numpy() for p in stored):
    return
  largest = float(tf.reduce_max(tf.abs(values)).numpy())
  raise ValueError(
    f"Table {table!r} holds values beyond what table_dtype={format.name!r} can store (largest "
    f"|value| {largest:.6g}). Leave this table float32 (table_dtype={{table name: dtype}} "
    "chooses per table). Nothing was written."
  )
