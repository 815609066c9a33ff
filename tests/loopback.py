"""Ports for test clusters on 127.0.0.1."""

import socket


def free_ports(count: int) -> list[int]:
  """`count` distinct ports that were free a moment ago (held open together, then released)."""
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports
