"""Managed ids under ParameterServerStrategy, with real ps and worker processes on loopback.

One `LocalCluster` (2 ps, 2 workers, each its own process) serves the module, and one of 1 ps
and 1 worker the restores across ps counts; each has its coordinator in a subprocess
(`tests/jobs/sharded_managed_job.py`), the small cluster's started and run while the other's runs.
The
table is cut into 2 row blocks and the map split with them by key hash, each shard giving rows
of its own block: every expectation is worked out here from the batches, each shard against the
plain-Python reference map fed that shard's part of the stream.
"""

import collections
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import sharded_managed_job as job_lib
import tensorflow as tf

import loopback
from child_process import run_python
from managed_ids_reference import ReferenceMap

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

JOB = pathlib.Path(__file__).parents[1] / "jobs" / "sharded_managed_job.py"
PS_TASKS = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(2)]


def _argv(cluster, phase: str, out) -> list[str]:
  return cluster.command([sys.executable, str(JOB), phase, json.dumps(cluster.spec), str(out)])


def _failed(process, errors) -> str:
  errors.seek(0)
  return f"{process.args[-3]} ({process.returncode}): {errors.read()[-3000:]}"


def _wait_for(path: pathlib.Path, process, errors, timeout: float = 400) -> None:
  """Until `process` has written `path`; fails the test if it exits or runs out of time first."""
  deadline = time.monotonic() + timeout
  while not path.exists():
    assert process.poll() is None, _failed(process, errors)
    assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
    time.sleep(0.2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharded_managed")
  with (
    loopback.cluster(num_ps=2, num_workers=2) as cluster,
    tempfile.TemporaryFile("w+") as errors,
    subprocess.Popen(
      _argv(cluster, "two_ps_cluster", out), stdin=subprocess.PIPE, stderr=errors, text=True
    ) as main,
  ):
    try:
      with loopback.cluster(num_ps=1, num_workers=1) as one:
        _wait_for(out / job_lib.SEQUENTIAL_DONE, main, errors)  # `ckpt` written under 2 ps
        result = subprocess.run(
          _argv(one, "one_ps", out), capture_output=True, text=True, timeout=400
        )
        assert result.returncode == 0, result.stderr[-3000:]
      main.stdin.write("ckpt_one_ps written\n")
      main.stdin.close()
      main.wait(timeout=400)
      assert main.returncode == 0, _failed(main, errors)
    finally:
      if main.poll() is None:
        main.kill()
  return out


def _load(directory: pathlib.Path, name: str) -> dict:
  with np.load(directory / name) as arrays:
    return dict(arrays)


def shard_of(keys) -> list[int]:
  """The documented rule: FarmHash64 of the key's decimal string, modulo the shards."""
  return tf.strings.to_hash_bucket_fast([str(k) for k in keys], 2).numpy().tolist()


def row_ranges(capacity: int) -> list[range]:
  """The table's 2 row blocks (the first one row longer when odd), row 0 left out."""
  middle = (capacity + 1) // 2
  return [range(1, middle), range(middle, capacity)]


def assert_placed_with_rows(out: dict, tasks: list[str]) -> None:
  """Shard k's state, hash table and steps live on the ps task of the table's block k; the
  blocks on `tasks` (PSS deals them out round-robin, from whichever task is next)."""
  blocks = out["devices"].tolist()
  assert sorted(blocks) == sorted(tasks)
  for k, task in enumerate(blocks):
    assert set(out[f"shard{k}/devices"].tolist()) == {task}, k


def assert_same_state(got: dict, want: dict) -> None:
  """The same map, shards and table (wherever they are placed)."""
  assert sorted(got) == sorted(want)
  for name in want:
    if not name.endswith("devices"):
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_concurrent_workers_never_give_a_key_two_rows_or_a_row_two_keys(results):
  out = _load(results, "concurrent.npz")
  occurrences = collections.Counter()
  for i in range(job_lib.STEPS):
    occurrences.update(job_lib.concurrent_batch(i).tolist())
  keys, rows = out["keys"].tolist(), out["rows"].tolist()
  assert len(set(keys)) == len(keys) == len(occurrences)  # each key once: one row per key
  assert len(set(rows)) == len(rows) and 0 not in rows  # each row once: one key per row
  row_of = dict(zip(keys, rows))
  assert set(row_of) == set(occurrences)
  universe = job_lib.universe().tolist()
  assert out["lookup"].tolist() == [row_of[k] for k in universe]
  assert out["size"] == len(keys)
  # Counts: every occurrence counted once (a lost or doubled step of a shard shows here).
  assert dict(zip(keys, out["counts"].tolist())) == dict(occurrences)
  # The table: each occurrence subtracted 0.5 from its key's row; no other row was touched.
  expected = np.full_like(out["table"], job_lib.INITIAL)
  for key, count in occurrences.items():
    expected[row_of[key]] -= 0.5 * count
  np.testing.assert_array_equal(out["table"], expected)
  # Shard k holds exactly its keys, on the first rows of its own block, on the block's ps task.
  assert_placed_with_rows(out, PS_TASKS)
  owner = dict(zip(universe, shard_of(universe)))
  for k, span in enumerate(row_ranges(job_lib.CONCURRENT_CAPACITY)):
    mine = [key for key in universe if owner[key] == k]
    assert sorted(out[f"shard{k}/keys"].tolist()) == sorted(mine)
    assert sorted(row_of[key] for key in mine) == list(span[: len(mine)])
    assert out[f"shard{k}/rows"].tolist() == list(range(1, len(mine) + 1))  # local rows


def _reference_run(steps: int = job_lib.SEQUENCE):
  """Each shard's reference map fed its part of the first `steps` steps, and the table those
  rows give."""
  spans = row_ranges(job_lib.SEQUENCE_CAPACITY)
  spec = job_lib.SEQUENCE_SPEC
  maps = [
    ReferenceMap(
      len(span) + 1, spec["eviction"], spec["min_count"], half_life=spec["lfu_half_life_steps"]
    )
    for span in spans
  ]
  table = np.full([job_lib.SEQUENCE_CAPACITY, 2], job_lib.INITIAL, np.float32)
  for batch in job_lib.sequence_batches()[:steps]:
    batch = batch.tolist()
    owner = shard_of(batch)
    rows = [0] * len(batch)
    for k, (reference, span) in enumerate(zip(maps, spans)):
      positions = [i for i, o in enumerate(owner) if o == k]
      local, fresh = reference.train([batch[i] for i in positions])
      for i, row in zip(positions, local):
        rows[i] = row + span.start - 1 if row else 0
      for row in fresh:
        table[row + span.start - 1] = job_lib.INITIAL  # reset before the step reads it
    for row in rows:
      table[row] -= 0.5
  return maps, spans, table


@pytest.mark.parametrize(
  "name, steps",
  [
    ("sequential.npz", job_lib.SEQUENCE),
    ("remapped.npz", job_lib.SEQUENCE),  # layer.remap on the coordinator, steps on rows
    ("continued.npz", job_lib.SEQUENCE + job_lib.MORE),  # restored under 1 ps, trained on
  ],
)
def test_sequential_steps_give_each_shard_the_reference_map_and_reset_rows(results, name, steps):
  out = _load(results, name)
  maps, spans, table = _reference_run(steps)
  for k, (reference, span) in enumerate(zip(maps, spans)):
    keys, rows, counts = reference.export()
    assert out[f"shard{k}/keys"].tolist() == keys, k
    assert out[f"shard{k}/rows"].tolist() == rows, k
    assert out[f"shard{k}/counts"].tolist() == counts, k
  assert out["rows"].tolist() == [
    r + s.start - 1 for m, s in zip(maps, spans) for r in m.export()[1]
  ]
  assert len(maps[0].export()[0]) == len(spans[0])  # a shard full: eviction happened
  np.testing.assert_array_equal(out["table"], table)


def test_checkpoint_restores_the_sharded_map_and_refuses_other_layouts(results):
  trained, restored = _load(results, "sequential.npz"), _load(results, "restored.npz")
  assert_same_state(restored, trained)
  assert_placed_with_rows(restored, PS_TASKS)
  with open(results / "refused.json") as f:
    refused = json.load(f)
  assert (
    "table 't' manages its ids, but the checkpoint holds no managed-id map" in (refused["message"])
  )
  assert refused["unchanged"]
  assert (
    "table 't': its managed-id map is whole (no parameter servers) in this layer but split into "
    "2 row blocks in the checkpoint"
  ) in refused["whole_message"]
  assert refused["whole_unchanged"]


def test_a_checkpoint_restores_under_another_number_of_ps_tasks(results):
  # 2 ps -> 1 ps: both blocks, and both map shards with them, on the one ps; same keys, same
  # rows, same table (hence the same embeddings), and training goes on as the reference does
  # (`continued.npz` in the parametrized test above).
  one = _load(results, "restored_one_ps.npz")
  assert_same_state(one, _load(results, "sequential.npz"))
  assert_placed_with_rows(one, PS_TASKS[:1] * 2)
  # 1 ps -> 2 ps: each shard back beside its block, on its own ps task.
  two = _load(results, "restored_two_ps.npz")
  assert_same_state(two, _load(results, "continued.npz"))
  assert_placed_with_rows(two, PS_TASKS)


def test_a_map_is_split_with_the_table_blocks_not_the_ps_tasks(results):
  # 3 blocks on 2 ps tasks: 3 shards, each beside its block (two of them on one task).
  out = _load(results, "three_blocks.npz")
  assert_placed_with_rows(out, [PS_TASKS[0], PS_TASKS[0], PS_TASKS[1]])
  assert "shard3/devices" not in out
  # PSS cuts 13 rows into 5 | 4 | 4; shard 0 leaves row 0 out; each shard's local row 0 added.
  assert [int(out[f"shard{k}/capacity"]) for k in range(3)] == [5, 5, 5]


def test_a_checkpoint_is_refused_where_the_table_is_cut_into_other_blocks(results):
  with open(results / "refused_3.json") as f:
    refused = json.load(f)
  assert (
    "table 't': its managed-id map is split into 3 parts in this layer but 2 in the checkpoint"
  ) in refused["message"]
  assert "FixedShardsPartitioner(2)" in refused["message"]
  assert "Nothing was changed" in refused["message"]
  assert refused["unchanged"]


_SERVE = """
import json
import tensorflow as tf
loaded = tf.saved_model.load({path!r})
out = loaded.signatures["serving_default"](keys=tf.constant({probe!r}, tf.int64))
print(json.dumps(list(out.values())[0].numpy().tolist()))
"""


def test_the_export_serves_raw_keys_through_the_sharded_map(results):
  maps, spans, table = _reference_run()
  known = [
    (key, row + s.start - 1) for m, s in zip(maps, spans) for key, row in zip(*m.export()[:2])
  ]
  probe = [key for key, _ in known] + [123456789, -5]  # two keys never seen: row 0
  expected = table[[row for _, row in known] + [0, 0]]
  out = run_python(_SERVE.format(path=str(results / "export"), probe=probe), timeout=300)
  np.testing.assert_allclose(json.loads(out.splitlines()[-1]), expected, rtol=1e-6)


def _keras_reference():
  """(table, accumulator) before and after the remap of `keras_trained`, and the rows that remap
  gave: each shard's reference map fed its part of the stream, a given row reset to the
  initializer and the initial accumulator, then tf-keras Adagrad on the step's summed gradient
  (each occurrence adds 1 to its row's gradient)."""
  spans = row_ranges(job_lib.SEQUENCE_CAPACITY)
  maps = [ReferenceMap(len(span) + 1, "lru") for span in spans]
  table = np.full([job_lib.SEQUENCE_CAPACITY, 2], job_lib.INITIAL, np.float32)
  accumulator = np.full_like(table, job_lib.KERAS_ACCUMULATOR)

  def remap(batch):
    batch, rows, given = batch.tolist(), [0] * len(batch), []
    owner = shard_of(batch)
    for k, (reference, span) in enumerate(zip(maps, spans)):
      positions = [i for i, o in enumerate(owner) if o == k]
      local, fresh = reference.train([batch[i] for i in positions])
      for i, row in zip(positions, local):
        rows[i] = row + span.start - 1 if row else 0
      given += [row + span.start - 1 for row in fresh]
    table[given], accumulator[given] = job_lib.INITIAL, job_lib.KERAS_ACCUMULATOR
    return rows, sorted(given)

  *steps, new_keys = job_lib.keras_batches()
  for batch in steps:
    rows, _ = remap(batch)
    gradient = np.bincount(rows, minlength=len(table)).astype(np.float32)[:, None] * np.ones(2)
    touched = gradient[:, 0] > 0
    accumulator[touched] += np.square(gradient[touched])
    table[touched] -= (
      np.float32(job_lib.KERAS_LEARNING_RATE)
      * gradient[touched]
      / np.sqrt(accumulator[touched] + np.float32(1e-7))
    )
  before = table.copy(), accumulator.copy()
  _, given = remap(new_keys)
  return before, (table, accumulator), given


def test_keras_trained_rows_given_to_new_keys_are_reset_with_their_slots_on_their_ps(results):
  """table_updates="keras" with a tf-keras Adagrad: the remap's rows, trained before, read the
  initializer again and their accumulator rows its initial value; nothing else changed; each
  block of the table and of the accumulator, and the map shard giving its rows, on one ps."""
  before, after = _load(results, "keras_before.npz"), _load(results, "keras_after.npz")
  want_before, want_after, given = _keras_reference()
  assert {row < len(row_ranges(job_lib.SEQUENCE_CAPACITY)[0]) + 1 for row in given} == {
    True,
    False,
  }  # both blocks gave rows
  assert all(want_before[1][row, 0] > job_lib.KERAS_ACCUMULATOR for row in given)  # trained
  for got, want in ((before, want_before), (after, want_after)):
    np.testing.assert_allclose(got["table"], want[0], rtol=1e-5)
    np.testing.assert_allclose(got["accumulator"], want[1], rtol=1e-5)
  changed = np.flatnonzero((before["table"] != after["table"]).any(axis=1)).tolist()
  assert changed == given
  for state in (before, after):
    blocks = state["table_devices"].tolist()
    assert sorted(blocks) == PS_TASKS
    assert state["slot_devices"].tolist() == blocks
    assert state["shard_devices"].tolist() == blocks


def test_a_keras3_optimizer_training_a_managed_table_under_parameter_servers_is_refused(results):
  with open(results / "keras3_refused.json") as f:
    message = json.load(f)["message"]
  assert "Layer 'tpu_embedding': the managed tables ['t'] are trained by the Keras 3" in message
  assert "ParameterServerStrategy" in message
  assert "Use a tf_keras.optimizers" in message


def test_a_refused_keras3_optimizer_creates_nothing_on_the_ps_tasks(results):
  with open(results / "keras3_refused.json") as f:
    refused = json.load(f)
  assert "trained by the Keras 3" in refused["message"]
  assert refused["created"] == []  # neither the table's blocks nor the map's shards


def test_a_second_cluster_in_the_same_process_trains_a_managed_layer(results):
  """The layer's step functions are made anew for a strategy on another cluster (the first
  cluster's, unknown to its tasks, failed its steps before): one step of 12 new keys, each
  given a row as the reference map gives it and trained once by SGD(0.5)."""
  out = _load(results, "second_cluster.npz")
  batch = job_lib.keras_batches()[0].tolist()
  reference = ReferenceMap(job_lib.SEQUENCE_CAPACITY, "lru")
  rows, _ = reference.train(batch)
  keys, want_rows, _ = reference.export()
  assert out["keys"].tolist() == keys
  assert out["rows"].tolist() == want_rows
  table = np.full([job_lib.SEQUENCE_CAPACITY, 2], job_lib.INITIAL, np.float32)
  np.subtract.at(table, rows, 0.5)
  np.testing.assert_array_equal(out["table"], table)
