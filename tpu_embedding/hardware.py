"""Which execution path the layer takes, decided once from the strategy and the hardware.

`detect_embedding_feature` is the only function that asks the runtime; tests replace it to put
the layer on a given TPU path without a TPU (they then check wiring, never TPU execution).
"""

from __future__ import annotations

import enum
from typing import Optional

import tensorflow as tf

EmbeddingFeature = tf.tpu.experimental.HardwareFeature.EmbeddingFeature


class Path(enum.Enum):
  """An execution path; each has one backend class in `tpu_embedding.backends`."""

  CPU = "cpu"        # any non-TPU strategy: our CPU/GPU engine
  TPU_V0 = "tpu_v0"  # TPU without embedding accelerator: replicated tables (TPUEmbeddingV0)
  TPU_V1 = "tpu_v1"  # TPU embedding engine (TPUEmbedding): enqueue/dequeue + gradient trap
  TPU_V2 = "tpu_v2"  # SparseCore (TPUEmbeddingV2)


_PATH_OF_FEATURE = {
    EmbeddingFeature.UNSUPPORTED: Path.TPU_V0,
    EmbeddingFeature.V1: Path.TPU_V1,
    EmbeddingFeature.V2: Path.TPU_V2,
}


_TPU_STRATEGY_TYPES = (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy,
                       tf.compat.v1.distribute.experimental.TPUStrategy)


def is_tpu_strategy(strategy: tf.distribute.Strategy) -> bool:
  """TF's TPU strategies and any subclass of them (a user's subclass must not fall to the CPU).

  A class named like a TPU strategy anywhere in the MRO also counts, so stand-ins work in tests.
  """
  return isinstance(strategy, _TPU_STRATEGY_TYPES) or any(
      cls.__name__.startswith("TPUStrategy") for cls in type(strategy).__mro__)


def detect_embedding_feature(strategy: tf.distribute.Strategy) -> Optional[EmbeddingFeature]:
  """The embedding feature of the TPU behind `strategy`, or None when it is not a TPU strategy."""
  if not is_tpu_strategy(strategy):
    return None
  return strategy.extended.tpu_hardware_feature.embedding_feature


def choose_path(strategy: tf.distribute.Strategy,
                override: Optional[EmbeddingFeature] = None) -> Path:
  """Maps the hardware (and an optional user override) to a path.

  Forcing UNSUPPORTED (replicated tables) is always allowed on a TPU; forcing a feature the
  hardware lacks is an error rather than a silent fallback. Off TPU the override is ignored:
  the same model code must run on a laptop.
  """
  detected = detect_embedding_feature(strategy)
  if detected is None:
    return Path.CPU
  if override is None or override == detected:
    return _PATH_OF_FEATURE.get(detected, Path.TPU_V0)
  if override == EmbeddingFeature.UNSUPPORTED:
    return Path.TPU_V0
  raise ValueError(
      f"embedding_feature={override} was requested, but this TPU's embedding feature is "
      f"{detected}. Pass embedding_feature=None (use {detected}) or "
      f"{EmbeddingFeature.UNSUPPORTED} (replicate the tables).")


def strategy_name(strategy: tf.distribute.Strategy) -> str:
  return type(strategy).__name__
