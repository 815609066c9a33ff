"""A parameter-server cluster as local processes on loopback, for examples and tests.

`LocalCluster(num_ps, num_workers)` starts one process per ps and worker task, each a
`tf.distribute.Server` configured by its own TF_CONFIG (exactly what each machine of a real
cluster runs), on ports that were free a moment before. TensorFlow's servers listen on every
interface and nobody authenticates to them, so the tasks run in a network of their own that
only loopback reaches (`private_network`); a coordinator must run there too:
`cluster.command(argv)` is the command line that does. Where no such network can be made, the
cluster refuses to start unless `allow_exposed=True`, and says which ports would be exposed on
which interfaces. Leaving the `with` block stops every process, whatever happened inside it.

    python -m examples.local_cluster [--verbose]   # run one task from TF_CONFIG
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import time
from typing import Protocol, Sequence

from examples import private_network, quiet

SIOCGIFADDR = 0x8915
# A task's steps hold inter-op threads while they wait on other tasks (receives from the ps
# tasks, shard locks): with TF's default of one thread per core, a 2-core machine can have
# every thread waiting and the cluster stalls. Waiting threads cost no CPU.
MIN_INTER_OP_THREADS = 8


class Network(Protocol):
  """Where a cluster's tasks run: how to start a process there and see what listens there
  (a context manager that closes it)."""

  def command(self, argv: Sequence[str]) -> list[str]: ...

  def listening(self, port: int) -> bool: ...

  def close(self) -> None: ...

  def __enter__(self) -> "Network": ...

  def __exit__(self, *exc_info) -> None: ...


class HostNetwork:
  """This process's own network: tasks are plain child processes."""

  def __init__(self, exposed: bool):
    self.exposed = exposed

  def __str__(self) -> str:
    return (
      "on every interface of this machine" if self.exposed else "on loopback (the only interface)"
    )

  def command(self, argv: Sequence[str]) -> list[str]:
    return list(argv)

  def listening(self, port: int) -> bool:
    with socket.socket() as s:
      return s.connect_ex(("127.0.0.1", port)) == 0

  def close(self) -> None:
    pass

  def __enter__(self) -> "HostNetwork":
    return self

  def __exit__(self, *exc_info) -> None:
    pass


class ExposedClusterError(RuntimeError):
  """The tasks could not be kept off the machine's other interfaces, and that was not allowed."""


def interfaces() -> list[str]:
  """This machine's network interfaces, each with its IPv4 address where it has one (Linux)."""
  described = []
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in socket.if_nameindex():
      try:
        reply = fcntl.ioctl(s, SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        described.append(f"{name} ({socket.inet_ntoa(reply[20:24])})")
      except OSError:  # no IPv4 address, or not Linux
        described.append(name)
  return described


def open_network(ports: Sequence[int] = (), allow_exposed: bool = False) -> Network:
  """A network for tasks listening on `ports` that nothing outside this machine reaches; or,
  only with `allow_exposed`, the machine's own (after saying what it exposes, on stderr)."""
  if private_network.only_loopback():
    return HostNetwork(exposed=False)
  try:
    return private_network.PrivateNetwork()
  except private_network.Unavailable as error:
    reason = error
  exposure = (
    f"Cannot keep the local cluster off this machine's network ({reason}). Its TensorFlow "
    f"servers would listen on port(s) {', '.join(map(str, ports)) or '(chosen later)'} of "
    f"every interface: {', '.join(interfaces())}. They serve unauthenticated gRPC: whoever "
    "reaches these ports can run TensorFlow ops in the tasks (read and write files, read the "
    "tables)."
  )
  if not allow_exposed:
    raise ExposedClusterError(exposure)
  print(f"WARNING: {exposure}", file=sys.stderr, flush=True)
  return HostNetwork(exposed=True)


def free_ports(count: int) -> list[int]:
  """`count` distinct ports that were free a moment ago (held open together, then released)."""
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


class LocalCluster:
  """ps and worker tasks as child processes; see the module docstring.

  Args:
    num_ps: parameter-server tasks (they hold the tables).
    num_workers: worker tasks (they run the steps the coordinator schedules).
    start_timeout: seconds every task has to start listening.
    allow_exposed: where no private network can be made, run the tasks on the machine's own
      network (listening on every interface) instead of raising `ExposedClusterError`.
    verbose: let the tasks print TensorFlow's messages (else their output is discarded).
  """

  def __init__(
    self,
    num_ps: int,
    num_workers: int,
    start_timeout: float = 180.0,
    allow_exposed: bool = False,
    verbose: bool = False,
  ):
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
    self.network: Network | None = None
    self._ports = ports
    self._start_timeout = start_timeout
    self._allow_exposed = allow_exposed
    self._verbose = verbose
    self._processes: dict[tuple[str, int], subprocess.Popen] = {}

  def __enter__(self) -> "LocalCluster":
    self.network = open_network(self._ports, self._allow_exposed)
    try:
      self.start_tasks(
        [(job, i) for job, addresses in self.spec.items() for i in range(len(addresses))]
      )
    except BaseException:
      self.stop()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    self.stop()

  def command(self, argv: Sequence[str]) -> list[str]:
    """`argv` as a command line that runs where it can reach the tasks (a coordinator)."""
    return self.network.command(argv)

  def process(self, job: str, index: int) -> subprocess.Popen:
    """The process of one task."""
    return self._processes[(job, index)]

  def start_tasks(self, tasks: Sequence[tuple[str, int]]) -> None:
    """Starts the given (job, index) tasks, none of them running, on their addresses (with
    empty state) and waits until every one listens."""
    running = [
      task for task in tasks if task in self._processes and self.process(*task).poll() is None
    ]
    if running:
      raise ValueError(f"Tasks {running} are still running.")
    for job, index in tasks:
      self._spawn(job, index)
    deadline = time.monotonic() + self._start_timeout
    for job, index in tasks:
      self._wait_listening(job, index, deadline)

  def _spawn(self, job: str, index: int) -> None:
    env = dict(os.environ)
    env["TF_CONFIG"] = json.dumps({"cluster": self.spec, "task": {"type": job, "index": index}})
    task = [sys.executable, "-m", "examples.local_cluster"]
    if self._verbose:
      task.append("--verbose")
    output = None if self._verbose else subprocess.DEVNULL
    self._processes[(job, index)] = subprocess.Popen(
      self.command(task), env=env, stdout=output, stderr=output
    )

  def _wait_listening(self, job: str, index: int, deadline: float) -> None:
    port = int(self.spec[job][index].rsplit(":", 1)[1])
    process = self.process(job, index)
    while time.monotonic() < deadline:
      if process.poll() is not None:
        raise RuntimeError(
          f"Cluster task {job} {index} exited with status {process.returncode} before "
          f"listening on port {port}."
        )
      if self.network.listening(port):
        return
      time.sleep(0.1)
    raise TimeoutError(f"Cluster task {job} {index} did not listen on port {port} in time.")

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
    if self.network is not None:
      self.network.close()


def serve(verbose: bool) -> None:
  """Runs this process's task (from TF_CONFIG) until it is stopped."""
  with quiet.tensorflow_start_up(verbose):
    import tensorflow as tf

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
  print(f"{task['type']} task {task['index']} serving on {server.target}", flush=True)
  server.join()


if __name__ == "__main__":
  serve(verbose="--verbose" in sys.argv[1:])
