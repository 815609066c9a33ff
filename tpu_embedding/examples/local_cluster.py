"""A parameter-server cluster as local processes on 127.0.0.1, for examples and tests.

`LocalCluster(num_ps, num_workers)` starts one process per ps and worker task, each a
`tf.distribute.Server` configured by its own TF_CONFIG (exactly what each machine of a real
cluster runs), on ports that were free a moment before. The coordinator is the caller's
process: it connects with `cluster.resolver()`. Leaving the `with` block stops every process,
whatever happened inside it; `kill` and `restart` simulate a task's machine failing.

    python -m tpu_embedding.examples.local_cluster   # run one task from its TF_CONFIG
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def free_ports(count: int) -> list[int]:
  """`count` distinct ports that were free a moment ago (held open together, then released)."""
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def _wait_for_port(port: int, process: subprocess.Popen, deadline: float) -> None:
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise RuntimeError(
        f"A cluster task exited with status {process.returncode} before listening on port {port}."
      )
    with socket.socket() as s:
      if s.connect_ex(("127.0.0.1", port)) == 0:
        return
    time.sleep(0.1)
  raise TimeoutError(f"No cluster task listened on port {port} in time.")


class LocalCluster:
  """ps and worker tasks as child processes; see the module docstring.

  Args:
    num_ps: parameter-server tasks (they hold the tables).
    num_workers: worker tasks (they run the steps the coordinator schedules).
    start_timeout: seconds every task has to start listening.
  """

  def __init__(self, num_ps: int, num_workers: int, start_timeout: float = 180.0):
    if num_ps < 1 or num_workers < 1:
      raise ValueError(
        f"A parameter-server cluster needs at least one ps and one worker task; got "
        f"num_ps={num_ps}, num_workers={num_workers}."
      )
    ports = free_ports(num_ps + num_workers)
    self.spec = {
      "worker": [f"127.0.0.1:{p}" for p in ports[:num_workers]],
      "ps": [f"127.0.0.1:{p}" for p in ports[num_workers:]],
    }
    self._start_timeout = start_timeout
    self._processes: dict[tuple[str, int], subprocess.Popen] = {}

  def __enter__(self) -> "LocalCluster":
    try:
      for job, addresses in self.spec.items():
        for index in range(len(addresses)):
          self._spawn(job, index)
      self._wait_listening(list(self._processes))
    except BaseException:
      self.stop()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    self.stop()

  def _spawn(self, job: str, index: int) -> None:
    env = dict(os.environ)
    env["TF_CONFIG"] = json.dumps({"cluster": self.spec, "task": {"type": job, "index": index}})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    self._processes[(job, index)] = subprocess.Popen(
      [sys.executable, "-m", "tpu_embedding.examples.local_cluster"],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )

  def _wait_listening(self, tasks: list[tuple[str, int]]) -> None:
    deadline = time.monotonic() + self._start_timeout
    for job, index in tasks:
      port = int(self.spec[job][index].rsplit(":", 1)[1])
      _wait_for_port(port, self._processes[(job, index)], deadline)

  def resolver(self):
    """The coordinator's view of the cluster (import TensorFlow only in the coordinator)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(self.spec), rpc_layer="grpc"
    )

  def kill(self, job: str, index: int) -> None:
    """SIGKILLs one task, as if its machine had failed."""
    process = self._processes[(job, index)]
    process.send_signal(signal.SIGKILL)
    process.wait()

  def restart(self, job: str, index: int) -> None:
    """Starts a killed task again on its address (with empty state)."""
    self._processes[(job, index)].wait()
    self._spawn(job, index)
    self._wait_listening([(job, index)])

  def pid(self, job: str, index: int) -> int:
    return self._processes[(job, index)].pid

  def stop(self, grace: float = 5.0) -> None:
    """Terminates every task, then kills those still running after `grace` seconds."""
    for process in self._processes.values():
      if process.poll() is None:
        process.terminate()
    deadline = time.monotonic() + grace
    for process in self._processes.values():
      try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# A task's steps hold inter-op threads while they wait on other tasks (receives from the ps
# tasks, shard locks): with TF's default of one thread per core, a 2-core machine can have
# every thread waiting and the cluster stalls. Waiting threads cost no CPU.
MIN_INTER_OP_THREADS = 8


def serve() -> None:
  """Runs this process's task (from TF_CONFIG) until it is stopped."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  config = json.loads(os.environ["TF_CONFIG"])
  task = config["task"]
  threads = max(MIN_INTER_OP_THREADS, os.cpu_count() or 1)
  server = tf.distribute.Server(
    tf.train.ClusterSpec(config["cluster"]),
    job_name=task["type"],
    task_index=task["index"],
    protocol="grpc",
    config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads),
  )
  server.join()


if __name__ == "__main__":
  serve()
