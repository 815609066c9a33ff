"""All-or-nothing restores for the embedding engine's tables and slots.

TF restores a checkpoint object by object: a table whose shape changed fails only when its own
value is assigned (after other variables may have been), and a table missing from the checkpoint
is silently left at its initial value. The engine instead checks every one of its variables
against the checkpoint before TF binds any of them, and refuses the restore with one message
naming each table and both shapes.

Where the check runs: TF 2.21 walks the checkpoint's object graph breadth first and, for each
object it reaches, asks `Trackable._checkpoint_adapter(path)` (the per-object restore hook) before
it looks at the object's children. Values are assigned only after the whole walk (or, for
variables not created yet, when they are created), so raising from that hook leaves every
variable of the engine untouched. The hook receives only the checkpoint path; the position of the
engine in the checkpoint (needed to tell two engines in one model apart) is the `checkpoint_position`
of its caller, `restore._maybe_get_adapter`. If a later TF changes that, `validate` says so with
a warning and the restore proceeds with TF's own per-variable checks.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import tensorflow as tf
from absl import logging

from tpu_embedding import config as config_lib

VARIABLE_VALUE = "VARIABLE_VALUE"


def expected_shapes(config: Any, with_slots: bool) -> dict[str, tuple[str, list[int]]]:
  """{dependency name: (table name, shape)} for every variable the engine tracks.

  Mirrors `EmbeddingEngine._create_table`: the table under `<table>`, each slot under
  `<table>/<slot>` unless a `slot_variable_creation_fn` owns the slots.
  """
  shapes = {}
  for table in config.tables:
    full = [table.vocabulary_size, table.dim]
    shapes[table.name] = (table.name, full)
    optimizer = table.optimizer
    if not with_slots or optimizer is None:
      continue
    if getattr(optimizer, "slot_variable_creation_fn", None) is not None:
      continue
    for name, shape in config_lib.slot_shapes(table):
      shapes[f"{table.name}/{name}"] = (table.name, shape)
  return shapes


def validate(engine: tf.Module, config: Any, with_slots: bool, path: str) -> None:
  """Raises ValueError unless the checkpoint at `path` holds every variable of `engine`.

  Called from `engine._checkpoint_adapter`, i.e. while TF is restoring and before it binds any
  of the engine's children. Extra entries in the checkpoint (slots a serving-only layer does not
  have) are allowed, as in the mid-level API.
  """
  position = _position_of(engine)
  if position is None:
    logging.warning("tpu_embedding: could not find the checkpoint position of the embedding "
                    "engine in this TensorFlow version; the restore of %s is not pre-validated.",
                    path)
    return
  coordinator = position.checkpoint
  nodes = coordinator.object_graph_proto.nodes
  in_checkpoint = {child.local_name: child.node_id for child in position.object_proto.children}
  problems = []
  for name, (table, shape) in expected_shapes(config, with_slots).items():
    what = f"table {table!r}" if name == table else f"slot {name!r} of table {table!r}"
    if name not in in_checkpoint:
      problems.append(f"{what} (shape {shape} in this layer) is missing from the checkpoint")
      continue
    stored = _stored_shape(coordinator, nodes[in_checkpoint[name]])
    if stored is not None and stored != shape:
      problems.append(f"{what} has shape {shape} in this layer but {stored} in the checkpoint")
  if problems:
    _forget_pending_restores(coordinator)
    raise ValueError(
        f"Cannot restore the checkpoint {path!r} into this TPUEmbedding layer:\n  - "
        + "\n  - ".join(problems)
        + "\nNo embedding table or slot was changed. Restore a checkpoint written by a layer "
        "with the same tables (names, vocabulary sizes, dims and optimizers).")


def _position_of(engine: tf.Module) -> Optional[Any]:
  """The `CheckpointPosition` TF is expanding for `engine`, from the restore's call stack."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  for _ in range(6):  # validate <- _checkpoint_adapter <- restore._maybe_get_adapter
    if frame is None:
      return None
    position = frame.f_locals.get("checkpoint_position")
    try:
      if position is not None and position.trackable is engine:
        return position
    except (AttributeError, KeyError):
      pass
    frame = frame.f_back
  return None


def _stored_shape(coordinator: Any, node: Any) -> Optional[list[int]]:
  for attribute in node.attributes:
    if attribute.name == VARIABLE_VALUE:
      shape = coordinator.shape_map.get(attribute.checkpoint_key)
      return None if shape is None else list(shape)
  return None


def _forget_pending_restores(coordinator: Any) -> None:
  """Drops the refused checkpoint's deferred restores queued on objects visited so far.

  Objects not built yet (e.g. a Keras layer that has not been called) keep the checkpoint
  positions of their future variables and would restore them when built; after a refused
  restore they must not.
  """
  for trackable in list(coordinator.all_python_objects):
    deferred = getattr(trackable, "_deferred_dependencies", None)
    if not deferred:
      continue
    for name in list(deferred):
      kept = [p for p in deferred[name] if p.checkpoint is not coordinator]
      if kept:
        deferred[name] = kept
      else:
        del deferred[name]
