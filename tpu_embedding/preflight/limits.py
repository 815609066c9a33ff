"""SparseCore limits from input statistics, and what given limits would do to given batches:
which steps fail, and which ids `allow_id_dropping` drops (emulated, so a CPU run shows the
quality it costs).

What TF 2.21 does with the limits (its `TPUEmbeddingV2` and preprocessing kernels):
* a stacked table missing from `max_ids_per_table` / `max_unique_ids_per_table` gets 256/256,
  also when the dict names one of its tables instead of the stack;
* one SparseCore sending one partition more ids, or unique ids, than its table's limit fails the
  step, dropping or not;
* per chip and stacked table, the ids go into a buffer of `max_ids_per_chip_per_sample` * (the
  stack's samples per chip) ids (a multiple of 8, or the step fails), SparseCore by SparseCore and
  partition by partition, each run padded to a multiple of 8. A run that does not fit fails the
  step; with `allow_id_dropping`, what fits of it is kept and every later id on that chip is
  dropped (in TF's order: partition, then column, then feature and sample).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Iterator, Mapping, Optional

import numpy as np
import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.preflight import input_stats
from tpu_embedding.preflight import routing as routing_lib

emb = tf.tpu.experimental.embedding
DEFAULT_LIMIT = 256  # TF's DEFAULT_MAX_IDS_PER_TABLE and DEFAULT_MAX_UNIQUE_IDS_PER_TABLE
DEFAULT_HEADROOM = 0.25


def sparse_core_config(
  stats: Mapping[str, Any],
  *,
  headroom: float = DEFAULT_HEADROOM,
  stacking: bool = True,
  allow_id_dropping: bool = False,
) -> Any:
  """A `tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig` holding `stats`' batches with
  `headroom` to spare, for the layer's `sparse_core_embedding_config=` as it is.

  The headroom rule: each per-partition limit is ceil(observed * (1 + headroom)), at least 1 (TF
  refuses 0); `max_ids_per_chip_per_sample` is the observed figure when headroom is 0 (it is
  already one TF accepts), else ceil(observed * (1 + headroom)) rounded up to a multiple of 8,
  which keeps every stacked table's buffer a multiple of 8 whatever its samples per chip. The
  limits are keyed by the stacked tables' names, as TF looks them up.

  Args:
    stats: what `sparse_core_stats` returned.
    headroom: the fraction to add to what the batches needed (>= 0): batches of the real run
      that route more ids than these did would otherwise fail the step.
    stacking: as given to `sparse_core_stats` (False sets `disable_table_stacking`).
    allow_id_dropping: TF's setting; the per-partition limits fail the step either way.
  """
  if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not headroom >= 0:
    raise ValueError(f"headroom must be a number >= 0; got {headroom!r}.")
  per_chip, tables = _checked_stats(stats)
  grow = lambda observed: max(1, math.ceil(observed * (1 + headroom)))
  if headroom:
    per_chip = -(-grow(per_chip) // input_stats.PAD) * input_stats.PAD
  return tf_internals.sparse_core_config(
    disable_table_stacking=not stacking,
    max_ids_per_chip_per_sample=per_chip,
    max_ids_per_table={name: grow(t[input_stats.IDS]) for name, t in tables.items()},
    max_unique_ids_per_table={name: grow(t[input_stats.UNIQUE_IDS]) for name, t in tables.items()},
    allow_id_dropping=allow_id_dropping,
  )


def _checked_stats(stats: Mapping[str, Any]) -> tuple[int, dict[str, Mapping[str, int]]]:
  if not isinstance(stats, Mapping) or input_stats.PER_CHIP not in stats:
    raise ValueError(
      f"stats must be what sparse_core_stats returns (a dict with {input_stats.PER_CHIP!r}); "
      f"got {stats!r:.200}."
    )
  tables = {name: value for name, value in stats.items() if name != input_stats.PER_CHIP}
  _check_count(input_stats.PER_CHIP, stats[input_stats.PER_CHIP], least=1)
  for name, value in tables.items():
    if not isinstance(value, Mapping) or set(value) != {input_stats.IDS, input_stats.UNIQUE_IDS}:
      raise ValueError(
        f"stats[{name!r}] must hold {input_stats.IDS!r} and {input_stats.UNIQUE_IDS!r}; "
        f"got {value!r}."
      )
    for key, count in value.items():
      _check_count(f"stats[{name!r}][{key!r}]", count, least=0)
  return int(stats[input_stats.PER_CHIP]), tables


def _check_count(name: str, value: Any, least: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
    raise ValueError(f"{name} must be a whole number >= {least}; got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Failure:
  """A limit one batch exceeds on one stacked table; the worst place it does."""

  batch: int  # the batch's index in `batches`
  table: str  # the stacked table's name
  limit_name: str  # "max_ids_per_table", "max_unique_ids_per_table" or "max_ids_per_chip"
  limit: int
  count: int  # the worst count
  chip: int
  sparse_core: Optional[int]  # where the worst count is (None for the per-chip buffer)
  partition: Optional[int]
  places_over: int  # how many (chip, SparseCore, partition) places, or chips, exceed it

  @property
  def excess(self) -> int:
    return self.count - self.limit


@dataclasses.dataclass(frozen=True)
class LimitsPreview:
  """What `config` does to the batches (see `preview_limits`)."""

  batches: int
  ids: int  # deduplicated (sample, id) pairs over all batches
  failures: tuple[Failure, ...]  # each would fail its step
  dropped: Mapping[str, int]  # per stacked table: ids the buffer drops with allow_id_dropping
  unmatched_names: tuple[str, ...]  # config keys naming no stacked table (TF ignores them)

  @property
  def failed_batches(self) -> list[int]:
    return sorted({failure.batch for failure in self.failures})

  def summary(self) -> str:
    """A few lines for a person."""
    lines = [
      f"{self.batches} batches, {self.ids} ids: {len(self.failed_batches)} batches would fail "
      f"the step; allow_id_dropping would drop {sum(self.dropped.values())} ids "
      f"({_share(sum(self.dropped.values()), self.ids)})."
    ]
    for f in self.failures[:20]:
      where = f"chip {f.chip}" + (
        f", SparseCore {f.sparse_core}, partition {f.partition}" if f.partition is not None else ""
      )
      lines.append(
        f"  batch {f.batch}, table {f.table!r}: {f.count} > {f.limit_name} {f.limit} (by "
        f"{f.excess}) at {where}; {f.places_over} places over"
      )
    if len(self.failures) > 20:
      lines.append(f"  ... {len(self.failures) - 20} more")
    if self.unmatched_names:
      lines.append(
        f"  the config names {list(self.unmatched_names)}, which are no stacked table: TF "
        f"gives those stacks {DEFAULT_LIMIT}"
      )
    return "\n".join(lines)


def _share(part: int, whole: int) -> str:
  return f"{100.0 * part / whole:.3g}%" if whole else "0%"


@dataclasses.dataclass(frozen=True)
class _Limits:
  """The limits TF would apply to each stacked table of a routing."""

  ids: Mapping[str, int]
  unique_ids: Mapping[str, int]
  buffer: Mapping[str, int]  # per-chip buffer, ids
  allow_id_dropping: bool
  unmatched_names: tuple[str, ...]

  @classmethod
  def of(cls, config: Any, route: routing_lib.Routing) -> "_Limits":
    given = {}
    for field in ("max_ids_per_table", "max_unique_ids_per_table"):
      given[field] = dict(getattr(config, field) or {})
      for name, value in given[field].items():
        _check_count(f"{field}[{name!r}]", value, least=1)
    _check_count("max_ids_per_chip_per_sample", config.max_ids_per_chip_per_sample, least=1)
    buffer = {}
    for name, samples in route.stack_samples_per_chip.items():
      buffer[name] = config.max_ids_per_chip_per_sample * samples
      if buffer[name] % input_stats.PAD:
        raise ValueError(
          f"max_ids_per_chip_per_sample {config.max_ids_per_chip_per_sample} * {samples} samples "
          f"per chip of table {name!r} = {buffer[name]} ids, not a multiple of "
          f"{input_stats.PAD}: TF fails every step."
        )
    named = set(given["max_ids_per_table"]) | set(given["max_unique_ids_per_table"])
    return cls(
      ids={name: given["max_ids_per_table"].get(name, DEFAULT_LIMIT) for name in route.stacks},
      unique_ids={
        name: given["max_unique_ids_per_table"].get(name, DEFAULT_LIMIT) for name in route.stacks
      },
      buffer=buffer,
      allow_id_dropping=config.allow_id_dropping,
      unmatched_names=tuple(sorted(named - set(route.stacks))),
    )


def _kept_per_run(runs: np.ndarray, buffer: int) -> np.ndarray:
  """[chips, runs]: how many ids of each run TF keeps in a per-chip buffer of `buffer` ids with
  allow_id_dropping (runs in TF's packing order)."""
  before = np.minimum(
    np.cumsum(input_stats.padded(runs), axis=1) - input_stats.padded(runs), buffer
  )
  return np.clip(buffer - before, 0, runs)


def _failures(
  index: int, name: str, counts: input_stats.BatchCounts, limits: _Limits
) -> list[Failure]:
  found = []
  for limit_name, cells, limit in (
    ("max_ids_per_table", counts.ids, limits.ids[name]),
    ("max_unique_ids_per_table", counts.unique_ids, limits.unique_ids[name]),
  ):
    if cells.max(initial=0) > limit:
      chip, core, partition = np.unravel_index(np.argmax(cells), cells.shape)
      found.append(
        Failure(
          index, name, limit_name, limit, int(cells.max()), int(chip), int(core),
          int(partition), int(np.sum(cells > limit)),
        )
      )  # fmt: skip
  buffer = limits.buffer[name]
  if not limits.allow_id_dropping and counts.buffer_needed.max(initial=0) > buffer:
    chip = int(np.argmax(counts.buffer_needed))
    found.append(
      Failure(
        index, name, "max_ids_per_chip", buffer, int(counts.buffer_needed[chip]), chip, None,
        None, int(np.sum(counts.buffer_needed > buffer)),
      )
    )  # fmt: skip
  return found


def _batches_with_counts(
  feature_config: Any,
  batches: Iterable[Any],
  config: Any,
  num_chips: int,
  sparse_cores_per_chip: int,
  optimizer: Any,
) -> Iterator[tuple[Any, _Limits, routing_lib.Routing, dict, dict]]:
  """(batch, limits, routing, its stacks' entries, their counts) for each batch."""
  config = tf_internals.sparse_core_config() if config is None else config
  if not isinstance(config, tf_internals.SPARSE_CORE_CONFIG or ()):
    raise ValueError(f"config must be a SparseCoreEmbeddingConfig or None; got {type(config)}.")
  route, everything = routing_lib.routed(
    feature_config,
    batches,
    num_chips=num_chips,
    sparse_cores_per_chip=sparse_cores_per_chip,
    stacking=not config.disable_table_stacking,
    optimizer=optimizer,
  )
  limits = _Limits.of(config, route)
  for batch in everything:
    entries = routing_lib.stack_entries(route, routing_lib.flat_batch(feature_config, batch))
    counts = {name: input_stats.batch_counts(route, e) for name, e in entries.items()}
    yield batch, limits, route, entries, counts


def preview_limits(
  feature_config: Any,
  batches: Iterable[Any],
  config: Any = None,
  *,
  num_chips: int,
  sparse_cores_per_chip: int = 4,
  optimizer: Any = None,
) -> LimitsPreview:
  """What `config` (a `SparseCoreEmbeddingConfig`; None: TF's defaults, 256/256 and 64) would
  do to `batches` on `num_chips` chips: which batches fail the step, on which stacked table,
  where and by how much, and how many ids the per-chip buffer drops with `allow_id_dropping`
  (counted whatever the config's setting, so one preview answers both). Arguments as for
  `sparse_core_stats`; stacking follows `config.disable_table_stacking`."""
  failures: list[Failure] = []
  dropped: dict[str, int] = {}
  total = 0
  index = -1
  limits = None
  for index, (_, limits, _, _, counts) in enumerate(
    _batches_with_counts(
      feature_config, batches, config, num_chips, sparse_cores_per_chip, optimizer
    )
  ):
    for name, count in counts.items():
      failures.extend(_failures(index, name, count, limits))
      runs = count.ids.reshape(num_chips, -1)
      dropped[name] = dropped.get(name, 0) + int(
        runs.sum() - _kept_per_run(runs, limits.buffer[name]).sum()
      )
      total += int(runs.sum())
  return LimitsPreview(
    batches=index + 1,
    ids=total,
    failures=tuple(failures),
    dropped=dropped,
    unmatched_names=limits.unmatched_names if limits else (),
  )


def emulate_id_dropping(
  feature_config: Any,
  batches: Iterable[Any],
  config: Any,
  *,
  num_chips: int,
  sparse_cores_per_chip: int = 4,
  optimizer: Any = None,
) -> Iterator[dict[str, tf.RaggedTensor]]:
  """The batches as TF's kernel would embed them under `config` with `allow_id_dropping`:
  each feature a `tf.RaggedTensor` (a row per sample TF reads) without the ids the per-chip
  buffer drops, to train on CPU and see what dropping costs.

  Exact for "sum" combiners and for samples of one id. For "mean" and "sqrtn" TF keeps a sample's
  dropped ids in its divisor (it scales the weights before dropping); a CPU layer given these
  batches divides by the ids kept. Raises where TF would fail the step instead (a per-partition
  limit exceeded): a run cannot drop its way past those. Feature dicts only.
  """
  if config is None or not config.allow_id_dropping:
    raise ValueError("config must set allow_id_dropping=True: without it TF fails, never drops.")
  for index, (batch, limits, route, entries, counts) in enumerate(
    _batches_with_counts(
      feature_config, batches, config, num_chips, sparse_cores_per_chip, optimizer
    )
  ):
    failed = [f for name, c in counts.items() for f in _failures(index, name, c, limits)]
    if failed:
      raise ValueError(
        f"Batch {index} fails the step whatever the dropping: table {failed[0].table!r} sends "
        f"{failed[0].count} ids to a partition, over {failed[0].limit_name} {failed[0].limit}."
      )
    dropped = {}  # feature index -> dropped keys (sample * vocabulary + id)
    for name, unordered in entries.items():
      entry = routing_lib.in_packing_order(unordered, route.partitions)
      runs = counts[name].ids.reshape(num_chips, -1)
      kept = _kept_per_run(runs, limits.buffer[name]).reshape(-1)
      cell = entry.block * route.partitions + entry.partition
      starts = np.concatenate([[0], np.cumsum(np.bincount(cell, minlength=kept.size))[:-1]])
      lost = np.arange(cell.size) - starts[cell] >= kept[cell]
      for feature in np.unique(entry.feature[lost]):
        mine = lost & (entry.feature == feature)
        vocabulary = route.features[feature].vocabulary_size
        dropped[int(feature)] = entry.sample[mine] * vocabulary + entry.id[mine]
    values = routing_lib.flat_batch(feature_config, batch)
    yield {
      route.features[i].path: _without(values[i], route.features[i], num_chips, dropped.get(i))
      for i in range(len(values))
    }


def _without(
  value: Any, route: routing_lib.FeatureRoute, num_chips: int, dropped: Optional[np.ndarray]
) -> tf.RaggedTensor:
  """The feature's ids as given (order and repeats kept) but those in `dropped`."""
  read = routing_lib.host_rows(value, route.path)
  samples, ids = read.samples.astype(np.int64), read.ids.astype(np.int64)
  keep = np.ones(ids.shape, bool)
  if dropped is not None:
    keep = ~np.isin(samples * route.vocabulary_size + ids, dropped)
  return tf.RaggedTensor.from_value_rowids(ids[keep], samples[keep], nrows=read.rows)
