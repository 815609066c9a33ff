"""benchmarks/int8_decode_variants.py's decodes: each (but XLA's, whose rounding depends on the
CPU's fused multiply-add) gives FBGEMM's q * scale + bias in float32, bit for bit, as the shipped
decode does; the patch is undone after each test."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import int8_decode_variants as variants
from tpu_embedding import quantization

BIT_IDENTICAL = [v for v in variants.VARIANTS if v != "xla"]


@pytest.fixture
def restored(monkeypatch):
  for attribute in ("encode", "decode", "stored"):
    monkeypatch.setattr(quantization.Rowwise, attribute, getattr(quantization.Rowwise, attribute))


@pytest.mark.parametrize("dim", [32, 7])
@pytest.mark.parametrize("variant", BIT_IDENTICAL)
def test_variant_gathers_the_reference_rows_bit_for_bit(restored, variant, dim):
  rng = np.random.default_rng(dim)
  values = (rng.normal(size=(50, dim)) * rng.uniform(0.01, 3, (50, 1))).astype(np.float32)
  values[3] = 0.25  # a constant row: scale 0, read back exactly
  low = values.min(1, keepdims=True)
  step = (values.max(1, keepdims=True) - low) / np.float32(255)
  with np.errstate(invalid="ignore", divide="ignore"):
    q = np.where(step > 0, np.rint((values - low) / step), 0).astype(np.float32)
  expected = q * step + low
  variants.use_variant(variant)
  table = quantization.LowPrecisionTable("t", values, quantization.FORMATS["int8"])
  ids = tf.constant([3, 0, 49, 7, 7, 21], tf.int64)
  got = table.gather(ids).numpy()
  np.testing.assert_array_equal(got.view(np.int32), expected[ids.numpy()].view(np.int32))
  np.testing.assert_array_equal(table().numpy().view(np.int32), expected.view(np.int32))
  assert list(table.parts) == (["codes", "scale_bias"] if variant == "separate" else ["rows"])
