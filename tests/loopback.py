"""Ports for test clusters on 127.0.0.1 (the launcher's own helper)."""

from tpu_embedding.examples.local_cluster import free_ports  # noqa: F401
