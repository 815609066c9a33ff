"""Export a model holding `TPUEmbedding` layers as a SavedModel for CPU serving.

The export holds the signatures and exactly the variables they read (plus, on request, more
tables and the tables' optimizer slots); nothing else of the training model. It is written to a
temporary directory next to the target and moved into place in one rename, so the target path
never holds a half-written model.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from typing import Any, Iterable, Mapping, Optional, Union

import tensorflow as tf

from tpu_embedding import hardware, quantization, tf_internals
from tpu_embedding.engine.lookup import exporting, reading_tables
from tpu_embedding.layer_core import TPUEmbeddingCore

TableConfig = tf.tpu.experimental.embedding.TableConfig

DEFAULT_SIGNATURE = "serving_default"
# Kernels registered for DEVICE_DEFAULT run on every device, CPU included.
_CPU_DEVICE_TYPES = frozenset({"CPU", "DEFAULT"})


def export_for_serving(
  model: tf.Module,
  export_dir: str,
  signatures: Union[Any, Mapping[str, Any]],
  *,
  include_optimizer_slots: bool = False,
  tables: Union[None, str, Iterable[Union[TableConfig, str]]] = None,
  overwrite: bool = False,
  table_dtype: Union[None, str, Mapping[Union[str, TableConfig], Optional[str]]] = None,
) -> str:
  """Writes `model`'s serving signatures to `export_dir` as a SavedModel; returns the path.

  Args:
    model: the model (any `tf.Module`, e.g. a tf-keras model) whose `TPUEmbedding` layers and
      other variables the signatures read.
    export_dir: a local directory that must not exist yet (unless `overwrite`): a str, bytes or
      os.PathLike, as for `tf.saved_model.save`.
    signatures: a `tf.function` with an `input_signature` (exported as "serving_default"), or a
      dict {signature name: such a function}. The functions call the model as in training code;
      the graph they trace must hold only ops with a CPU kernel.
    include_optimizer_slots: also export the optimizer slots of every exported table (to resume
      training from the export); off by default, which makes the export smaller.
    tables: which embedding tables the export holds. None: exactly the tables the signatures
      read. "all": every table of every `TPUEmbedding` layer in `model`, read or not. A list of
      `TableConfig`s (the objects given to the layer) or table names: exactly these; a signature
      reading a table not listed is refused, which guards against shipping a table by mistake.
      Every exported table is reachable as `loaded.embedding_tables[<table name>]`.
    overwrite: replace an existing export at `export_dir`: a directory holding a SavedModel and
      nothing else; any other file or directory there is refused and left as it is. The replacement
      is atomic where the OS can exchange two directories (Linux); elsewhere the old export is moved
      aside, the new one moved in, then the old one deleted.
    table_dtype: how the exported tables store their rows: None (float32), "float16",
      "bfloat16", "int8" or "int4" (row-wise codes with a float32 scale and bias per row, as
      FBGEMM's; see `tpu_embedding.quantization`) for every table, or {table name or
      TableConfig: dtype} (tables not named stay float32). The signatures gather the stored rows
      (int8/int4: codes, scale and bias in one fused row, one gather) and decode them to float32
      with TensorFlow ops; `loaded.embedding_tables[name]()` gives a low-precision table's
      decoded float32 values, and `.stored()` its codes (and scales and biases).
      `tpu_embedding.serving_error_by_dtype` measures what each choice changes in a model's
      outputs.

  Returns:
    The absolute path of the export.

  Raises:
    FileExistsError: `export_dir` exists and `overwrite` is False, or it is not a SavedModel
      directory (overwrite replaces only an earlier export, never another directory or file).
    ValueError: a signature has no input_signature, reads a table not in `tables`, or its graph
      holds an op without a CPU kernel (e.g. a TPU op); `table_dtype` names an unknown dtype or
      table, or a table it lowers holds NaN, inf or values beyond the dtype's range.
  """
  target = _target_path(export_dir)
  if os.path.lexists(target):
    if not overwrite:
      raise _exists(target)
    _check_replaceable(target)
  layers = embedding_layers(model)
  _refuse_sparse_core(layers)
  owners = _embedding_variables(layers)
  every = {name for name, slot in owners.values() if slot is None}
  formats = quantization.formats_by_table(table_dtype, every, lambda t: _name_of(t, layers))
  _refuse_slots_of_lowered_tables(include_optimizer_slots, formats)
  for layer in layers:
    layer.flush()  # apply updates still held back by pipelining before reading the tables
  values = _grouped(owners)
  lowered = {
    name: quantization.LowPrecisionTable(name, _table_value(values[name, None]), format)
    for name, format in sorted(formats.items())
  }
  with exporting(), reading_tables(lowered):  # the fewest ops per request (serving on CPU)
    functions = _concrete_signatures(signatures)
  _check_cpu_only(functions)

  copies = _per_device_copies(owners)
  read = _read_variables(functions, {**owners, **copies})
  _refuse_float32_reads_of_lowered_tables(read, {**owners, **copies}, functions, lowered)
  read_by = {**owners, **copies, **_lowered_variables(lowered)}
  needed = {read_by[r][0] for r in read if r in read_by and read_by[r][1] is None}
  kept = _kept_tables(tables, layers, owners, needed)

  root = tf.Module()
  grouped = sorted(values.items(), key=lambda item: (item[0][0], item[0][1] or ""))
  root.embedding_tables = {
    name: lowered.get(name, value)
    for (name, slot), value in grouped
    if slot is None and name in kept
  }
  if include_optimizer_slots:
    slots: dict[str, dict[str, Any]] = {}
    for (name, slot), value in grouped:
      if slot is not None and name in kept:
        slots.setdefault(name, {})[slot] = value
    root.optimizer_slots = slots
  root.model_variables = [v for r, v in read.items() if r not in read_by]
  # Managed tables' key -> row maps, which serving signatures read (lookups only).
  root.managed_ids = {
    layer.name: {table: id_map.serving_tables() for table, id_map in layer.managed_ids.items()}
    for layer in layers
    if layer.managed_ids
  }

  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
  try:
    _chmod_as_umask(staging)  # mkdtemp makes it private; the export gets normal permissions
    _write_saved_model(root, staging, functions)
    _sync_tree(staging)
    _commit(staging, target, overwrite)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return target


# ---------------------------------------------------------------------------------------------
# Where to export

# What a SavedModel directory may hold (tf.saved_model.save and tf_keras write these).
_SAVED_MODEL_ENTRIES = frozenset(
  {
    "saved_model.pb",
    "saved_model.pbtxt",
    "variables",
    "assets",
    "fingerprint.pb",
    "keras_metadata.pb",
  }
)


def _target_path(export_dir: Any) -> str:
  """The absolute export path; an empty path (which would mean the current directory) is refused."""
  try:
    path = os.fspath(export_dir)
  except TypeError:
    raise TypeError(
      f"export_dir={export_dir!r}: expected a path (str or os.PathLike) naming "
      "the directory to write the SavedModel to."
    ) from None
  path = os.fsdecode(path)  # bytes name a path too, as in tf.saved_model.save
  if not path.strip():
    raise ValueError("export_dir is empty; name the directory to write the SavedModel to.")
  return os.path.abspath(path)


def _exists(target: str) -> FileExistsError:
  """The refusal of an existing `target` without overwrite (checked first, and again where the
  rename finds that another process created it meanwhile)."""
  return FileExistsError(
    f"{target} already exists; pass overwrite=True to replace that export or choose another "
    "directory."
  )


def _check_replaceable(target: str) -> None:
  """Refuses to overwrite anything but a directory holding a SavedModel and nothing else."""
  if os.path.islink(target) or not os.path.isdir(target):
    raise FileExistsError(
      f"{target} exists and is not a SavedModel directory; overwrite=True "
      "replaces only an earlier export. Choose another export_dir."
    )
  entries = set(os.listdir(target))
  foreign = sorted(entries - _SAVED_MODEL_ENTRIES)
  if not {"saved_model.pb", "saved_model.pbtxt"} & entries or foreign:
    what = (
      f"it holds files a SavedModel does not: {foreign[:5]}"
      if foreign
      else "it holds no saved_model.pb"
    )
    raise FileExistsError(
      f"{target} is not a SavedModel directory ({what}); overwrite=True "
      "replaces only an earlier export, so nothing was changed. Choose "
      "another export_dir or remove that directory yourself."
    )


# ---------------------------------------------------------------------------------------------
# What to export


def embedding_layers(model: tf.Module) -> list[TPUEmbeddingCore]:
  """The `TPUEmbedding` layers of either Keras flavour in `model`."""
  # tf.Module and tf-keras list their submodules; a Keras 3 model is walked as a trackable.
  submodules = getattr(model, "submodules", None)
  if submodules is None:
    submodules = tf.train.TrackableView(model).descendants()
  found = [model] if isinstance(model, TPUEmbeddingCore) else []
  found += [m for m in submodules if isinstance(m, TPUEmbeddingCore)]
  return list({id(layer): layer for layer in found}.values())


def _refuse_sparse_core(layers: list[TPUEmbeddingCore]) -> None:
  """A SparseCore layer's variables are TF's stacked, padded, row-dealt stacks: an export of
  them could not hold its tables by name (`embedding_tables`, `tables=`)."""
  for layer in layers:
    if layer.execution_path is hardware.ExecutionPath.TPU_V2:
      raise ValueError(
        f"The TPUEmbedding layer {layer.name!r} is on SparseCore (path "
        f"{layer.execution_path.name}): its variables are TensorFlow's stacked, padded tables, "
        "which export_for_serving "
        "cannot export by table name. Write a checkpoint of the model, restore it into the "
        "same model built off TPU with tpu_embedding.sparse_core.restore_from_checkpoint("
        "path, '<path to the layer>/_tpu_embedding', cpu_layer.variables_by_table), and "
        "export that model. Nothing was written."
      )


def _concrete_signatures(signatures: Any) -> dict[str, Any]:
  if not isinstance(signatures, Mapping):
    signatures = {DEFAULT_SIGNATURE: signatures}
  if not signatures:
    raise ValueError(
      "signatures is empty: an export without a signature serves nothing. Pass a tf.function "
      "with an input_signature, or a dict {signature name: such a function}. Nothing was "
      "written."
    )
  functions = {}
  for name, function in signatures.items():
    if isinstance(function, tf.types.experimental.ConcreteFunction):
      functions[name] = function
      continue
    if getattr(function, "input_signature", None) is None:
      raise ValueError(
        f"Signature {name!r} must be a tf.function with an input_signature "
        "(a list of tf.TensorSpec), so its inputs are known at export."
      )
    # Traced afresh, so that the user's function keeps its own traces: one traced for the
    # export has no gradient trap and may leave the id-range check to a CPU gather.
    functions[name] = tf_internals.untraced_copy(function).get_concrete_function()
  return functions


def _embedding_variables(layers: list[TPUEmbeddingCore]) -> dict[Any, tuple[str, Optional[str]]]:
  """{variable ref: (table name, slot name or None)} over every layer's tables and slots.

  A V1 table is a sharded variable (one row block per TPU host); its blocks are the variables a
  signature reads, so each is owned. One block is exported as the table, several as a list.
  """
  owners: dict[Any, tuple[str, Optional[str]]] = {}
  for layer in layers:
    for table, entries in layer.variables_by_table.items():
      for slot, variable in entries.items():
        key = (table, None if slot == "parameters" else slot)
        parts = _row_blocks(variable)
        if key in owners.values() and owners.get(parts[0].ref()) != key:
          raise ValueError(
            f"Two TPUEmbedding layers of this model have a table named {table!r}; "
            "give the tables unique names to export them."
          )
        for part in parts:
          owners[part.ref()] = key
  return owners


def _per_device_copies(
  owners: Mapping[Any, tuple[str, Optional[str]]],
) -> dict[Any, tuple[str, Optional[str]]]:
  """{ref of a per-device copy: its variable's (table, slot)}: a function traced under a
  `MirroredStrategy` reads the copy of its device, not the mirrored variable itself."""
  copies = {}
  for ref, key in owners.items():
    variable = ref.deref()
    if isinstance(variable, tf.distribute.DistributedValues):
      for copy in tf.nest.flatten(variable.values):
        copies[copy.ref()] = key
  return copies


def _row_blocks(variable: Any) -> list[tf.Variable]:
  return list(getattr(variable, "variables", None) or [variable])


def _grouped(
  owners: Mapping[Any, tuple[str, Optional[str]]],
) -> dict[tuple[str, Optional[str]], Any]:
  """{(table, slot): the variable, or the list of its row blocks in row order}."""
  grouped: dict[tuple[str, Optional[str]], list] = {}
  for ref, key in owners.items():
    grouped.setdefault(key, []).append(ref.deref())
  return {key: parts[0] if len(parts) == 1 else parts for key, parts in grouped.items()}


def _read_variables(functions: Mapping[str, Any], tables: Mapping[Any, Any]) -> dict[Any, Any]:
  """{ref: variable} over the variables the functions read, and the variables of `tables` whose
  handle they capture (a read inside a nested function, which `variables` may not list)."""
  read = {}
  for function in functions.values():
    for variable in function.variables:
      read.setdefault(variable.ref(), variable)
  captured = {id(t) for function in functions.values() for t in function.captured_inputs}
  for ref in tables:
    variable = ref.deref()
    if (
      not isinstance(variable, tf.distribute.DistributedValues) and id(variable.handle) in captured
    ):
      read.setdefault(ref, variable)
  return read


def _table_value(value: Any) -> tf.Tensor:
  """A table's float32 rows: its variable, or the list of its row blocks (`_grouped`) joined."""
  blocks = value if isinstance(value, list) else [value]
  return tf.concat([tf.convert_to_tensor(block) for block in blocks], 0)


def _refuse_slots_of_lowered_tables(include_slots: bool, formats: Mapping[str, Any]) -> None:
  if include_slots and formats:
    raise ValueError(
      "include_optimizer_slots=True exports the slots to resume training, which needs the "
      f"float32 tables, but table_dtype lowers the table(s) {sorted(formats)}. Export them "
      "float32 to resume training, or leave the slots out. Nothing was written."
    )


def _lowered_variables(lowered: Mapping[str, Any]) -> dict[Any, tuple[str, None]]:
  """{variable ref: (table name, None)} over the low-precision tables' variables."""
  return {v.ref(): (name, None) for name, table in lowered.items() for v in table.variables}


def _refuse_float32_reads_of_lowered_tables(
  read: Mapping[Any, Any],
  owners: Mapping[Any, tuple[str, Optional[str]]],
  functions: Mapping[str, Any],
  lowered: Mapping[str, Any],
) -> None:
  """A lowered table must be read only through the layer's lookups, which gather its stored
  rows: a signature reading its float32 variable (directly, or in a lookup traced before the
  export, such as a ConcreteFunction) would keep the float32 table in the export."""
  stale = sorted({owners[r][0] for r in read if r in owners and owners[r][0] in lowered})
  if stale:
    raise ValueError(
      f"The signatures {sorted(functions)} read the float32 variable of table(s) {stale}, "
      "which table_dtype lowers: only the TPUEmbedding layer's lookups, traced by the export, "
      "read the lowered rows. Pass the signatures as tf.functions (not concrete functions), "
      "read the tables through the layer, call a layer with managed ids with "
      "training=False (admitting keys writes the table), or leave these tables float32. "
      "Nothing was written."
    )


def _kept_tables(
  tables: Any, layers: list[TPUEmbeddingCore], owners: Mapping[Any, Any], needed: set[str]
) -> set[str]:
  every = {name for name, slot in owners.values() if slot is None}
  if tables is None:
    return needed
  if isinstance(tables, str) or not isinstance(tables, Iterable):
    if tables != "all":
      raise ValueError(
        f"tables={tables!r}: expected None, 'all', or a list of TableConfigs or table names."
      )
    return every
  kept = set()
  for table in tables:
    name = table if isinstance(table, str) else _name_of(table, layers)
    if name not in every:
      raise ValueError(
        f"tables= names {name!r}, which no TPUEmbedding layer of the model has; "
        f"its tables are {sorted(every)}."
      )
    kept.add(name)
  missing = sorted(needed - kept)
  if missing:
    raise ValueError(
      f"The signatures read the table(s) {missing}, which tables= does not list "
      f"({sorted(kept)}). Add them to tables=, or pass tables=None to export "
      "exactly the tables the signatures read."
    )
  return kept


def _name_of(table: Any, layers: list[TPUEmbeddingCore]) -> str:
  for layer in layers:
    found = layer.embedding_config.find_table(table)
    if found is not None:
      return found.name
  raise ValueError(
    f"tables= holds a TableConfig ({table!r}) that no TPUEmbedding layer of the "
    "model was built with."
  )


def _check_cpu_only(functions: Mapping[str, Any]) -> None:
  """Refuses graphs holding an op without a CPU kernel (TPU ops, for instance)."""
  for name, function in functions.items():
    graph_def = function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for library_function in graph_def.library.function:
      nodes.extend(library_function.node_def)
    missing = sorted({node.op for node in nodes if not _has_cpu_kernel(node.op)})
    if missing:
      raise ValueError(
        f"Signature {name!r} uses ops with no CPU kernel: {missing}. Export for "
        "serving on CPU: call the model outside any TPU strategy (the layer "
        "then looks its tables up with CPU ops)."
      )


def _has_cpu_kernel(op: str) -> bool:
  return bool(tf_internals.kernel_device_types(op) & _CPU_DEVICE_TYPES)


# ---------------------------------------------------------------------------------------------
# Writing


def _write_saved_model(root: tf.Module, directory: str, functions: Mapping[str, Any]) -> None:
  # The training gradient of the layer (its trap) updates tables and slots; a serving export
  # must not trace it, so custom gradients are not saved.
  options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
  tf.saved_model.save(root, directory, signatures=dict(functions), options=options)


def _chmod_as_umask(directory: str) -> None:
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(directory, 0o777 & ~umask)


def _sync_tree(directory: str) -> None:
  """fsyncs every file and directory, so the rename never exposes unwritten data."""
  for folder, _, files in os.walk(directory):
    for name in files:
      with open(os.path.join(folder, name), "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(source: str, target: str, flags: int) -> bool:
  """Linux renameat2(2); False where the OS or the filesystem does not offer it."""
  function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
  if function is None:
    return False
  if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
    return True
  error = ctypes.get_errno()
  if error in (errno.ENOSYS, errno.EINVAL):
    return False
  if error == errno.EEXIST:
    raise _exists(target)
  raise OSError(error, os.strerror(error), target)


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  else:
    os.remove(path)


def _commit(staging: str, target: str, overwrite: bool) -> None:
  """Moves the finished export into place in one step."""
  if overwrite and os.path.lexists(target):
    if not _renameat2(staging, target, _RENAME_EXCHANGE):
      aside = tempfile.mkdtemp(
        prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target)
      )
      os.rename(target, os.path.join(aside, "export"))
      os.rename(staging, target)
      staging = aside
    _remove(staging)  # now the previous export
  elif not _renameat2(staging, target, _RENAME_NOREPLACE):
    if os.path.lexists(target):
      raise _exists(target)
    os.rename(staging, target)
  _fsync_dir(os.path.dirname(target))
