"""MultiWorkerMirroredStrategy for real: two worker processes on 127.0.0.1 (in a network of
their own where one can be made).

Each worker sees half of every global batch; the engine must sum both halves into one update,
so the tables equal a single-process run on the same global batches.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import loopback

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

# Each process trains the plain table, then the managed-ids one (each worker remaps the global
# batch with its own copy of the map: tests/jobs/multiworker_managed_job.py), under one strategy.
JOB = pathlib.Path(__file__).parent / "jobs" / "multiworker_job.py"


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  env.update(extra)
  return env


@pytest.mark.integration
def test_two_workers_on_loopback_equal_one_process(tmp_path):
  for run in ("worker0", "worker1", "single"):
    (tmp_path / run).mkdir()
  with loopback.network() as network:
    workers = [f"127.0.0.1:{p}" for p in loopback.free_ports(2)]
    processes = []
    for index in range(2):
      config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
      processes.append(
        subprocess.Popen(
          network.command([sys.executable, str(JOB), str(tmp_path / f"worker{index}")]),
          env=_env(TF_CONFIG=json.dumps(config)),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
        )
      )
    single = subprocess.run(
      [sys.executable, str(JOB), str(tmp_path / "single")],
      env=_env(),
      capture_output=True,
      text=True,
      timeout=400,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    for process in processes:
      output, _ = process.communicate(timeout=400)
      assert process.returncode == 0, output[-3000:]
  for name in ("plain.npy", "managed_ids.npy", "managed_raw_keys.npy"):
    reference = np.load(tmp_path / "single" / name)
    for index in range(2):
      np.testing.assert_allclose(
        np.load(tmp_path / f"worker{index}" / name), reference, rtol=1e-6, atol=1e-7, err_msg=name
      )
