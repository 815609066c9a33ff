"""TorchRec's managed-collision module run on a tiny stream in its own environment (`make
torchrec-env`, or TORCHREC_PYTHON), checked against what its rows must satisfy, computed here from
the keys and the rows alone; and the map from its output ids to our rows."""

import numpy as np
import pytest

from benchmarks import torchrec_mch

CAPACITY = 8
CONFIGS = [(policy, interval) for policy in torchrec_mch.POLICIES for interval in (1, 3)]
needs_torchrec = pytest.mark.skipif(
  torchrec_mch.torchrec_python() is None,
  reason="no TorchRec environment (make torchrec-env, or set TORCHREC_PYTHON)",
)


def test_rows_of_puts_torchrec_default_slot_on_our_row_zero():
  ids = np.arange(CAPACITY)
  rows = torchrec_mch.rows_of(ids, CAPACITY)
  assert rows[-1] == 0 and list(rows[:-1]) == list(range(1, CAPACITY))
  assert sorted(rows) == list(range(CAPACITY))  # a bijection: the table holds every choice


@pytest.fixture(scope="module")
def chosen():
  rng = np.random.default_rng(3)
  # Hot keys (seen every step) among a tail of 40 keys, as negative and positive 64-bit values.
  hot = np.array([-(2**62) - 7, 5, 2**61 + 1], np.int64)
  train = [np.concatenate([hot, hot, rng.integers(-20, 20, size=10)]) for _ in range(9)]
  for batch in train:
    rng.shuffle(batch)
  test = np.concatenate([hot, np.arange(-20, 20)])
  streams = {"t": torchrec_mch.Stream(CAPACITY, train, test)}
  result, info = torchrec_mch.remap(streams, CONFIGS)
  return train, test, result["t"], info


@pytest.mark.integration
@needs_torchrec
@pytest.mark.parametrize("config", CONFIGS)
def test_torchrec_rows_are_a_map_within_capacity(chosen, config):
  train, test, result, _ = chosen
  got = result[config]
  assert [len(ids) for ids in got.ids] == [len(b) for b in train]
  held, seen = {}, {}  # key -> the row it held when last seen, the step it was last seen
  for step, (keys, ids) in enumerate(zip(train, got.ids)):
    assert ids.min() >= 0 and ids.max() < CAPACITY
    pairs = set(zip(keys.tolist(), ids.tolist()))
    assert len(pairs) == len(set(keys.tolist())), f"a key read two rows at step {step}"
    own = {(k, r) for k, r in pairs if r != CAPACITY - 1}
    assert len({r for _, r in own}) == len(own), f"two keys shared a row at step {step}"
    # A key holding a row it did not hold when last seen took it at an eviction since then.
    for k, r in own:
      if held.get(k) != r:
        since = got.evicted[seen.get(k, -1) + 1 : step + 1]
        assert any(r in e for e in since), (step, k, r)
    for k in set(keys.tolist()):
      held[k], seen[k] = dict(own).get(k), step
  if config[1] == 1:  # the last batch's rows are the map's rows for held-out lookups
    lookup = dict(zip(test.tolist(), got.test_ids.tolist()))
    assert all(lookup[k] == r for k, r in pairs if r != CAPACITY - 1)
  assert got.test_ids.max() < CAPACITY and len(got.seconds) == len(train)


@pytest.mark.integration
@needs_torchrec
@pytest.mark.parametrize("policy", torchrec_mch.POLICIES)
def test_torchrec_gives_keys_rows_only_at_its_interval(chosen, policy):
  train, _, result, info = chosen
  assert info["versions"]["torchrec"] and info["threads"] == 1
  every_step, every_third = result[(policy, 1)], result[(policy, 3)]
  # At interval 1 the first step's keys get rows at once (the table is empty); at interval 3
  # every key reads the default slot until the third step's eviction.
  assert (every_step.ids[0] != CAPACITY - 1).any()
  assert all((ids == CAPACITY - 1).all() for ids in every_third.ids[:2])
  assert (every_third.ids[2] != CAPACITY - 1).any()
  assert len(every_third.evicted[2]) > 0
  assert all(len(e) == 0 for step, e in enumerate(every_third.evicted) if step % 3 != 2)
