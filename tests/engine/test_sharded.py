"""Tables row-sharded over parameter servers, with real ps and worker processes on loopback.

One `LocalCluster` (3 ps, 2 workers, each its own process) serves the module; the coordinator runs
in a subprocess (`tests/jobs/sharded_job.py`) in the cluster's network, since connecting to a
cluster changes
TensorFlow's global context. Its steps are built so that the result does not depend on the order in
which the workers run them (see the job's docstring), so the sharded tables must equal a
single-process run of the same steps: exactly for SGD and Adagrad, to float32 rounding for the
others. Two workers update the same rows all along, so a lost update shows as a difference.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.engine import sharded

import loopback
import sharded_job

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

JOB = pathlib.Path(__file__).parents[1] / "jobs" / "sharded_job.py"


@pytest.fixture(scope="module")
def cluster():
  with loopback.cluster(num_ps=3, num_workers=2) as running:
    yield running


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
  """Runs a phase of the job against the cluster; returns its output directory."""
  out = tmp_path_factory.mktemp("sharded")

  def run(phase: str, *extra: str) -> pathlib.Path:
    result = subprocess.run(
      cluster.command(
        [sys.executable, str(JOB), phase, json.dumps(cluster.spec), str(out), *extra]
      ),
      capture_output=True,
      text=True,
      timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out

  return run


@pytest.fixture(scope="module")
def trained(cluster, job):
  """The phases of the 2-shard strategy, in one process: `train`, `hammer`, then `worker_fault`
  (the cluster's worker 1 is killed there, and restarted here afterwards)."""
  try:
    return job("two_shards", str(cluster.process("worker", 1).pid))
  finally:
    loopback.restart(cluster, "worker", 1)


def _load(directory: pathlib.Path, name: str) -> dict:
  with np.load(directory / name) as arrays:
    return dict(arrays)


def test_sgd_and_adagrad_equal_a_single_process_run_exactly(trained):
  sharded = _load(trained, "sharded.npz")
  reference = _load(trained, "reference.npz")
  for name in ("sgd/parameters", "adagrad/parameters", "adagrad/accumulators"):
    np.testing.assert_array_equal(sharded[name], reference[name], err_msg=name)
  # By hand: every step touching a row subtracts lr 0.5 x loss weight 1 from it.
  touches = np.zeros(sharded_job.VOCABULARY)
  for step in range(sharded_job.STEPS):
    touches[sharded_job.BATCHES[step % len(sharded_job.BATCHES)]] += 1
  initial = np.arange(sharded_job.VOCABULARY * 2).reshape(-1, 2) / 8.0
  np.testing.assert_array_equal(sharded["sgd/parameters"], initial - 0.5 * touches[:, None])
  # Adagrad's accumulators add the squared gradient (loss weight 2) once per touch.
  np.testing.assert_array_equal(
    sharded["adagrad/accumulators"], np.repeat(1.0 + 4.0 * touches[:, None], 2, axis=1)
  )


def test_no_update_is_lost_for_any_optimizer(trained):
  sharded = _load(trained, "sharded.npz")
  reference = _load(trained, "reference.npz")
  assert sorted(sharded) == sorted(reference)
  for name in sharded:
    np.testing.assert_allclose(sharded[name], reference[name], rtol=2e-6, atol=1e-6, err_msg=name)


def test_rows_are_read_and_written_on_the_ps_tasks_under_their_locks(trained):
  placement = _load(trained, "placement.npz")
  ops, devices = placement["ops"], placement["devices"]
  on_ps = lambda op: {d.split("/device")[0] for o, d in zip(ops, devices) if o == op}
  ps_tasks = {f"/job:ps/replica:0/task:{i}" for i in range(3)}
  # Each of the 5 tables has 2 shards, spread round-robin over the 3 ps tasks.
  assert on_ps("ResourceGather") == ps_tasks
  assert on_ps("ResourceScatterUpdate") == ps_tasks
  assert on_ps("MutexLock") == ps_tasks
  assert list(ops).count("MutexLock") == 5 * 2


def test_whole_tables_on_several_ps_tasks_keep_their_slots_beside_them(job, trained):
  out = job("whole")
  with open(out / "whole_devices.json") as f:
    devices = json.load(f)
  for table in sharded_job.OPTIMIZERS:
    table_device = devices[f"{table}/parameters"]
    assert all(d == table_device for n, d in devices.items() if n.startswith(f"{table}/")), devices
  assert len(set(devices.values())) > 1  # the tables are spread over the ps tasks
  whole = _load(out, "whole.npz")
  reference = _load(trained, "reference.npz")
  for name in reference:
    np.testing.assert_allclose(whole[name], reference[name], rtol=2e-6, atol=1e-6, err_msg=name)


def test_checkpoints_move_between_shard_counts_and_unsharded_layers(job, trained):
  out = job("restore")
  trained_state = _load(out, "sharded.npz")
  restored = _load(out, "restored_3.npz")
  assert sorted(restored) == sorted(trained_state)
  for name in trained_state:  # 2 shards -> 3 shards, slots included
    np.testing.assert_array_equal(restored[name], trained_state[name], err_msg=name)
  # 3 shards, trained further -> an unsharded layer -> its serving export
  trained_3 = _load(out, "trained_3.npz")
  assert not np.array_equal(trained_3["sgd/parameters"], trained_state["sgd/parameters"])
  unsharded = _load(out, "unsharded.npz")
  assert sorted(unsharded) == sorted(trained_3)
  for name, value in trained_3.items():
    np.testing.assert_array_equal(unsharded[name], value, err_msg=name)
  for table, value in _load(out, "exported.npz").items():
    np.testing.assert_array_equal(value, trained_3[f"{table}/parameters"], err_msg=table)
  # the unsharded layer, trained further -> 3 shards again
  unsharded_trained = _load(out, "unsharded_trained.npz")
  assert not np.array_equal(unsharded_trained["adam/momenta"], trained_3["adam/momenta"])
  back = _load(out, "back.npz")
  for name, value in unsharded_trained.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_two_workers_updating_every_row_at_once_lose_no_update(trained):
  # Without the shard locks, this loses about a quarter of the steps (seen: -13 and -11.5).
  np.testing.assert_array_equal(
    np.load(trained / "hammer.npy"),
    np.full([sharded_job.HAMMER_ROWS, 8], -0.5 * sharded_job.HAMMER_STEPS, np.float32),
  )


def test_a_killed_worker_is_replaced_by_the_other_and_no_step_is_lost(trained):
  # The cluster's worker 1 was killed after the first steps of this run (`trained`).
  survived = _load(trained, "worker_fault.npz")
  reference = _load(trained, "reference.npz")
  for name in ("sgd/parameters", "adagrad/accumulators"):
    np.testing.assert_array_equal(survived[name], reference[name], err_msg=name)


def test_a_killed_ps_fails_the_job_and_a_restart_resumes_from_the_checkpoint(cluster, job, trained):
  # Last in this module: ps 0 is killed here and restarted (empty) for the resumed job.
  try:
    out = job("ps_fault", str(cluster.process("ps", 0).pid))
  finally:
    loopback.restart(cluster, "ps", 0)
  with open(out / "ps_fault.json") as f:
    error = json.load(f)
  assert error is not None, "steps went on without a ps task"
  assert error["type"] == "UnavailableError", error
  assert "/job:ps/replica:0/task:0" in error["message"], error
  resumed = _load(job("resume"), "resumed.npz")
  reference = _load(trained, "reference.npz")
  for name in ("sgd/parameters", "adagrad/accumulators"):
    np.testing.assert_array_equal(resumed[name], reference[name], err_msg=name)


def test_in_block_gives_the_row_block_and_the_rows_counted_from_its_first_row():
  blocks = [tf.Variable(tf.zeros([n, 2])) for n in (3, 2, 4)]  # rows [0, 3), [3, 5), [5, 9)
  table = tf_internals.ShardedVariable(blocks)
  block, rows = sharded.in_block(table, tf.constant([5, 8, 6], tf.int64), 2)
  assert block is blocks[2]
  np.testing.assert_array_equal(rows.numpy(), [0, 3, 1])
  block, rows = sharded.in_block(table, tf.constant([4, 3], tf.int64), 1)
  assert block is blocks[1]
  np.testing.assert_array_equal(rows.numpy(), [1, 0])
  whole = tf.Variable(tf.zeros([4, 2]))  # a whole table: itself, rows as they are
  block, rows = sharded.in_block(whole, tf.constant([3, 1], tf.int64), None)
  assert block is whole
  np.testing.assert_array_equal(rows.numpy(), [3, 1])
