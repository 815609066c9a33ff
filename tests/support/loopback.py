"""Test clusters on loopback: the launcher's `LocalCluster`, a network for hand-made clusters,
task faults, and the socket-table check that nothing listens beyond loopback.

Tests run where a private network can be made (every task, and the test's own coordinator
processes, inside it), and still run where it cannot (on this machine's network, the exposure
printed on stderr): CI machines differ.
"""

from __future__ import annotations

import os

from examples import private_network
from examples.local_cluster import (
  LocalCluster,
  free_ports,  # noqa: F401 (for the tests)
  open_network,
)


def cluster(num_ps: int, num_workers: int) -> LocalCluster:
  return LocalCluster(num_ps=num_ps, num_workers=num_workers, allow_exposed=True)


def network():
  """Where a test starts the processes of a cluster it builds itself (`network.command`)."""
  return open_network(allow_exposed=True)


def restart(running: LocalCluster, job: str, index: int) -> None:
  """Starts a task killed by the test again on its address (with empty state)."""
  running.process(job, index).wait()
  running.start_tasks([(job, index)])


def interfaces(pid: int) -> set[str]:
  """The network interfaces of the namespace process `pid` is in."""
  with open(f"/proc/{pid}/net/dev") as f:
    return {line.split(":")[0].strip() for line in f.readlines()[2:]}


def sockets(pid: int) -> set[int]:
  """The inodes of the sockets process `pid` holds open."""
  inodes = set()
  for descriptor in os.listdir(f"/proc/{pid}/fd"):
    try:
      target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
    except FileNotFoundError:  # closed meanwhile
      continue
    if target.startswith("socket:["):
      inodes.add(int(target[len("socket:[") : -1]))
  return inodes


def listeners(pid: int) -> list[private_network.Listener]:
  """The sockets process `pid` listens on, from its network's socket table."""
  held = sockets(pid)
  return [listener for listener in private_network.listeners(pid) if listener.inode in held]


def reachable_listeners(pid: int) -> list[private_network.Listener]:
  """The sockets process `pid` listens on that an interface other than loopback reaches: those
  on a non-loopback address (the wildcard included), unless loopback is its network's only
  interface."""
  if interfaces(pid) == {"lo"}:
    return []
  return [
    listener
    for listener in listeners(pid)
    if not (getattr(listener.address, "ipv4_mapped", None) or listener.address).is_loopback
  ]


def private_networks() -> bool:
  """Whether this machine lets this user create a private network (the tests' clusters and the
  launcher then run in one)."""
  try:
    private_network.PrivateNetwork().close()
  except private_network.Unavailable:
    return False
  return True


def children(pid: int) -> dict[int, str]:
  """The child processes of `pid`, each with its command line."""
  found = {}
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
      if parent == pid:
        with open(f"/proc/{entry}/cmdline") as f:
          found[int(entry)] = f.read().replace("\0", " ").strip()
    except (OSError, ValueError, IndexError):  # not a process, or one that just ended
      continue
  return found
