"""A network of its own for a local cluster: a Linux network namespace with only loopback up.

TensorFlow's servers listen on every interface of the machine they run on and serve
unauthenticated gRPC. Tasks started inside a new network namespace (created with a user
namespace, which needs no privileges where the kernel allows it) listen on its only interface,
its own `lo`, that nothing outside the namespace can reach. A process must be inside the same
namespace to talk to them: `PrivateNetwork.command` wraps a command line so that it runs there.

    python -m examples.private_network hold        # create one, wait on stdin
    python -m examples.private_network join PID -- COMMAND...
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import sys
from typing import NamedTuple, Sequence

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
TCP_LISTEN = "0A"
READY = "ready"
MODULE = "examples.private_network"


class Unavailable(RuntimeError):
  """This machine does not let this user create a network namespace."""


class Listener(NamedTuple):
  """A listening TCP socket, as one row of a socket table."""

  address: ipaddress.IPv4Address | ipaddress.IPv6Address
  port: int
  inode: int


def only_loopback() -> bool:
  """Whether the network this process is in has no interface but loopback (nothing outside
  it can reach a server started here)."""
  return [name for _, name in socket.if_nameindex()] == ["lo"]


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
  # The kernel prints each 32-bit word of the address in host (little-endian) order.
  words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
  return ipaddress.ip_address(b"".join(words))


def listeners(pid: int | str = "self") -> list[Listener]:
  """The listening TCP sockets of the network namespace process `pid` is in (Linux)."""
  found = []
  for table in ("tcp", "tcp6"):
    try:
      with open(f"/proc/{pid}/net/{table}") as f:
        rows = f.readlines()[1:]
    except FileNotFoundError:  # no IPv6 in this kernel
      continue
    for row in rows:
      fields = row.split()
      local, state, inode = fields[1], fields[3], fields[9]
      if state == TCP_LISTEN:
        hex_address, hex_port = local.split(":")
        found.append(Listener(_address(hex_address), int(hex_port, 16), int(inode)))
  return found


def _libc(function: str, *args: int) -> None:
  libc = ctypes.CDLL(None, use_errno=True)
  if getattr(libc, function)(*args) != 0:
    number = ctypes.get_errno()
    raise OSError(number, f"{function}: {os.strerror(number)}")


def _write(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


def _enter_new_namespace() -> None:
  """Moves this (single-threaded) process into a new user and network namespace, keeping its
  user and group ids, and brings the namespace's loopback interface up."""
  uid, gid = os.geteuid(), os.getegid()
  _libc("unshare", CLONE_NEWUSER | CLONE_NEWNET)
  try:
    _write("/proc/self/setgroups", "deny")  # required before gid_map without privileges
  except FileNotFoundError:  # kernels before 3.19
    pass
  _write("/proc/self/uid_map", f"{uid} {uid} 1")
  _write("/proc/self/gid_map", f"{gid} {gid} 1")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack("16sH22x", b"lo", 0)
    flags = struct.unpack_from("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def hold() -> None:
  """Creates the namespace, says so on stdout, and keeps it until stdin closes."""
  try:
    _enter_new_namespace()
  except OSError as error:
    print(f"cannot create a network namespace: {error}", flush=True)
    sys.exit(1)
  print(READY, flush=True)
  sys.stdin.read()


def join(pid: int, argv: Sequence[str]) -> None:
  """Replaces this (single-threaded) process by `argv`, run in the namespaces of `pid`."""
  namespaces = [
    (os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY), flag)
    for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET))
  ]
  for descriptor, flag in namespaces:
    _libc("setns", descriptor, flag)
    os.close(descriptor)
  os.execvp(argv[0], list(argv))


class PrivateNetwork:
  """A new network namespace with only loopback, held by a small child process until `close`.

  Raises `Unavailable` when this machine or user may not create one (not Linux, user
  namespaces disabled or forbidden by a container's seccomp profile, ...).
  """

  def __init__(self):
    if not sys.platform.startswith("linux"):
      raise Unavailable(f"network namespaces are a Linux feature; this is {sys.platform}")
    self._holder = subprocess.Popen(
      [sys.executable, "-m", MODULE, "hold"],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    answer = self._holder.stdout.readline().strip()
    if answer != READY:
      self._holder.wait()
      raise Unavailable(answer or f"the namespace holder exited ({self._holder.returncode})")

  def __str__(self) -> str:
    return "on loopback, in a network namespace of its own"

  def command(self, argv: Sequence[str]) -> list[str]:
    """`argv` as a command line that runs inside this network."""
    return [sys.executable, "-m", MODULE, "join", str(self._holder.pid), "--", *argv]

  def listening(self, port: int) -> bool:
    """Whether a socket listens on `port` in this network, from its socket table."""
    return any(listener.port == port for listener in listeners(self._holder.pid))

  def close(self) -> None:
    """Ends the holder; the namespace goes with the last process inside it."""
    if self._holder.poll() is None:
      self._holder.stdin.close()
      self._holder.wait()

  def __enter__(self) -> "PrivateNetwork":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def main(argv: Sequence[str]) -> None:
  if argv[:1] == ["hold"]:
    hold()
  elif len(argv) > 3 and argv[0] == "join" and argv[2] == "--":
    try:
      join(int(argv[1]), argv[3:])
    except OSError as error:  # never run the command outside the namespace instead
      print(f"cannot join the network namespace of process {argv[1]}: {error}", file=sys.stderr)
      sys.exit(1)
  else:
    sys.exit(f"usage: python -m {MODULE} hold | join PID -- COMMAND...")


if __name__ == "__main__":
  main(sys.argv[1:])
