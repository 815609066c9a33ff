"""Builds that run once even when two threads make an object's first calls at the same time."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable


def build_once(build: Callable[..., Any]) -> Callable[..., Any]:
  """`build`, run by one thread at a time and skipped once the object is `built`: two threads
  making a layer's first calls would otherwise both create (and track) its variables, and one
  would fail on TF's `_track_trackable ... already declared`."""
  lock = threading.RLock()  # one per method: builds are rare, so layers may share it

  @functools.wraps(build)
  def once(self: Any, *args: Any, **kwargs: Any) -> Any:
    with lock:
      if self.built:
        return None
      return build(self, *args, **kwargs)

  return once
