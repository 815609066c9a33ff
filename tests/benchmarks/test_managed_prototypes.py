"""The prototype map of benchmarks/managed_prototypes.py, stepped by hand."""

import numpy as np
import pytest

from benchmarks.managed_prototypes import AdaptiveMap, PrototypeMap

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


def test_adaptive_switches_to_the_decay_whose_victims_did_not_come_back():
  m = AdaptiveMap(3, 0.0, 2.0, 10, False)  # long memory: the count alone; short: count / distance^2
  plain = PrototypeMap(3, False, 0.0, False)
  for keys in ([A, A, A], [B], [C, C]):
    m.train(np.array(keys))
    plain.train(np.array(keys))
  # Step 3: C (2) evicts B (count 1 < A's 3); short memory would have evicted A (3 / 2^2 = 0.75
  # against B's 1 / 1): B is long memory's ghost, A short memory's.
  assert m.row_of == {A: 1, C: 2} and m.ghosts == ({B: (3, 1)}, {A: (3, 1)})
  # Step 4: B is back, a miss of long memory (1 to 0): decay 2. A's row scores 3 / 3^2 = 0.33,
  # C's 2 / 1^2 = 2: B (1) takes A's row 1; the plain LFU map keeps A (3) and C (2).
  assert m.train(np.array([B]))[0].tolist() == [1]
  assert plain.train(np.array([B]))[0].tolist() == [0]
  assert m.ghosts == ({C: (4, 1)}, {A: (4, 1)})
  # Step 5: A is back, short memory's miss: 1 to 1, a tie keeps decay 2. C's row 2 scores
  # 2 / 2^2 = 0.5 below B's 1 / 1: A (1) takes it; long memory would have evicted B (1 < 2).
  # C stays long memory's ghost of step 4 (until it comes back or 10 steps pass).
  assert m.train(np.array([A]))[0].tolist() == [2]
  assert m.choices == [0.0, 0.0, 0.0, 2.0, 2.0]
  assert m.ghosts == ({C: (4, 1), B: (5, 1)}, {C: (5, 1)})


def test_adaptive_weighs_misses_by_the_ghosts_count():
  m = AdaptiveMap(3, 0.0, 2.0, 10, True)
  for keys in ([A, A, A], [B], [C, C], [B]):  # as above: decay 2 at step 4, B takes A's row
    m.train(np.array(keys))
  # Long memory's ghost C held count 2, short memory's A count 3 (step 3's B weighed 1).
  assert m.ghosts == ({C: (4, 2)}, {A: (4, 3)})
  # Step 5: A is back, short memory's miss weighs 3 against long memory's 1: decay 0. A (1) does
  # not beat B's count 1, so no row changes and no ghost is added.
  assert m.train(np.array([A]))[0].tolist() == [0]
  assert m.choices == [0.0, 0.0, 0.0, 2.0, 0.0]
  assert m.ghosts == ({C: (4, 2)}, {})
