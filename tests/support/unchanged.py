"""Helpers for tests that a refused step wrote nothing: every variable compared value by value."""

import numpy as np


def snapshot(model) -> dict:
  """Every variable of `model` (tables, slots, dense weights), as NumPy arrays by name."""
  return {v.name: v.numpy() for v in model.variables}


def assert_unchanged(before: dict, model) -> None:
  """`model` holds the same variables as `before` (a `snapshot`), with the same values."""
  after = snapshot(model)
  assert sorted(after) == sorted(before)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
