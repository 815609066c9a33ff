"""What every layer taking `managed_ids` adds: `managed_ids`, `remap`, and the remap of a call."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, tf_internals
from tpu_embedding.managed_ids.key_row_map import KeyRowMap
from tpu_embedding.managed_ids.row_resets import ImmediateResets
from tpu_embedding.managed_ids.tables import ManagedTables


class ManagedIdsMixin:
  """Mixed into a layer core that sets `_managed` (None or `ManagedTables`), `_row_resets` (how
  its path resets rows given to new keys) and `_config`."""

  _managed: Optional[ManagedTables]
  _row_resets: Optional[ImmediateResets]
  _config: config_lib.EmbeddingConfig

  @property
  def managed_ids(self) -> dict[str, KeyRowMap]:
    """{table name: its key -> row map} for the tables named in `managed_ids`."""
    return {} if self._managed is None else dict(self._managed.maps)

  def remap(self, features: Any, training: bool = True) -> Any:
    """`features` with the raw keys of managed tables replaced by their rows, as the layer's
    call does; with `training`, one step of each map (admission, eviction, resets of the rows
    given to new keys). Call it outside a step that XLA compiles, or on the global batch outside
    `strategy.run`, then call the layer with `remapped=True`."""
    if self._managed is None:
      raise ValueError(f"Layer {self.name!r} has no managed_ids: its features are rows already.")
    return self._remap(self._config, features, bool(training))

  def _remap_call(
    self, features: Any, training: Any, remapped: bool, serving_config: Any = None
  ) -> Any:
    """The features a call looks up: remapped unless the layer has no maps or `remapped`;
    admitting keys unless `training` is False or the call serves through `serving_config`."""
    if self._managed is None or remapped:
      return features
    config = self._config
    if serving_config is not None:
      config = config_lib.for_serving(serving_config, self._config)
    return self._remap(config, features, training is not False and serving_config is None)

  def _remap(self, config: config_lib.EmbeddingConfig, features: Any, admits: bool) -> Any:
    self._refuse_keys_in_tpu_step()
    admits = admits and not tf_internals.in_save_context()  # serving traces never admit keys
    if admits:
      self._row_resets.check_training_remap()
    rows = self._managed.remap(config, features, admits, self._row_resets.reset)
    if admits:
      self._row_resets.end_step()
    return self._row_resets.visible(config, rows)

  def _refuse_keys_in_tpu_step(self) -> None:
    """Hash tables do not compile for the TPU: keys are remapped on the host, before the step."""
    if tf.distribute.in_cross_replica_context():
      return
    if hardware.is_tpu_strategy(tf.distribute.get_strategy()):
      raise ValueError(
        f"Layer {self.name!r} has managed_ids and was given raw keys inside a TPU step, where "
        "its key -> row maps (hash tables) cannot run. Remap on the host before the step: "
        "rows = layer.remap(features) outside strategy.run, then layer(rows, remapped=True) "
        "inside it."
      )
