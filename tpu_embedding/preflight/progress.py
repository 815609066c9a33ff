"""A plain progress bar on stderr over the batches a report reads (no library needed)."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

T = TypeVar("T")
WIDTH = 30


def progress(
  items: Iterable[T], *, total: Optional[int] = None, label: str = "batches", stream: TextIO = None
) -> Iterator[T]:
  """Yields `items`, redrawing one line on `stream` (stderr) after each: a bar and "i/total"
  when `total` is known, the count alone otherwise; ends the line when `items` ends."""
  stream = stream or sys.stderr
  count = 0
  for item in items:
    yield item
    count += 1
    stream.write("\r" + line(count, total, label))
    stream.flush()
  stream.write("\r" + line(count, total, label) + "\n")
  stream.flush()


def line(count: int, total: Optional[int], label: str) -> str:
  """ "[######........] 12/30 batches", or "12 batches" when the total is unknown."""
  if not total:
    return f"{count} {label}"
  filled = min(WIDTH, WIDTH * count // total)
  return f"[{'#' * filled}{'.' * (WIDTH - filled)}] {count}/{total} {label}"
