"""Restore a whole model from a checkpoint, or nothing of it.

`tf.train.Checkpoint.restore` writes each variable as soon as it reaches it: when a later one
does not fit (a Dense kernel of another shape), the variables before it are already restored
and the model is left half old, half new. A damaged file fails the same way, midway, with
TensorFlow's low-level message. `restore_checkpoint` first reads the whole checkpoint with TF's
reader (`tf.train.load_checkpoint`: the index, then every value) and matches the checkpoint's
object graph against the model's, as TF's restore does (children by name, from the root), and
checks each variable it matches (shape, dtype), and that every variable of the model is in the
checkpoint (what TF's `assert_existing_objects_matched` asks for, but only after writing); only
when all of that passes does it let TF's own restore write. The embedding layers' own hook
(`tpu_embedding.checkpoints`) checks their tables and slots, as in any restore: it runs before
TF writes anything, and maps tf-recommenders' names, so their variables are left to it here.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Union

import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.layer_core import TPUEmbeddingCore
from tpu_embedding.partial_core import PartialTPUEmbeddingCore

__all__ = ["restore_checkpoint"]

_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_VARIABLE_VALUE = "VARIABLE_VALUE"
_NOTHING_CHANGED = "Nothing was restored: every variable of the model is unchanged."


def restore_checkpoint(
  checkpoint_or_model: Any,
  path: Union[str, os.PathLike],
  *,
  allow_missing: Union[bool, Iterable[str]] = False,
) -> Any:
  """Restores `path` into `checkpoint_or_model` only if every variable of the model is in the
  checkpoint and fits it; returns TF's load status.

  Args:
    checkpoint_or_model: the `tf.train.Checkpoint` the checkpoint was saved with (same
      structure), or a model, read as `tf.train.Checkpoint(model=model)` (the README's way).
    path: a checkpoint prefix (`.../ckpt-3`) or a directory (its latest checkpoint).
    allow_missing: variables of the model that the checkpoint may lack (they keep their
      values): True for any, or paths as the error prints them (`model/optimizer/iter`), each
      also allowing every variable below it (`model/optimizer`).

  Raises:
    FileNotFoundError: no checkpoint at `path`.
    ValueError: a file of the checkpoint cannot be read (truncated, damaged), a variable has
      another shape or dtype in the checkpoint than in the model, or a variable of the model is
      not in the checkpoint; the message lists them all.
    In every case nothing was written.
  """
  root = checkpoint_or_model
  if not isinstance(root, tf.train.Checkpoint):
    root = tf.train.Checkpoint(model=checkpoint_or_model)
  prefix = _prefix(path)
  reader = _reader(prefix)
  if not reader.has_tensor(_OBJECT_GRAPH_KEY):  # nothing to match the model's variables with
    raise ValueError(
      f"Cannot restore the checkpoint {prefix!r}: it holds no object graph (it was written by "
      f"a name-based tf.compat.v1 Saver); restore it with that Saver. {_NOTHING_CHANGED}"
    )
  problems, matched = _mismatches(root, reader)
  if allow_missing is not True:
    allowed = () if allow_missing is False else tuple(allow_missing)
    problems += _missing(root, matched, allowed)
  if problems:
    raise ValueError(
      f"Cannot restore the checkpoint {prefix!r}:\n  - "
      + "\n  - ".join(problems)
      + f"\n{_NOTHING_CHANGED} Restore a checkpoint written by the same model."
    )
  return root.restore(prefix)


def _prefix(path: Union[str, os.PathLike]) -> str:
  path = os.fsdecode(os.fspath(path))
  if tf.io.gfile.isdir(path):
    latest = tf.train.latest_checkpoint(path)
    if latest is None:
      raise FileNotFoundError(f"{path!r} is a directory with no checkpoint. {_NOTHING_CHANGED}")
    return latest
  if not tf.io.gfile.exists(f"{path}.index"):
    raise FileNotFoundError(
      f"No checkpoint at {path!r}: {path}.index does not exist (pass the prefix, e.g. "
      f"'.../ckpt-3', or its directory). {_NOTHING_CHANGED}"
    )
  return path


def _reader(prefix: str) -> Any:
  """TF's reader of the checkpoint, once every value in it has been read once."""
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (tf.errors.OpError, ValueError) as error:
    raise ValueError(
      f"Cannot read the checkpoint {prefix!r}: its index file {prefix}.index is damaged or "
      f"truncated (TensorFlow: {_first_line(error)}). {_NOTHING_CHANGED}"
    ) from None
  data = sorted(tf.io.gfile.glob(f"{prefix}.data-*"))
  for key in sorted(reader.get_variable_to_shape_map()):
    try:
      reader.get_tensor(key)
    except (tf.errors.OpError, ValueError, IndexError) as error:
      raise ValueError(
        f"Cannot read the checkpoint {prefix!r}: its data file(s) {data} are damaged or "
        f"truncated; the value of {key!r} cannot be read (TensorFlow: {_first_line(error)}). "
        f"{_NOTHING_CHANGED}"
      ) from None
  return reader


def _first_line(error: BaseException) -> str:
  text = getattr(error, "message", None) or str(error)
  return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _mismatches(root: Any, reader: Any) -> tuple[list[str], set[int]]:
  """(each variable that the checkpoint's object graph and the model's share, by path from the
  root, and whose shape or dtype differs; the ids of every variable of the model so matched)."""
  graph = tf_internals.object_graph(reader.get_tensor(_OBJECT_GRAPH_KEY))
  shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
  problems = []
  matched = set()
  pending = [(0, root, "")]
  seen = {0}
  while pending:
    node_id, obj, where = pending.pop(0)
    node = graph.nodes[node_id]
    for attribute in node.attributes:
      if attribute.name == _VARIABLE_VALUE and isinstance(obj, tf.Variable):
        matched.add(id(obj))
        key = attribute.checkpoint_key
        stored_shape, stored_dtype = shapes.get(key), dtypes.get(key)
        if stored_shape is not None and list(stored_shape) != obj.shape.as_list():
          problems.append(
            f"{where} has shape {obj.shape.as_list()} in the model but {list(stored_shape)} "
            "in the checkpoint"
          )
        elif stored_dtype is not None and stored_dtype != obj.dtype:
          problems.append(
            f"{where} has dtype {obj.dtype.name} in the model but {stored_dtype.name} in the "
            "checkpoint"
          )
    children = tf.train.TrackableView(obj).children(obj)
    for reference in node.children:
      child = children.get(reference.local_name)
      if child is None or reference.node_id in seen:
        continue
      seen.add(reference.node_id)
      pending.append((reference.node_id, child, f"{where}/{reference.local_name}".lstrip("/")))
  return problems, matched


def _missing(root: Any, matched: set[int], allowed: tuple[str, ...]) -> list[str]:
  """Each variable of the model, by its first path from the root, that the checkpoint does not
  hold (not in `matched`) and that `allowed` does not name. The embedding layers' variables are
  left to the layers' own restore hook, which refuses a missing table or slot before TF writes
  anything and reads tf-recommenders' checkpoints, whose names differ."""
  problems = []
  pending = [(root, "")]
  seen = {id(root)}
  while pending:
    obj, where = pending.pop(0)
    if isinstance(obj, (TPUEmbeddingCore, PartialTPUEmbeddingCore)):
      continue
    if isinstance(obj, tf.Variable) and id(obj) not in matched:
      if not any(where == a or where.startswith(f"{a.rstrip('/')}/") for a in allowed):
        problems.append(
          f"{where} (shape {obj.shape.as_list()}, {obj.dtype.name}) is in the model but not in "
          "the checkpoint (allow_missing= lets it keep its value)"
        )
    for name, child in tf.train.TrackableView(obj).children(obj).items():
      if id(child) not in seen:
        seen.add(id(child))
        pending.append((child, f"{where}/{name}".lstrip("/")))
  return problems
