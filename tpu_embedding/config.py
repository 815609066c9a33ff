"""The user's feature configuration, cloned and checked once for every execution path.

The mid-level API writes defaults (table names, optimizers) into the configs it is given; we never
let that reach the user's objects. Every path (CPU engine, TPU V0/V1/V2, serving) receives the same
prepared view, so table order, names and per-table optimizers are decided in exactly one place.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tpu_embedding import optimizer_specs, optimizers, tf_internals

FeatureConfig = tf.tpu.experimental.embedding.FeatureConfig
TableConfig = tf.tpu.experimental.embedding.TableConfig

COMBINERS = ("sum", "mean", "sqrtn")


@dataclasses.dataclass(frozen=True)
class Feature:
  """One leaf of the feature nest: where it sits, its cloned config and table."""

  path: str
  config: FeatureConfig
  table: TableConfig

  @property
  def name(self) -> str:
    return self.path or self.config.name or "feature"


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
  """The prepared configuration shared by all execution paths.

  Attributes:
    user_feature_config: the nest the user passed, untouched.
    feature_config: the same nest holding clones, safe to hand to the mid-level API.
    features: the leaves in `tf.nest.flatten` order.
    tables: cloned tables in order of first use (the mid-level API's table order).
    user_tables: clone -> the user's own TableConfig, to key `embedding_tables` by the user's
      objects.
    optimizer: the layer-wide optimizer (mid-level), or None.
  """

  user_feature_config: Any
  feature_config: Any
  features: tuple[Feature, ...]
  tables: tuple[TableConfig, ...]
  user_tables: dict[TableConfig, TableConfig]
  optimizer: Optional[optimizer_specs.MidLevelOptimizer]

  def with_optimizers(
    self, optimizer_of: Callable[[TableConfig], Any], optimizer: Any
  ) -> EmbeddingConfig:
    """A new config whose tables are copies of these with `optimizer_of(table)` as optimizer
    and whose layer-wide optimizer is `optimizer`; this config and its tables stay as they are.

    For an execution path that needs the optimizers in another form (see `backends.conversion`).
    """
    copies = {}
    for table in self.tables:
      copies[table] = copy.copy(table)
      copies[table].optimizer = optimizer_of(table)
    features, leaves = [], []
    for feature in self.features:
      leaf = copy.copy(feature.config)
      leaf.table = copies[feature.table]
      features.append(Feature(path=feature.path, config=leaf, table=leaf.table))
      leaves.append(leaf)
    return EmbeddingConfig(
      user_feature_config=self.user_feature_config,
      feature_config=tf.nest.pack_sequence_as(self.feature_config, leaves),
      features=tuple(features),
      tables=tuple(copies.values()),
      user_tables={copies[clone]: user for clone, user in self.user_tables.items()},
      optimizer=optimizer,
    )

  def features_of(self, table: TableConfig) -> list[Feature]:
    return [f for f in self.features if f.table is table]

  def find_table(self, table: Any) -> Optional[TableConfig]:
    """This config's table for a user's `TableConfig`, one of its clones, or a table name.

    The one rule every module uses: the same object first (the user's or the clone), then the
    name; None when neither matches.
    """
    for clone, user in self.user_tables.items():
      if table is user or table is clone:
        return clone
    name = table if isinstance(table, str) else getattr(table, "name", None)
    return next((clone for clone in self.tables if clone.name == name), None)

  def resolve_table(self, table: Any) -> TableConfig:
    """`find_table`, refusing by name (and listing the tables) what matches none."""
    found = self.find_table(table)
    if found is None:
      name = table if isinstance(table, str) else getattr(table, "name", table)
      raise ValueError(
        f"Table {name!r} is not one of this layer's tables ({[t.name for t in self.tables]})."
      )
    return found


def prepare(feature_config: Any, optimizer: Any = None) -> EmbeddingConfig:
  """Clones and validates `feature_config`; resolves table names and optimizers."""
  paths_and_leaves = tf_internals.flatten_with_paths(feature_config)
  if not paths_and_leaves:
    raise ValueError(
      "feature_config is empty: pass at least one tf.tpu.experimental.embedding.FeatureConfig."
    )
  _check_leaves(paths_and_leaves, "feature_config")

  global_optimizer = optimizers.normalize_optimizer(optimizer, where="optimizer")
  clones: dict[TableConfig, TableConfig] = {}
  for path, leaf in paths_and_leaves:
    if leaf.table not in clones:
      clones[leaf.table] = _clone_table(leaf.table, len(clones), global_optimizer)
  _check_unique_names(clones)

  features = []
  cloned_leaves = []
  for path, leaf in paths_and_leaves:
    clone = copy.copy(leaf)
    clone.table = clones[leaf.table]
    features.append(Feature(path=path, config=clone, table=clone.table))
    cloned_leaves.append(clone)

  return EmbeddingConfig(
    user_feature_config=feature_config,
    feature_config=tf.nest.pack_sequence_as(feature_config, cloned_leaves),
    features=tuple(features),
    tables=tuple(clones.values()),
    user_tables={clone: user for user, clone in clones.items()},
    optimizer=global_optimizer,
  )


def _check_leaves(paths_and_leaves: Sequence[tuple[str, Any]], argument: str) -> None:
  """Refuses, by its place in the nest, a leaf of `argument` that is not a FeatureConfig."""
  for path, leaf in paths_and_leaves:
    if not isinstance(leaf, FeatureConfig):
      raise ValueError(
        f"{argument} entry {path or '<root>'!r} is a {type(leaf).__name__}; expected a "
        "tf.tpu.experimental.embedding.FeatureConfig."
      )


def slot_shapes(table: TableConfig) -> list[tuple[str, list[int]]]:
  """(slot name, shape) of each slot the table's optimizer needs, in the optimizer's order."""
  return optimizer_specs.slot_shapes(table.optimizer, table.vocabulary_size, table.dim)


def _clone_table(
  table: TableConfig, index: int, global_optimizer: Optional[optimizer_specs.MidLevelOptimizer]
) -> TableConfig:
  clone = copy.copy(table)
  if clone.name is None:
    clone.name = f"table_{index}"
  for field in ("vocabulary_size", "dim"):  # TF checks them when the config is made, not after
    value = getattr(table, field)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(
        f"Table {clone.name!r} has {field}={value!r} (changed after the TableConfig was made?); "
        "expected an int >= 1."
      )
    setattr(clone, field, int(value))
  combiner = getattr(table.combiner, "combiner", table.combiner)
  if not isinstance(combiner, str) or combiner not in COMBINERS:
    raise ValueError(
      f"Table {clone.name!r} has combiner {table.combiner!r}; expected one of "
      f"{', '.join(COMBINERS)}."
    )
  if isinstance(table.initializer, type):
    raise TypeError(
      f"Table {clone.name!r}: initializer is the class "
      f"{table.initializer.__name__}; pass an instance, e.g. "
      f"{table.initializer.__name__}()."
    )
  own = optimizers.normalize_optimizer(
    table.optimizer, where=f"TableConfig {clone.name!r}.optimizer"
  )
  clone.optimizer = own if own is not None else global_optimizer
  return clone


def _check_unique_names(clones: dict[TableConfig, TableConfig]) -> None:
  seen: dict[str, TableConfig] = {}
  for clone in clones.values():
    if clone.name in seen:
      raise ValueError(
        f"Two different TableConfig objects are both named {clone.name!r}. Table names must be "
        "unique; features that should share a table must reference the same TableConfig object."
      )
    seen[clone.name] = clone
  # The engine tracks each slot under `<table>/<slot>`, beside the tables (checkpoint keys).
  for clone in clones.values():
    for slot, _ in slot_shapes(clone):
      key = f"{clone.name}/{slot}"
      if key in seen:
        raise ValueError(
          f"Table name {key!r} is also the checkpoint name of the {slot!r} slot of table "
          f"{clone.name!r} (its {type(clone.optimizer).__name__} optimizer's); the two would "
          f"overwrite each other in checkpoints. Rename the table {key!r}; nothing was created."
        )


def match_structure(
  config: EmbeddingConfig, features: Any, what: str = "features", subset: bool = False
) -> list[tuple[Feature, Any]]:
  """Pairs each input leaf with its Feature, or explains the mismatch with both key sets."""
  expected = tf_internals.flatten_with_paths(config.feature_config)
  expected_by_path = {path: f for (path, _), f in zip(expected, config.features)}
  try:
    received = tf_internals.flatten_with_paths(features, expand_composites=False)
  except (TypeError, ValueError) as e:
    raise ValueError(f"Could not read the structure of {what}: {e}") from e
  received_paths = [p for p, _ in received]
  known = set(received_paths) <= set(expected_by_path)
  if not known or (not subset and len(received_paths) != len(expected_by_path)):
    raise ValueError(_mismatch_message(what, list(expected_by_path), received_paths))
  return [(expected_by_path[path], leaf) for path, leaf in received]


def weight_leaves(features: Any, weights: Any, count: int) -> list[Any]:
  """One weight (or None) per feature leaf, after checking both nests have one structure."""
  if weights is None:
    return [None] * count
  # Same keys, not only the same number of leaves: a misspelt key would otherwise pair a
  # weight with whichever feature sorts at its position.
  paths = lambda nest: [path for path, _ in tf_internals.flatten_with_paths(nest)]
  try:
    tf.nest.assert_same_structure(features, weights, check_types=False)
    same = paths(features) == paths(weights)
  except (TypeError, ValueError):
    same = False
  if not same:
    kinds = lambda nest: tf.nest.map_structure(lambda x: type(x).__name__, nest)
    raise ValueError(
      "The structure of weights does not match the structure of features: pass one weight "
      f"(or None) per feature, under the same keys.\n  features: {kinds(features)}\n  "
      f"weights:  {kinds(weights)}"
    )
  return tf.nest.flatten(weights)


def _mismatch_message(what: str, expected: Sequence[str], received: Sequence[str]) -> str:
  message = (
    f"The structure of {what} does not match feature_config.\n"
    f"  expected keys: {sorted(expected)}\n  received keys: {sorted(received)}"
  )
  for path in expected:
    inside = [p for p in received if not path or p.startswith(f"{path}/")]
    if inside and path not in received:
      message += (
        f"\nFeature {path or '<root>'!r} got a list or other nest of {len(inside)} entries "
        "where one tensor of ids was expected: as in tf.nest (and tf-recommenders), a Python "
        "list is a structure, not ids. Pass the ids as one tensor (e.g. tf.constant([...])), "
        "a NumPy array, a tf.RaggedTensor or a tf.SparseTensor."
      )
      break
  return message


def for_serving(serving_feature_config: Any, layer: EmbeddingConfig) -> EmbeddingConfig:
  """A serving config whose features read the layer's own tables.

  A serving table is matched to the layer's table by identity of the user's TableConfig object
  first, then by name; a table the layer does not have is refused by name.
  """
  features, leaves = [], []
  paths_and_leaves = tf_internals.flatten_with_paths(serving_feature_config)
  _check_leaves(paths_and_leaves, "serving_config")
  for path, leaf in paths_and_leaves:
    table = layer.find_table(leaf.table)
    if table is None:
      raise ValueError(
        f"serving_config feature {path or '<root>'!r} uses table "
        f"{leaf.table.name!r}, which this layer does not have; its tables are "
        f"{sorted(t.name for t in layer.tables)}."
      )
    served = (leaf.table.vocabulary_size, leaf.table.dim)
    if served != (table.vocabulary_size, table.dim):
      raise ValueError(
        f"serving_config feature {path or '<root>'!r} uses table {table.name!r} "
        f"with (vocabulary_size, dim) = {served}, but this layer's table has "
        f"{(table.vocabulary_size, table.dim)}."
      )
    clone = copy.copy(leaf)
    clone.table = table
    features.append(Feature(path=path, config=clone, table=table))
    leaves.append(clone)
  tables = tuple(dict.fromkeys(f.table for f in features))
  return EmbeddingConfig(
    user_feature_config=serving_feature_config,
    feature_config=tf.nest.pack_sequence_as(serving_feature_config, leaves),
    features=tuple(features),
    tables=tables,
    user_tables={t: layer.user_tables[t] for t in tables},
    optimizer=None,
  )
