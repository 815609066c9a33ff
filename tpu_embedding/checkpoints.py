"""All-or-nothing restores for the embedding engine's tables and slots, tf-recommenders' included.

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
engine in the checkpoint (needed to tell two engines in one model apart) and the checkpoint's object
graph come from `tf_restore`, the one module that reads TF's restore internals; if a later TF moves
them, the restore is refused there with an error naming the TF version it was checked against.

Checkpoints written by tf-recommenders 0.7.7 name things differently (slots owned by the Keras
optimizer; `PartialTPUEmbedding`'s replicated tables inside Keras `Embedding` layers). The same
hook maps them: TF walks an object's children only after the hook returns, so references added
to the checkpoint's object graph there are restored by TF's own machinery, with its shape checks.
"""

from __future__ import annotations

from typing import Any, Optional

from tpu_embedding import checkpoint_names, optimizer_specs, tf_restore
from tpu_embedding import config as config_lib

_KERAS_LAYERS = checkpoint_names.TFRS_KERAS_LAYERS_KEY


def expected_shapes(config: Any, with_slots: bool) -> dict[str, tuple[str, list[int]]]:
  """{dependency name: (table name, shape)} for every variable the engine tracks.

  The table under `<table>`, each slot under `<table>/<slot>` (`checkpoint_names.variable_key`),
  as the engine tracks them, unless a `slot_variable_creation_fn` owns the slots.
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
      shapes[checkpoint_names.variable_key(table.name, name)] = (table.name, shape)
  return shapes


def validate(
  trackable: Any,
  config: Any,
  with_slots: bool,
  path: str,
  *,
  layer: str = "TPUEmbedding",
  tables_key: Optional[str] = None,
) -> None:
  """Raises ValueError unless the checkpoint at `path` holds every table (and slot) of `config`.

  Called from `trackable._checkpoint_adapter`, i.e. while TF is restoring and before it binds
  any of the trackable's children. The tables are children of `trackable` itself (the engine),
  or of its child `tables_key` (`PartialTPUEmbedding`). Extra entries in the checkpoint (slots a
  serving-only layer does not have) are allowed, as in the mid-level API. Checkpoints written by
  tf-recommenders are first mapped onto this package's names (`_adopt_tfrs_partial_layout`,
  `_adopt_keras_slots`); what cannot be mapped is refused below by name.
  """
  restore = tf_restore.restore_of(trackable)
  node = restore.node
  unslotted: set[str] = set()  # tables whose slots tf-recommenders had not created yet
  if tables_key is not None:
    node = _adopt_tfrs_partial_layout(restore, tables_key, config, unslotted)
  if node is None:
    problems = [f"no table of this layer is in the checkpoint (nothing under {tables_key!r})"]
  else:
    if with_slots:
      _adopt_keras_slots(restore, node, config, unslotted)
    problems = _problems(restore, node, config, with_slots, unslotted)
  if problems:
    restore.forget_pending_restores()
    raise ValueError(
      f"Cannot restore the checkpoint {path!r} into this {layer} layer:\n  - "
      + "\n  - ".join(problems)
      + "\nNo embedding table or slot was changed. Restore a checkpoint written by a layer "
      "with the same tables (names, vocabulary sizes, dims and optimizers)."
    )


def _problems(
  restore: tf_restore.Restore, node: Any, config: Any, with_slots: bool, unslotted: set[str]
) -> list[str]:
  in_checkpoint = {child.local_name: child.node_id for child in node.children}
  problems = []
  for name, (table, shape) in expected_shapes(config, with_slots).items():
    what = f"table {table!r}" if name == table else f"slot {name!r} of table {table!r}"
    if name not in in_checkpoint and name != table and table in unslotted:
      # Left at its initial value, as tf-recommenders' first step would create it; an empty
      # node (no value) makes it an object of the checkpoint, as it is of tf-recommenders'
      # model, which has no such slot yet (`assert_existing_objects_matched`).
      restore.nodes.add()
      node.children.add(node_id=len(restore.nodes) - 1, local_name=name)
      continue
    if name not in in_checkpoint:
      problems.append(f"{what} (shape {shape} in this layer) is missing from the checkpoint")
      continue
    stored = restore.stored_shape(restore.nodes[in_checkpoint[name]])
    if stored is not None and stored != shape:
      problems.append(f"{what} has shape {shape} in this layer but {stored} in the checkpoint")
  return problems


# ---------------------------------------------------------------------------------------------
# Checkpoints written by tf-recommenders 0.7.7


def _adopt_keras_slots(
  restore: tf_restore.Restore, node: Any, config: Any, unslotted: set[str]
) -> None:
  """Makes the Keras optimizer's slots of each table also the engine's `<table>/<slot>`.

  tf-recommenders creates table slots through the Keras optimizer (on CPU and on TPU), so its
  checkpoints record them as that optimizer's slots of the table (`<table>/.OPTIMIZER_SLOT/
  <optimizer>/accumulator`). Each one whose mid-level twin the engine expects becomes a child of
  the engine's node under the engine's name; the Keras optimizer is told not to restore it into
  a slot of its own, since the engine, not the Keras optimizer, trains these tables.

  A table of `unslotted` (one of tf-recommenders' Keras `Embedding` layers) for which the
  checkpoint has no Keras slot at all stays there: its Keras optimizer creates slots only at the
  first step, so a checkpoint written before it has none. Any other table leaves it.
  """
  in_checkpoint = {child.local_name: child.node_id for child in node.children}
  keras_slots: dict[int, dict[str, int]] = {}
  for other in restore.nodes:
    for reference in other.slot_variables:
      keras_slots.setdefault(reference.original_variable_node_id, {})[reference.slot_name] = (
        reference.slot_variable_node_id
      )
  for table in config.tables:
    table_node = in_checkpoint.get(table.name)
    if table_node is None or table.optimizer is None:
      continue
    if keras_slots.get(table_node):
      unslotted.discard(table.name)  # tf-recommenders' first step has made its slots
    for name, _ in config_lib.slot_shapes(table):
      key = checkpoint_names.variable_key(table.name, name)
      slot_node = keras_slots.get(table_node, {}).get(
        optimizer_specs.keras_slot_name(table.optimizer, name)
      )
      if key in in_checkpoint or slot_node is None:
        continue
      node.children.add(node_id=slot_node, local_name=key)
      restore.skip_slot_restore(table_node, slot_node)


def _adopt_tfrs_partial_layout(
  restore: tf_restore.Restore, tables_key: str, config: Any, unslotted: set[str]
) -> Optional[Any]:
  """The node holding the tables under `tables_key`, built from tf-recommenders' layout if need be.

  tf-recommenders' `PartialTPUEmbedding` saves a replicated table as the Keras `Embedding` of
  each of its features (`_keras_embedding_layers/<feature>/embeddings`) and a sharded one inside
  its own `TPUEmbedding` layer (`_tpu_embedding/_tpu_embedding/<table>`). If the checkpoint has
  that layout, a node with this package's names (`<table>`) pointing at those variables is added
  to the checkpoint's object graph and put under `tables_key`. None if there is no such node.
  """
  nodes, proto = restore.nodes, restore.node
  tables_node = _child(proto, tables_key)
  if tables_node is not None and any(
    _child(nodes[tables_node], table.name) is not None for table in config.tables
  ):
    return nodes[tables_node]  # this package's layout (which also has tf-recommenders' names)
  tfrs_sharded = _follow(nodes, proto, tables_key, checkpoint_names.TABLES_KEY)
  if _child(proto, _KERAS_LAYERS) is None and tfrs_sharded is None:
    return None if tables_node is None else nodes[tables_node]
  adopted = nodes.add()
  for table in config.tables:
    candidates = [(tables_key, checkpoint_names.TABLES_KEY, table.name)] + [
      (_KERAS_LAYERS, feature.path, checkpoint_names.TFRS_KERAS_EMBEDDINGS_KEY)
      for feature in config.features_of(table)
    ]
    found = [(names, _follow(nodes, proto, *names)) for names in candidates]
    names, node_id = next(((n, i) for n, i in found if i is not None), (None, None))
    if node_id is not None:
      adopted.children.add(node_id=node_id, local_name=table.name)
      if names[0] == _KERAS_LAYERS:
        unslotted.add(table.name)  # decided by `_adopt_keras_slots`
  _put_under(proto, tables_key, len(nodes) - 1)
  return adopted


def _child(node: Any, name: str) -> Optional[int]:
  """The id of `node`'s child called `name` in a checkpoint's object graph."""
  for reference in node.children:
    if reference.local_name == name:
      return reference.node_id
  return None


def _follow(nodes: Any, node: Any, *names: str) -> Optional[int]:
  """The id of the node reached from `node` through children called `names`, in order."""
  node_id = None
  for name in names:
    node_id = _child(node, name)
    if node_id is None:
      return None
    node = nodes[node_id]
  return node_id


def _put_under(proto: Any, key: str, node_id: int) -> None:
  """Makes `node_id` the child `key` of `proto`, replacing one of that name."""
  for reference in proto.children:
    if reference.local_name == key:
      reference.node_id = node_id
      return
  proto.children.add(node_id=node_id, local_name=key)
