"""benchmarks/int8_stacked_tables.py's stacked lookup: one gather and one decode of two tables'
fused rows gives each table's rows, bit for bit FBGEMM's q * scale + bias as the shipped per-table
decode gives them."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from benchmarks import int8_stacked_tables as stacked


def _reference(values: np.ndarray) -> np.ndarray:
  low = values.min(1, keepdims=True)
  step = (values.max(1, keepdims=True) - low) / np.float32(255)
  with np.errstate(invalid="ignore", divide="ignore"):
    q = np.where(step > 0, np.rint((values - low) / step), 0).astype(np.float32)
  return q * step + low


def test_stacked_lookup_gives_each_tables_rows_bit_for_bit():
  rng = np.random.default_rng(3)
  tables = [
    (rng.normal(size=(n, stacked.DIM)) * rng.uniform(0.1, 4, (n, 1))).astype(np.float32)
    for n in (40, 9)
  ]
  tables[1][2] = -1.5  # a constant row reads back exactly
  fused = tf.Variable(tf.concat([stacked.INT8.encode(tf.constant(t))["rows"] for t in tables], 0))
  ids = [tf.constant([0, 39, 5, 5], tf.int64), tf.constant([2, 8, 0], tf.int64)]
  got = stacked.stacked_lookup(fused, 40, ids)
  for table, rows, i in zip(tables, got, ids):
    np.testing.assert_array_equal(
      rows.numpy().view(np.int32), _reference(table)[i.numpy()].view(np.int32)
    )
  np.testing.assert_array_equal(got[1].numpy()[0], np.full(stacked.DIM, -1.5, np.float32))


def test_the_three_lookups_agree():
  rng = np.random.default_rng(0)
  tables = [rng.normal(size=(n, stacked.DIM)).astype(np.float32) for n in (30, 12)]
  functions = stacked.lookups(tables)
  ids = [tf.constant([1, 29, 1], tf.int64), tf.constant([11, 0], tf.int64)]
  per_table, stacked_rows = functions["int8_per_table"](*ids), functions["int8_stacked"](*ids)
  for a, b, f, t, i in zip(per_table, stacked_rows, functions["float32"](*ids), tables, ids):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(f.numpy(), t[i.numpy()])
    np.testing.assert_allclose(b.numpy(), t[i.numpy()], atol=(t.max() - t.min()) / 510 + 1e-6)
