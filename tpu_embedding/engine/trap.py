"""The gradient trap: how the embedding update rides on the user's `tape.gradient`.

Activations come out of a `tf.custom_gradient` function of one trainable dummy variable, so
when the user's gradient reaches them, TensorFlow calls back with their upstream gradients:
the only place the tables can be updated from a gradient the model computed. The dummy's own
gradient is always zero. The CPU/GPU engine and the TPU paths V1 and V2 all train through it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from tpu_embedding import tf_internals


def trapped(
  trap: tf.Variable,
  forward: Callable[[], Sequence[tf.Tensor]],
  backward: Callable[[list[tf.Tensor]], None],
  *,
  plain_when_saved: bool = False,
) -> list[tf.Tensor]:
  """`forward()`'s flat activations, whose gradient is handed to `backward` instead of flowing
  further (to `trap`, it is zero).

  With `plain_when_saved`, `forward` runs outside the trap, which receives its activations, and
  the gradient that `tf.saved_model.save` traces (to save it with a function traced before
  saving) passes the upstream gradients on instead of calling `backward`: in the reloaded
  SavedModel a gradient trains nothing and reaches the tables through TF's own gradients of
  `forward`'s ops, as a plain lookup's would (tf-recommenders' behaviour).
  """
  if not plain_when_saved:

    @tf.custom_gradient
    def gradient_trap(dummy):
      activations = forward()

      def grad(*upstream, variables=None):
        return _updated(backward, list(upstream), dummy), [None] * len(variables or ())

      return list(activations), grad

    return gradient_trap(trap)

  @tf.custom_gradient
  def passing_trap(dummy, *activations):
    def grad(*upstream):
      if tf_internals.in_save_context():
        return [tf.zeros_like(dummy), *upstream]
      return [_updated(backward, list(upstream), dummy), *([None] * len(activations))]

    return [tf.identity(a) for a in activations], grad

  return passing_trap(trap, *forward())


def _updated(
  backward: Callable[[list[tf.Tensor]], None], upstream: list[tf.Tensor], dummy: tf.Tensor
) -> tf.Tensor:
  """The dummy's gradient, once `backward(upstream)` has run: the dummy's own value, zero.

  Where TF adds automatic control dependencies they run the update and order it with the rest
  of the step, and the gradient must not depend on it: through that gradient and the
  optimizer's ops, grappler would take the update for the order between the next layer's kernel
  read (which fed `upstream`) and that kernel's update in the same step, drop their own edge,
  then cut the path (docs/engine.md, "The gradient trap and grappler"). Elsewhere (the
  backward function TF builds for a `tf.function` differentiated by a tape outside it runs only
  what its outputs depend on) the gradient depends on every op `backward` built, or the update
  would never run.

  It is the dummy's value (zero: the dummy starts at zero and a zero gradient keeps it there),
  not a constant zero that grappler could fold: a folded zero lets grappler cut that path where
  TF makes it itself (the backward of a `tf.function` called inside the step).
  """
  if tf.executing_eagerly() or tf_internals.adds_control_dependencies():
    backward(upstream)
    return tf.identity(dummy)
  graph = tf.compat.v1.get_default_graph()
  first = len(graph.get_operations())
  backward(upstream)
  with tf.control_dependencies(graph.get_operations()[first:]):
    return tf.identity(dummy)
