"""A synthetic stream of ratings whose items appear day by day and fade: what managed ids are for.

Every day `new_items_per_day` items appear, each with a 64-bit key (negative ones included) and a
hidden quality. An item's popularity decays with its age (e^(-age / 1.5), age in days) and, within
its day, with its rank (1 / sqrt(rank)); a rating is positive with probability
sigmoid(quality). Used by `python -m benchmarks managed` and the managed-ids colab.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def rating_stream(
  days: int, batches_per_day: int, batch: int, new_items_per_day: int, seed: int = 7
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
  """Per day, batches of (day, item keys, item indices 0.., labels as float32 0/1)."""
  rng = np.random.default_rng(seed)
  total = days * new_items_per_day
  quality = rng.normal(0, 3.0, size=total)
  keys = rng.integers(-(2**62), 2**62, size=total)
  for day in range(days):
    live = (day + 1) * new_items_per_day
    age = day - np.arange(live) // new_items_per_day
    weight = np.exp(-age / 1.5) / (1 + np.arange(live) % new_items_per_day) ** 0.5
    p = weight / weight.sum()
    for _ in range(batches_per_day):
      items = rng.choice(live, size=batch, p=p)
      labels = rng.random(batch) < 1 / (1 + np.exp(-quality[items]))
      yield day, keys[items], items, labels.astype("f4")
