"""How the engine's tables are distributed, decided once from the strategy it is created under.

Whether code runs inside one replica of a step or in a cross-replica context is a property of
each call (`exchange.in_replica`), and is asked per call. What depends only on the strategy
(where the tables live, whether workers update them concurrently) is fixed when the engine is
created, and recorded here instead of being re-tested wherever it matters.
"""

from __future__ import annotations

import enum

import tensorflow as tf


class Distribution(enum.Enum):
  """Where an engine's tables live and who updates them."""

  LOCAL = "one copy, no strategy"
  REPLICATED = "one copy per device (mirrored, multi-worker, TPU replicas), same update on each"
  PARAMETER_SERVERS = "on parameter-server tasks, updated concurrently by the workers"

  @classmethod
  def current(cls) -> Distribution:
    """The distribution of tables created now, under the strategy in scope (if any)."""
    if not tf.distribute.has_strategy():
      return cls.LOCAL
    if isinstance(tf.distribute.get_strategy(), tf.distribute.ParameterServerStrategy):
      return cls.PARAMETER_SERVERS
    return cls.REPLICATED
