"""Which execution path the layer takes, decided once from the strategy and the hardware.

`detect_embedding_feature` is the only function that asks the runtime (the strategy's
`extended.tpu_hardware_feature`).
"""

from __future__ import annotations

import enum
from typing import Optional

import tensorflow as tf

EmbeddingFeature = tf.tpu.experimental.HardwareFeature.EmbeddingFeature


class ExecutionPath(enum.Enum):
  """An execution path; each has one backend class in `tpu_embedding.backends`."""

  CPU = "cpu"  # any non-TPU strategy: our CPU/GPU engine
  TPU_V0 = "tpu_v0"  # TPU without embedding accelerator: replicated tables (TPUEmbeddingV0)
  TPU_V1 = "tpu_v1"  # TPU embedding engine (TPUEmbedding): enqueue/dequeue + gradient trap
  TPU_V2 = "tpu_v2"  # SparseCore (TPUEmbeddingV2)


_PATH_OF_FEATURE = {
  EmbeddingFeature.UNSUPPORTED: ExecutionPath.TPU_V0,
  EmbeddingFeature.V1: ExecutionPath.TPU_V1,
  EmbeddingFeature.V2: ExecutionPath.TPU_V2,
}


# The TPU strategies TF's mid-level classes accept (their own `isinstance` checks), with any
# subclass: a user's subclass must not fall to the CPU path.
_TPU_STRATEGY_TYPES = (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)
_TPU_STRATEGY_V1 = tf.compat.v1.distribute.experimental.TPUStrategy


def is_tpu_strategy(strategy: tf.distribute.Strategy) -> bool:
  """Whether `strategy` is a TPU strategy the mid-level TPU embedding classes accept.

  Raises:
    TypeError: for the TF1 `tf.compat.v1.distribute.experimental.TPUStrategy`, which TF's
      embedding classes refuse (or, on V1, silently treat as no TPU).
  """
  if isinstance(strategy, _TPU_STRATEGY_V1):
    raise TypeError(
      f"{strategy_name(strategy)} (tf.compat.v1.distribute.experimental.TPUStrategy) is not "
      "supported: TensorFlow's TPU embedding API works only under tf.distribute.TPUStrategy. "
      "Create the model under tf.distribute.TPUStrategy(resolver) instead."
    )
  return isinstance(strategy, _TPU_STRATEGY_TYPES)


def detect_embedding_feature(strategy: tf.distribute.Strategy) -> Optional[EmbeddingFeature]:
  """The embedding feature of the TPU behind `strategy`, or None when it is not a TPU strategy."""
  if not is_tpu_strategy(strategy):
    return None
  return strategy.extended.tpu_hardware_feature.embedding_feature


def choose_path(
  strategy: tf.distribute.Strategy, override: Optional[EmbeddingFeature] = None
) -> ExecutionPath:
  """Maps the hardware (and an optional user override) to a path.

  Forcing UNSUPPORTED (replicated tables) is always allowed on a TPU; forcing a feature the
  hardware lacks is an error rather than a silent fallback. Off TPU the override is ignored:
  the same model code must run on a laptop.
  """
  detected = detect_embedding_feature(strategy)
  if detected is None:
    return ExecutionPath.CPU
  if override == EmbeddingFeature.UNSUPPORTED:
    return ExecutionPath.TPU_V0
  if detected not in _PATH_OF_FEATURE:
    raise ValueError(
      f"This TPU reports the embedding feature {detected!r}, which this package does not know "
      f"(it knows {sorted(str(f) for f in _PATH_OF_FEATURE)}). Pass embedding_feature="
      f"{EmbeddingFeature.UNSUPPORTED} to replicate the tables, or upgrade tpu_embedding."
    )
  if override is None or override == detected:
    return _PATH_OF_FEATURE[detected]
  raise ValueError(
    f"embedding_feature={override} was requested, but this TPU's embedding feature is "
    f"{detected}. Pass embedding_feature=None (use {detected}) or "
    f"{EmbeddingFeature.UNSUPPORTED} (replicate the tables)."
  )


def strategy_name(strategy: tf.distribute.Strategy) -> str:
  return type(strategy).__name__
