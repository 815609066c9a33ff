"""The one place that reads and edits TensorFlow's restore machinery while a restore runs.

Checked against the TensorFlow versions in `CHECKED_AGAINST` (`tf_versions`; importing this
module under another raises `tf_versions.UncheckedTensorFlow`). Everything below is TF-internal,
not API:
- the only caller of `Trackable._checkpoint_adapter(path)` is `restore._maybe_get_adapter`,
  whose local `checkpoint_position` is the `CheckpointPosition` being expanded;
- a `CheckpointPosition` has `trackable`, `checkpoint` (the restore coordinator) and
  `object_proto` (the object's node of the checkpoint's object graph);
- the coordinator has `object_graph_proto`, `shape_map` (checkpoint key -> shape),
  `slot_restorations` (variable node id -> queued slot restores, each with `slot_variable_id`)
  and `all_python_objects`;
- a trackable keeps restores of dependencies it has not created yet in `_deferred_dependencies`
  ({name: [CheckpointPosition]}).
`tests/test_tf_restore.py` asserts each of these, so a TF upgrade that moves one fails there; at
run time, a restore whose position cannot be found raises `RestoreMachineryChanged`.

TF 2.15 and 2.16 have no `_checkpoint_adapter` hook. There `RestoreHook` calls it from the one
step of TF's restore walk that every version shares: `restore._queue_children_for_restoration`
(local `checkpoint_position`) asks the object for its `_trackable_children()` before it looks
at any child of the object's checkpoint node, i.e. at the same moment as the later hook.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.trackable import base

from tpu_embedding import tf_versions

CHECKED_AGAINST = tf_versions.CHECKED_AGAINST
tf_versions.require_checked(__name__)
POSITION_LOCAL = "checkpoint_position"  # the local of `restore._maybe_get_adapter` read here
# Whether TF asks each object `_checkpoint_adapter(path)` while restoring (TF 2.17 on).
HAS_ADAPTER_HOOK = hasattr(base.Trackable, "_checkpoint_adapter")
RESTORE_WALK = "_queue_children_for_restoration"  # TF's step that visits an object's children
_VARIABLE_VALUE = "VARIABLE_VALUE"
# The caller's hook <- _checkpoint_adapter (and its overrides) <- _maybe_get_adapter, or, before
# TF 2.17, <- `RestoreHook._trackable_children` and its overrides <- RESTORE_WALK; with room.
_FRAMES_SEARCHED = 12


class RestoreMachineryChanged(RuntimeError):
  """TF's restore machinery no longer looks as this module expects: no restore is validated."""


class Restore:
  """One object's place in a running restore: its checkpoint node, the whole object graph (both
  `TrackableObjectGraph` protos, editable: TF walks the object's children after the hook returns),
  and the few coordinator edits a refused or remapped restore needs."""

  def __init__(self, position: Any):
    self._position = position
    self._coordinator = position.checkpoint

  @property
  def node(self) -> Any:
    """The checkpoint's node for the object being restored."""
    return self._position.object_proto

  @property
  def nodes(self) -> Any:
    """Every node of the checkpoint's object graph (a repeated proto field: `add()` appends)."""
    return self._coordinator.object_graph_proto.nodes

  def stored_shape(self, node: Any) -> Optional[list[int]]:
    """The shape the checkpoint holds for the variable at `node`; None if it holds no value."""
    for attribute in node.attributes:
      if attribute.name == _VARIABLE_VALUE:
        shape = self._coordinator.shape_map.get(attribute.checkpoint_key)
        return None if shape is None else list(shape)
    return None

  def skip_slot_restore(self, variable_node: int, slot_node: int) -> None:
    """Tells optimizers not to restore the checkpoint's slot `slot_node` of `variable_node` (its
    value goes to another owner)."""
    pending = self._coordinator.slot_restorations.get(variable_node, [])
    pending[:] = [r for r in pending if r.slot_variable_id != slot_node]

  def forget_pending_restores(self) -> None:
    """Drops this restore's deferred restores queued on every object visited so far.

    Objects not built yet (e.g. a Keras layer not called yet) keep the checkpoint positions of
    their future variables and would restore them when built; after a refused restore they must
    not.
    """
    for trackable in list(self._coordinator.all_python_objects):
      deferred = getattr(trackable, "_deferred_dependencies", None)
      if not deferred:
        continue
      for name in list(deferred):
        kept = [p for p in deferred[name] if p.checkpoint is not self._coordinator]
        if kept:
          deferred[name] = kept
        else:
          del deferred[name]


def restore_of(trackable: Any) -> Restore:
  """The running restore of `trackable`, found on the call stack of TF's restore hook.

  Call only from `trackable._checkpoint_adapter`. Raises `RestoreMachineryChanged` if TF's
  restore code no longer has the position there: a restore that cannot be validated must not
  proceed.
  """
  frame = sys._getframe(1)
  for _ in range(_FRAMES_SEARCHED):
    if frame is None:
      break
    position = frame.f_locals.get(POSITION_LOCAL)
    try:
      if position is not None and position.trackable is trackable:
        return Restore(position)
    except (AttributeError, KeyError):  # another local of that name, or an unbound position
      pass
    frame = frame.f_back
  raise _machinery_changed(trackable)


def _machinery_changed(trackable: Any) -> RestoreMachineryChanged:
  hook = "_checkpoint_adapter" if HAS_ADAPTER_HOOK else "_trackable_children"
  return RestoreMachineryChanged(
    f"tpu_embedding cannot validate this restore of {type(trackable).__name__}: TensorFlow "
    f"{tf.__version__}'s restore machinery changed (no `{POSITION_LOCAL}` of this object on "
    f"the call stack of its `{hook}` hook). tpu_embedding.tf_restore was checked "
    f"against TensorFlow {', '.join(CHECKED_AGAINST)}; the restore was stopped before any of "
    "its embedding tables or slots changed. Use a TensorFlow "
    "version it was checked against, or update tpu_embedding.tf_restore."
  )


class RestoreHook:
  """Base of the objects that validate a restore in `_checkpoint_adapter(path)`: on TF versions
  without that hook, calls it at the same point of the restore (see the module docstring).

  Place it after every class that overrides `_trackable_children` and before TF's trackable.
  """

  if not HAS_ADAPTER_HOOK:

    def _checkpoint_adapter(self, path: str) -> Any:
      del path  # TF's own per-object adapters (SparseCore's) do not exist on these versions
      return None

    def _trackable_children(self, save_type="checkpoint", **kwargs):
      path = _restoring_into(self)
      if path is not None:
        self._checkpoint_adapter(path)
      return super()._trackable_children(save_type, **kwargs)


def _restoring_into(trackable: Any) -> Optional[str]:
  """The checkpoint path if TF's restore walk is visiting `trackable` (a caller a few frames up
  is RESTORE_WALK with `trackable` at its position), else None."""
  frame = sys._getframe(2)
  for _ in range(_FRAMES_SEARCHED):
    if frame is None:
      return None
    if frame.f_code.co_name == RESTORE_WALK:
      position = frame.f_locals.get(POSITION_LOCAL)
      if position is None:
        raise _machinery_changed(trackable)
      return position.checkpoint.save_path_string if position.trackable is trackable else None
    frame = frame.f_back
  return None
