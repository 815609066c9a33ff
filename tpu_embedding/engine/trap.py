"""The gradient trap: how the embedding update rides on the user's `tape.gradient`.

Activations come out of a `tf.custom_gradient` function of one trainable dummy variable, so
when the user's gradient reaches them, TensorFlow calls back with their upstream gradients:
the only place the tables can be updated from a gradient the model computed. The dummy's own
gradient is always zero. The CPU/GPU engine and the TPU paths V1 and V2 all train through it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf


def trapped(
  trap: tf.Variable,
  forward: Callable[[], Sequence[tf.Tensor]],
  backward: Callable[[list[tf.Tensor]], None],
) -> list[tf.Tensor]:
  """`forward()`'s flat activations, whose gradient is handed to `backward` instead of flowing
  further (to `trap`, it is zero)."""

  @tf.custom_gradient
  def gradient_trap(dummy):
    activations = forward()

    def grad(*upstream, variables=None):
      backward(list(upstream))
      return tf.zeros_like(dummy), [None] * len(variables or ())

    return list(activations), grad

  return gradient_trap(trap)
