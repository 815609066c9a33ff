"""Where the report's configuration and data come from: a Python module or a saved model config;
a CSV or TFRecord file, or a Python function giving a `tf.data.Dataset` (or any iterable)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import zipfile
from typing import Any, Iterable, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib

CONFIG_ATTRIBUTE = "feature_config"
OPTIMIZER_ATTRIBUTE = "optimizer"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A feature config to plan for, its optimizer (None: the tables' own) and where it came from."""

  feature_config: Any
  optimizer: Any
  source: str


def load_config(spec: str) -> ModelConfig:
  """`package.module` or `package.module:name` (a feature config nest, or a function returning
  one; the module's `optimizer`, if it has one, is the layer-wide optimizer), or the path of a
  saved model config: a `.keras` file or `.json` holding a Keras 3 embedding layer's config
  (tables with their optimizers)."""
  if spec.endswith((".keras", ".json")):
    return _saved_config(spec)
  module, value = _attribute("--config", spec, CONFIG_ATTRIBUTE)
  feature_config = value() if callable(value) else value
  return ModelConfig(feature_config, getattr(module, OPTIMIZER_ATTRIBUTE, None), spec)


def _attribute(flag: str, spec: str, default: Optional[str]) -> tuple[Any, Any]:
  """(the module, its attribute) that `spec` ("package.module:name") names."""
  module_name, _, name = spec.partition(":")
  name = name or default
  if not name:
    raise ValueError(
      f"{flag} {spec!r}: expected a .csv or .tfrecord file, or 'package.module:function'."
    )
  try:
    module = importlib.import_module(module_name)
  except ImportError as error:
    raise ValueError(
      f"{flag} {spec!r}: cannot import {module_name!r} ({error}); expected a Python module "
      "path such as 'my_package.model:name'."
    ) from error
  if not hasattr(module, name):
    raise ValueError(f"{flag} {spec!r}: {module_name} has no {name!r}.")
  return module, getattr(module, name)


def _saved_config(path: str) -> ModelConfig:
  if not os.path.isfile(path):
    raise ValueError(f"--config {path!r}: no such file.")
  if path.endswith(".keras"):
    with zipfile.ZipFile(path) as archive:
      document = json.loads(archive.read("config.json"))
  else:
    with open(path, encoding="utf-8") as f:
      document = json.load(f)
  found = _find_feature_config(document)
  if found is None:
    raise ValueError(
      f"--config {path!r} holds no embedding layer config (a 'feature_config' with 'tables' "
      "and 'features', as tpu_embedding.keras layers save it)."
    )
  from tpu_embedding.keras import saving  # Keras 3, only for saved configs

  return ModelConfig(saving.deserialize_feature_config(found), None, path)


def _find_feature_config(node: Any) -> Optional[Mapping[str, Any]]:
  """The first serialized feature config in a JSON document, depth first."""
  if isinstance(node, Mapping):
    value = node.get(CONFIG_ATTRIBUTE)
    if isinstance(value, Mapping) and {"tables", "features"} <= set(value):
      return value
    children: Iterable[Any] = node.values()
  elif isinstance(node, list):
    children = node
  else:
    return None
  for child in children:
    found = _find_feature_config(child)
    if found is not None:
      return found
  return None


def load_batches(
  spec: str, feature_config: Any, batch_size: int
) -> tuple[Iterable[Any], Optional[int]]:
  """(the global batches, how many if known) from `spec`: a `.csv` file (a header naming the
  features, one id per cell), a `.tfrecord` file of `tf.train.Example`s (an int64 list per
  feature, any length), both batched by `batch_size`; or `package.module:function`, called with
  no arguments, giving batches already (a `tf.data.Dataset` or any iterable of feature dicts,
  or of (features, labels))."""
  if spec.endswith(".csv") or spec.endswith((".tfrecord", ".tfrecords")):
    if not os.path.isfile(spec):
      raise ValueError(f"--data {spec!r}: no such file.")
    names = _flat_feature_names(feature_config, spec)
    if spec.endswith(".csv"):
      dataset = _csv(spec, names, batch_size)
    else:
      dataset = _tfrecord(spec, names, batch_size)
    return dataset, None
  batches = _attribute("--data", spec, None)[1]()
  total = None
  if isinstance(batches, tf.data.Dataset):
    cardinality = int(batches.cardinality())
    total = cardinality if cardinality >= 0 else None
  elif hasattr(batches, "__len__"):
    total = len(batches)
  return (_features_only(batch) for batch in batches), total


def _features_only(batch: Any) -> Any:
  return batch[0] if isinstance(batch, tuple) else batch


def _flat_feature_names(feature_config: Any, spec: str) -> list[str]:
  paths = [feature.path for feature in config_lib.prepare(feature_config).features]
  if not isinstance(feature_config, Mapping) or any("/" in path for path in paths):
    raise ValueError(
      f"--data {spec!r}: a CSV or TFRecord file names its columns by feature, so the config "
      f"must be a flat dict of features; got paths {paths}. Give the data as "
      "'package.module:function' instead."
    )
  return paths


def _csv(path: str, names: list[str], batch_size: int) -> tf.data.Dataset:
  return tf.data.experimental.make_csv_dataset(
    path,
    batch_size,
    select_columns=names,
    column_defaults=[tf.int64] * len(names),
    num_epochs=1,
    shuffle=False,
  )


def _tfrecord(path: str, names: list[str], batch_size: int) -> tf.data.Dataset:
  spec = {name: tf.io.VarLenFeature(tf.int64) for name in names}
  return (
    tf.data.TFRecordDataset(path)
    .batch(batch_size)
    .map(lambda records: tf.io.parse_example(records, spec))
  )
