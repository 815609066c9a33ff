"""The launcher `python -m examples.sharded_dlrm`, run as a user runs it.

While it runs, the socket tables of its processes (`/proc/<pid>/net/tcp{,6}`) say where they
listen: on a machine that allows private networks, nothing an interface other than loopback
reaches. Where none can be made, the launcher must refuse to start unless told to go on.
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import loopback
from child_process import tensorflow_log_lines

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

LAUNCHER = [sys.executable, "-m", "examples.sharded_dlrm"]
SMALL = ["--tables", "1", "--vocabulary", "20000", "--batch", "32", "--steps", "3"]
PRIVATE = loopback.private_networks()
# On a machine without private networks the runs below go on exposed, as CI must still pass.
GO_ON = [] if PRIVATE else ["--allow_exposed_ports"]


def _user_env() -> dict:
  """The environment of a user who set no TensorFlow log level (the tests' own is quiet)."""
  return {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}


def _run_watching_listeners(command, tmp_path):
  """Runs the launcher; until it ends, records the ports its child processes (tasks,
  coordinator, the private network's holder) listen on and every socket of theirs that an
  interface other than loopback reaches."""
  stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
  listening = {"task": set(), "coordinator": set()}
  reachable = []
  with open(stdout, "w") as out, open(stderr, "w") as err:
    launcher = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=_user_env())
    deadline = time.monotonic() + 300
    while launcher.poll() is None and time.monotonic() < deadline:
      for pid, command_line in loopback.children(launcher.pid).items():
        role = "coordinator" if "--cluster" in command_line else "task"
        try:
          listening[role] |= {listener.port for listener in loopback.listeners(pid)}
          reachable += loopback.reachable_listeners(pid)
        except OSError:  # it ended meanwhile
          pass
      time.sleep(0.2)
    launcher.kill()
    launcher.wait()
  return launcher.returncode, stdout.read_text(), stderr.read_text(), listening, reachable


def test_launcher_trains_checkpoints_and_exports_with_sharded_tables(tmp_path):
  output_dir = tmp_path / "out"
  command = LAUNCHER + ["--ps", "2", "--workers", "2", *SMALL, "--output_dir", str(output_dir)]
  returncode, stdout, stderr, listening, reachable = _run_watching_listeners(
    command + GO_ON, tmp_path
  )
  assert returncode == 0, stderr[-3000:]
  assert "1 tables of 20000 x 16, each in 2 shards" in stdout
  assert "3 steps of 32 examples" in stdout
  # TensorFlow's start-up and runtime messages stay out of the user's terminal.
  assert tensorflow_log_lines(stdout + stderr) == [], stdout + stderr
  task_ports = {int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", stdout)}
  assert len(task_ports) == 4, stdout
  assert task_ports <= listening["task"], listening
  assert listening["coordinator"], "the coordinator's own server was never seen listening"
  if PRIVATE:
    assert reachable == [], reachable
  exported = tf.saved_model.load(str(output_dir / "export"))
  assert exported.embedding_tables["table_0"].shape == (20000, 16)
  predict = exported.signatures["serving_default"]
  out = predict(dense=tf.zeros([2, 13]), cat_0=tf.constant([1, 19999], tf.int64))
  probabilities = next(iter(out.values())).numpy()
  assert probabilities.shape == (2,) and ((probabilities > 0) & (probabilities < 1)).all()


def test_one_ps_and_one_worker_run_and_shut_down_without_grpc_errors(tmp_path):
  # --verbose shows TensorFlow's logging, so errors printed while the cluster stops would show.
  command = LAUNCHER + ["--ps", "1", "--workers", "1", *SMALL, "--output_dir", str(tmp_path)]
  result = subprocess.run(
    command + ["--verbose"] + GO_ON, capture_output=True, text=True, timeout=300, env=_user_env()
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "1 tables of 20000 x 16, each in 1 shard\n" in result.stdout
  assert tensorflow_log_lines(result.stderr), "--verbose hid TensorFlow's messages"
  for error in ("Connection refused", "Failed to remove function remotely"):
    assert error not in result.stderr, result.stderr[-3000:]
  assert tf.saved_model.load(str(tmp_path / "export")).embedding_tables["table_0"].shape == (
    20000,
    16,
  )


@pytest.mark.parametrize(
  "arguments, named",
  [
    (["--ps", "0"], "--ps"),
    (["--workers", "9"], "--workers"),
    (["--ps", "two"], "--ps"),
    (["--steps", "0"], "--steps"),
    (["--cluster", '{"ps": ["h:1"]}'], "--cluster"),
    (["--cluster", "ps0:2222"], "--cluster"),
  ],
)
def test_values_it_cannot_run_are_refused_before_anything_starts(arguments, named, tmp_path):
  output_dir = tmp_path / "never"
  result = subprocess.run(
    LAUNCHER + arguments + ["--output_dir", str(output_dir)],
    capture_output=True,
    text=True,
    timeout=60,
    env=_user_env(),
  )
  assert result.returncode == 2, result.stderr
  assert f"argument {named}" in result.stderr, result.stderr
  assert result.stdout == ""
  assert not output_dir.exists()


def _without_private_networks(command):
  """`command` where this user may create no namespace (user.max_user_namespaces = 0)."""
  if not PRIVATE:
    return command
  if shutil.which("unshare") is None:
    pytest.skip("util-linux's unshare is needed to turn private networks off here")
  switch_off = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
  return ["unshare", "--user", "--map-root-user", "sh", "-c", switch_off, "sh", *command]


def test_without_a_private_network_it_refuses_and_says_what_would_be_exposed(tmp_path):
  command = LAUNCHER + ["--ps", "1", "--workers", "2", "--output_dir", str(tmp_path)]
  result = subprocess.run(
    _without_private_networks(command),
    capture_output=True,
    text=True,
    timeout=120,
    env=_user_env(),
  )
  assert result.returncode == 1, result.stdout + result.stderr
  assert "Refusing to start. To go on anyway: --allow_exposed_ports." in result.stderr
  assert "cannot create a network namespace" in result.stderr, result.stderr
  ports = re.search(
    r"listen on port\(s\) (\d+), (\d+), (\d+) of every interface: (.*)\.", result.stderr
  )
  assert ports, result.stderr
  assert "lo (127.0.0.1)" in ports.group(4).split(", "), result.stderr
  assert result.stdout == ""  # no cluster, no training
  assert tensorflow_log_lines(result.stderr) == []
