"""What every layer taking `managed_ids` adds: `managed_ids`, `remap`, and the remap of a call."""

from __future__ import annotations

from typing import Any, Optional

from tpu_embedding import config as config_lib
from tpu_embedding.managed_ids.id_map import IdMap
from tpu_embedding.managed_ids.tables import ManagedTables


class ManagedIdsMixin:
  """Mixed into a layer core that sets `_managed` (None or `ManagedTables`), `_config` and
  `variables_by_table`."""

  _managed: Optional[ManagedTables]
  _config: config_lib.EmbeddingConfig

  @property
  def managed_ids(self) -> dict[str, IdMap]:
    """{table name: its key -> row map} for the tables named in `managed_ids`."""
    return {} if self._managed is None else dict(self._managed.maps)

  def remap(self, features: Any, training: bool = True) -> Any:
    """`features` with the raw keys of managed tables replaced by their rows, as the layer's
    call does; with `training`, one step of each map (admission, eviction, resets of the rows
    given to new keys). Call it outside a step that XLA compiles, or on the global batch outside
    `strategy.run`, then call the layer with `remapped=True`."""
    if self._managed is None:
      raise ValueError(f"Layer {self.name!r} has no managed_ids: its features are rows already.")
    return self._managed.remap(
      self._config, features, bool(training), lambda: self.variables_by_table
    )

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
    admits = training is not False and serving_config is None
    return self._managed.remap(config, features, admits, lambda: self.variables_by_table)
