"""`examples.private_network`: a namespace only loopback reaches, checked from socket tables."""

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from examples import private_network

import loopback

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

# Listens on every interface of its network (as TensorFlow's servers do) until stdin closes.
SERVER = """
import socket, sys
server = socket.socket(socket.AF_INET6)
server.bind(("::", 0))
server.listen()
print(server.getsockname()[1], flush=True)
sys.stdin.read()
"""


def _serve(command):
  server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  return server, int(server.stdout.readline())


@pytest.fixture
def network():
  try:
    with private_network.PrivateNetwork() as running:
      yield running
  except private_network.Unavailable as error:
    pytest.skip(f"no private network on this machine: {error}")


def test_a_server_on_every_interface_inside_is_reachable_only_through_loopback(network):
  server, port = _serve(network.command([sys.executable, "-c", SERVER]))
  try:
    assert loopback.interfaces(server.pid) == {"lo"}
    assert os.stat(f"/proc/{server.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    (listener,) = loopback.listeners(server.pid)
    assert (listener.address, listener.port) == (ipaddress.IPv6Address("::"), port)
    assert network.listening(port)
    assert loopback.reachable_listeners(server.pid) == []
    # The machine's own socket table does not hold it.
    assert listener.inode not in {entry.inode for entry in private_network.listeners()}
  finally:
    server.stdin.close()
    server.wait()


def test_the_same_server_outside_is_reachable_from_other_interfaces():
  # What the check above would report without the namespace (on a machine with a network).
  if private_network.only_loopback():
    pytest.skip("this machine has no interface but loopback")
  server, port = _serve([sys.executable, "-c", SERVER])
  try:
    reachable = loopback.reachable_listeners(server.pid)
    assert [(entry.address, entry.port) for entry in reachable] == [
      (ipaddress.IPv6Address("::"), port)
    ]
  finally:
    server.stdin.close()
    server.wait()


def test_socket_tables_are_read_with_addresses_ports_and_inodes():
  with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
    v4.bind(("127.0.0.1", 0))
    v6.bind(("::1", 0))
    v4.listen()
    v6.listen()
    found = {(entry.address, entry.port) for entry in loopback.listeners(os.getpid())}
    assert (ipaddress.IPv4Address("127.0.0.1"), v4.getsockname()[1]) in found
    assert (ipaddress.IPv6Address("::1"), v6.getsockname()[1]) in found
    assert loopback.reachable_listeners(os.getpid()) == []


def test_a_command_that_cannot_join_never_runs_outside(tmp_path):
  marker = tmp_path / "ran"
  ended = subprocess.Popen([sys.executable, "-c", "pass"])
  ended.wait()  # a process id whose namespaces are gone
  command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
  joined = subprocess.run(
    [sys.executable, "-m", private_network.MODULE, "join", str(ended.pid), "--", *command],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert joined.returncode == 1
  assert f"cannot join the network namespace of process {ended.pid}" in joined.stderr
  assert not marker.exists()


def test_closing_ends_the_process_that_holds_it(network):
  def holders():
    return [pid for pid, line in loopback.children(os.getpid()).items() if "hold" in line]

  assert len(holders()) == 1
  network.close()
  assert holders() == []
