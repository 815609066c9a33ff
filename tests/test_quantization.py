"""Low-precision tables (`tpu_embedding.quantization`): stored codes and decoded rows against
hand-worked numbers and a NumPy transcription of the formulas; refusals of bad tables and dtypes.
"""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import quantization


def numpy_rowwise(x, levels):
  """(codes, scale, bias, decoded) of FBGEMM's rowwise formula, literally, in float32."""
  x = np.asarray(x, np.float32)
  bias = x.min(axis=1, keepdims=True)
  scale = (x.max(axis=1, keepdims=True) - bias) / np.float32(levels)
  with np.errstate(invalid="ignore", divide="ignore"):
    codes = np.where(scale > 0, np.rint((x - bias) / scale), 0).astype(np.uint8)
  return codes, scale, bias, codes.astype(np.float32) * scale + bias


def numpy_bfloat16_bits(x):
  """bfloat16 bits of float32 `x`, rounded to nearest, ties to even."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def random_table(rows=64, dim=7, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(rows, dim)) * rng.uniform(0.01, 3, size=(rows, 1))).astype(np.float32)


def stored(table):
  return {k: v.numpy() for k, v in table.parts.items()}


def test_int8_codes_and_rows_of_a_hand_worked_table():
  # Row 0: bias -1, scale 255 / 255 = 1. Row 1: all equal, scale 0, read back exactly.
  table = quantization.LowPrecisionTable(
    "t", np.array([[-1, 254, 0, 100], [3, 3, 3, 3]], np.float32), quantization.FORMATS["int8"]
  )
  parts = stored(table)
  np.testing.assert_array_equal(parts["codes"], [[0, 255, 1, 101], [0, 0, 0, 0]])
  assert parts["codes"].dtype == np.uint8
  np.testing.assert_array_equal(parts["scale"], [[1], [0]])
  np.testing.assert_array_equal(parts["bias"], [[-1], [3]])
  assert parts["scale"].dtype == parts["bias"].dtype == np.float32
  np.testing.assert_array_equal(table().numpy(), [[-1, 254, 0, 100], [3, 3, 3, 3]])


def test_int4_packs_two_codes_a_byte_low_half_first():
  # Scale 15 / 15 = 1, bias 0: codes are the values; the odd fifth column pairs with a zero.
  table = quantization.LowPrecisionTable(
    "t", np.array([[0, 15, 4, 7, 11]], np.float32), quantization.FORMATS["int4"]
  )
  parts = stored(table)
  np.testing.assert_array_equal(parts["codes"], [[0 + 15 * 16, 4 + 7 * 16, 11]])
  np.testing.assert_array_equal(parts["scale"], [[1]])
  np.testing.assert_array_equal(table().numpy(), [[0, 15, 4, 7, 11]])
  np.testing.assert_array_equal(table.gather(tf.constant([0, 0])).numpy(), [[0, 15, 4, 7, 11]] * 2)


@pytest.mark.parametrize("dtype,levels", [("int8", 255), ("int4", 15)])
@pytest.mark.parametrize("dim", [6, 7])
def test_rowwise_codes_and_rows_equal_the_numpy_formula(dtype, levels, dim):
  x = random_table(dim=dim)
  codes, scale, bias, decoded = numpy_rowwise(x, levels)
  table = quantization.LowPrecisionTable("t", x, quantization.FORMATS[dtype])
  parts = stored(table)
  if dtype == "int4":
    padded = np.pad(codes, [(0, 0), (0, dim % 2)])
    codes = padded[:, 0::2] + 16 * padded[:, 1::2]
  np.testing.assert_array_equal(parts["codes"], codes)
  np.testing.assert_array_equal(parts["scale"], scale)
  np.testing.assert_array_equal(parts["bias"], bias)
  np.testing.assert_array_equal(table().numpy(), decoded)
  ids = [5, 0, 63, 5]
  np.testing.assert_array_equal(table.gather(tf.constant(ids)).numpy(), decoded[ids])
  # Each value within half a step of the original (and a little float32 rounding).
  assert np.all(np.abs(decoded - x) <= scale / 2 * (1 + 1e-5) + 1e-7)


def test_float16_and_bfloat16_round_to_nearest_even():
  x = random_table()
  x[0, :3] = [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8]  # float16 ties; a bfloat16 tie
  half = quantization.LowPrecisionTable("t", x, quantization.FORMATS["float16"])
  np.testing.assert_array_equal(stored(half)["codes"], x.astype(np.float16))
  np.testing.assert_array_equal(half().numpy(), x.astype(np.float16).astype(np.float32))
  assert half().numpy()[0, :2].tolist() == [1.0, 1 + 4 * 2**-11]
  brain = quantization.LowPrecisionTable("t", x, quantization.FORMATS["bfloat16"])
  bits = numpy_bfloat16_bits(x)
  np.testing.assert_array_equal(
    tf.bitcast(brain.parts["codes"], tf.uint16).numpy(), bits
  )  # fmt: skip
  widened = (bits.astype(np.uint32) << 16).view(np.float32)
  np.testing.assert_array_equal(brain().numpy(), widened)
  assert brain().numpy()[0, 2] == 1.0


@pytest.mark.parametrize("bad,what", [(np.nan, "NaN or inf"), (np.inf, "NaN or inf")])
def test_a_table_holding_nan_or_inf_is_refused_naming_it(bad, what):
  x = random_table()
  x[9, 2] = bad
  with pytest.raises(ValueError, match=rf"Table 'user' holds {what} \(row 9 first\): "):
    quantization.LowPrecisionTable("user", x, quantization.FORMATS["int8"])


def test_values_beyond_float16_are_refused_naming_the_table():
  x = random_table()
  x[3, 1] = 70000.0
  with pytest.raises(ValueError, match=r"Table 'movie' holds values beyond what "):
    quantization.LowPrecisionTable("movie", x, quantization.FORMATS["float16"])


def test_table_dtype_names_every_table_or_some():
  tables = ["user", "movie", "genre"]
  by_table = quantization.formats_by_table("int8", tables, str)
  assert {k: v.name for k, v in by_table.items()} == dict.fromkeys(sorted(tables), "int8")
  assert quantization.formats_by_table(None, tables, str) == {}
  assert quantization.formats_by_table("float32", tables, str) == {}
  chosen = quantization.formats_by_table({"user": "int4", "genre": None}, tables, str)
  assert {k: v.name for k, v in chosen.items()} == {"user": "int4"}


@pytest.mark.parametrize(
  "table_dtype,error,message",
  [
    ("int2", ValueError, r"table_dtype='int2': expected one of \['float32', 'float16', "),
    ({"user": "fp8"}, ValueError, r"table_dtype\['user'\]='fp8': expected one of"),
    ({"users": "int8"}, ValueError, r"table_dtype names table 'users', which no TPUEmbedding"),
    (8, TypeError, r"table_dtype=8: expected None, one of"),
  ],
)
def test_bad_table_dtypes_are_refused_naming_the_argument(table_dtype, error, message):
  with pytest.raises(error, match=message):
    quantization.formats_by_table(table_dtype, ["user", "movie"], str)
