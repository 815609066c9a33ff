"""The prototype map of benchmarks/managed_prototypes.py, stepped by hand."""

import numpy as np
import pytest

from benchmarks.managed_prototypes import PrototypeMap

A, B, C, D = 11, 22, 33, 44


def _steps(symmetric):
  m = PrototypeMap(3, symmetric, 1.0, False)  # rows 1 and 2 for keys
  out = [m.train(np.array(keys)) for keys in ([A, B, B, B], [C], [D])]
  for _ in range(6):  # steps 4-9
    m.train(np.array([D]))
  return m, out, m.train(np.array([C]))  # step 10


@pytest.mark.parametrize("symmetric", [False, True])
def test_first_steps(symmetric):
  m, out, _ = _steps(symmetric)
  (rows1, given1), (rows2, given2), (rows3, given3) = out
  assert rows1.tolist() == [1, 2, 2, 2] and given1.tolist() == [1, 2]
  # C (count 1) ties A's 1 / 1 and B's 3 / 1 at best: the rows keep their keys.
  assert rows2.tolist() == [0] and given2.tolist() == []
  # D, never seen, competes with its count 1 > A's 1 / 2: A's row 1.
  assert rows3.tolist() == [1] and given3.tolist() == [1]
  assert m.count[1] == 7 and m.last[1] == 9


def test_newcomer_seen_before_competes_with_count_over_its_gap():
  # Step 10: C's count 2 (1 at step 2, 1 now); B's row scores 3 / (10 - 1) = 0.33.
  _, _, (rows, given) = _steps(symmetric=False)
  assert rows.tolist() == [2] and given.tolist() == [2]  # 2 > 0.33
  _, _, (rows, given) = _steps(symmetric=True)
  assert rows.tolist() == [0] and given.tolist() == []  # 2 / (10 - 2) = 0.25 <= 0.33


@pytest.mark.parametrize("in_gaps, rows", [(False, [2]), (True, [0])])
def test_absence_counted_in_the_rows_own_gaps(in_gaps, rows):
  m = PrototypeMap(3, False, 1.0, in_gaps)
  for keys in ([A, A, B], [A], [A]):
    m.train(np.array(keys))
  # Step 4: B (count 1, row held 4 steps) absent 3 steps: 1 / 3 plainly, but 3 steps are 0.75 of
  # its mean gap (4 / 1), counted as 1: score 1, which C's count 1 does not beat.
  got, _ = m.train(np.array([C]))
  assert got.tolist() == rows
