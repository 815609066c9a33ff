"""Symbolic outputs of the Keras 3 layers, and the float placeholders Keras and TF make up.

Keras 3 asks a layer for its output without running it (`compute_output_spec`) when a functional
model is built, and it builds subclassed models by tracing `call` on float32 placeholders; TF
traces a model's default serving signature with float32 specs too. The activations' shapes
follow from each feature's config and its input's kind (dense, ragged or sparse), which a
`KerasTensor` carries, so they are computed here without any lookup. Ids that Keras or TF made
up are cast to integers; ids a user passes are never cast (float ids stay refused).
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf
from keras.src.backend.common import symbolic_scope  # Keras's shape-inference tracing
from tensorflow.python.saved_model import save_context  # whether a SavedModel is being traced
from tensorflow.python.util import nest as tf_nest  # flattening up to the feature nest

from tpu_embedding import config as config_lib

Shape = tuple[Optional[int], ...]


def mid_level_shape(feature: config_lib.Feature, shape: Shape, bag: bool) -> Shape:
  """The activation shape of `feature` under the mid-level API's rules (`TPUEmbedding`).

  `bag` is True for ragged and sparse inputs, whose last axis is a bag (or the positions of a
  sequence feature); each dense id is its own sample, except that `[B, 1]` gives `[B, D]`.
  """
  dim = feature.table.dim
  configured = feature.config.output_shape
  if configured.rank:  # a fixed per-replica shape; the batch stays the input's
    return (shape[0] if shape else None, *configured.as_list()[1:], dim)
  sequence = feature.config.max_sequence_length
  if not shape:
    return (dim,)
  if bag or (sequence and len(shape) == 2 and shape[-1] != 1):
    return (*shape[:-1], *([sequence] if sequence else []), dim)
  if len(shape) >= 2 and shape[-1] == 1:
    return (*shape[:-1], dim)
  return (*shape, dim)


def bag_shape(feature: config_lib.Feature, shape: Shape, bag: bool = True) -> Shape:
  """The activation shape under keras-rs's rules (`DistributedEmbedding`): the last axis of
  any input of rank 2 or more is one bag, reduced by the combiner, whatever its kind (`bag`);
  rank 1 is one id a row."""
  del bag
  if len(shape) >= 2:
    shape = shape[:-1]
  return (*shape, feature.table.dim)


def output_spec(config: config_lib.EmbeddingConfig, features: Any, rule: Any) -> Any:
  """One float32 `KerasTensor` per feature, with the structure of `features`.

  `rule(feature, shape, bag)` gives the activation shape; `features` holds `KerasTensor`s (or
  anything with a `shape`).
  """
  pairs = config_lib.match_structure(config, features)
  outputs = []
  for feature, leaf in pairs:
    shape = tuple(leaf.shape)
    bag = bool(getattr(leaf, "ragged", False) or getattr(leaf, "sparse", False))
    outputs.append(keras.KerasTensor(rule(feature, shape, bag), dtype="float32"))
  return tf.nest.pack_sequence_as(features, outputs)


def output_shape(config: config_lib.EmbeddingConfig, input_shape: Any, rule: Any) -> Any:
  """`output_spec`'s shapes from shapes alone (Keras gives no kind here: read as dense)."""
  shapes = tf_nest.flatten_up_to(config.feature_config, input_shape, check_types=False)
  outputs = [
    rule(feature, tuple(tf.TensorShape(shape).as_list()), False)
    for feature, shape in zip(config.features, shapes)
  ]
  return tf.nest.pack_sequence_as(config.feature_config, outputs)


def cast_placeholders(features: Any) -> Any:
  """Float dense ids as int64 while Keras infers shapes or TF traces a SavedModel signature
  (both feed float32 placeholders); anything else untouched, so real float ids stay refused."""
  if not (symbolic_scope.in_symbolic_scope() or save_context.in_save_context()):
    return features

  def cast(leaf):
    if isinstance(leaf, tf.Tensor) and leaf.dtype.is_floating:
      return tf.cast(leaf, tf.int64)
    return leaf

  return tf.nest.map_structure(cast, features)
