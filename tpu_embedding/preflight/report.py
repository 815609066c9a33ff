"""One report a person reads before paying for TPU hours: the memory plan per chip (part 2) and,
on SparseCore topologies, the input limits the data needs and what TF's defaults would do to it
(part 1, `sparse_core_stats`, `sparse_core_config`, `preview_limits`), as markdown and a plot."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Iterable, Optional, TextIO

import tensorflow as tf

from tpu_embedding import preflight, tf_internals
from tpu_embedding.preflight import memory as memory_lib
from tpu_embedding.preflight import progress, sources, topologies

gib = memory_lib.gib
# TF's limits when SparseCoreEmbeddingConfig gives none (per partition, and the per-chip buffer).
TF_DEFAULT_PER_PARTITION = 256
TF_DEFAULT_PER_CHIP = 64
PER_CHIP = "max_ids_per_chip_per_sample"
MATPLOTLIB_MISSING = (
  "The plot needs matplotlib, which is not installed: pip install matplotlib (or the "
  "package's 'examples' extra), or leave out --plot. Nothing was written."
)
PATHS = {
  topologies.V1: "TPUEmbedding (V1 embedding engine)",
  topologies.V2: "TPUEmbeddingV2 (SparseCore)",
  topologies.REPLICATED: "no embedding hardware: every table replicated (TPUEmbeddingV0)",
}


@dataclasses.dataclass(frozen=True)
class SparseCoreSection:
  """Part 1's figures for the data, or why there are none (`note`)."""

  stats: Optional[dict] = None  # sparse_core_stats
  config: Any = None  # sparse_core_config(stats): the suggested SparseCoreEmbeddingConfig
  preview: Any = None  # preview_limits at TF's defaults (a LimitsPreview)
  batches: int = 0
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
  source: str
  batch_size: int
  plan: memory_lib.MemoryPlan
  sparse_core: SparseCoreSection


def build_report(
  model: sources.ModelConfig,
  batches: Iterable[Any],
  *,
  topology: Any,
  batch_size: int,
  dense_bytes_per_chip: int = 0,
  stacking: bool = True,
  total: Optional[int] = None,
  stream: Optional[TextIO] = None,
) -> Report:
  """The plan for `model` on `topology`, and on a SparseCore topology the statistics of
  `batches` (read once, with a progress bar on `stream`; each the global batch)."""
  plan = memory_lib.memory_plan(
    model.feature_config,
    model.optimizer,
    topology=topology,
    batch_size=batch_size,
    dense_bytes_per_chip=dense_bytes_per_chip,
  )
  chips = topologies.topology(topology)
  if chips.embedding != topologies.V2:
    section = SparseCoreSection(
      note=f"not applicable: {plan.topology} runs {PATHS[chips.embedding]}; SparseCore's "
      "input limits concern TPUEmbeddingV2 (v5p, v6e). The data was not read."
    )
  elif tf_internals.SPARSE_CORE_CONFIG is None:
    section = SparseCoreSection(
      note=f"not computed: TensorFlow {tf.__version__} has no SparseCore limits "
      "(SparseCoreEmbeddingConfig came with 2.17). The data was not read"
    )
  else:
    section = _sparse_core_section(model, batches, chips, stacking, total, stream)
  return Report(model.source, batch_size, plan, section)


def _sparse_core_section(model, batches, chips, stacking, total, stream) -> SparseCoreSection:
  read = list(progress.progress(batches, total=total, stream=stream))
  where = dict(
    num_chips=chips.num_chips,
    sparse_cores_per_chip=chips.sparse_cores_per_chip,
    optimizer=model.optimizer,
  )
  stats = preflight.sparse_core_stats(model.feature_config, read, stacking=stacking, **where)
  config = preflight.sparse_core_config(stats, stacking=stacking)
  defaults = tf_internals.sparse_core_config(disable_table_stacking=not stacking)
  preview = preflight.preview_limits(model.feature_config, read, defaults, **where)
  return SparseCoreSection(stats=stats, config=config, preview=preview, batches=len(read))


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown(report: Report) -> str:
  """The report as markdown: the plan, its tables, and the SparseCore section."""
  plan = report.plan
  lines = [
    f"# TPU pre-flight: `{report.source}` on {plan.topology}",
    "",
    "## Memory plan per chip",
    "",
    f"{plan.topology}: {plan.num_chips} chip(s), {gib(plan.hbm_bytes_per_chip)} HBM each; "
    f"tables on {PATHS[plan.embedding]}. Global batch {report.batch_size:,}.",
    "",
    "| per chip (fullest chip) | bytes | GiB |",
    "|---|---:|---:|",
    *_rows(
      ("tables", plan.tables_bytes_per_chip),
      ("optimizer slots", plan.slots_bytes_per_chip),
      ("activations + gradients", plan.activations_bytes_per_chip),
      ("dense model budget", plan.dense_bytes_per_chip),
      ("**total, every table on the embedding hardware**", plan.total_bytes_per_chip),
      ("HBM", plan.hbm_bytes_per_chip),
    ),
    "",
    f"**Verdict:** {plan.verdict}.",
    "",
    f"**PartialTPUEmbedding size_threshold:** {_threshold(plan)}",
    "",
    "### Tables",
    "",
    "| table | rows | dim | slots | rows/chip | width | table B/chip | slots B/chip | "
    "replicated B/chip |",
    "|---|---:|---:|---|---:|---:|---:|---:|---:|",
  ]
  for name, t in plan.per_table.items():
    lines.append(
      f"| {name} | {t.vocabulary_size:,} | {t.dim} | {', '.join(t.slots) or '-'} | "
      f"{t.rows_per_chip:,} | {t.width} | {t.table_bytes:,} | {t.slot_bytes:,} | "
      f"{t.replicated_bytes:,} |"
    )
  lines += ["", *_sparse_core_markdown(report.sparse_core)]
  return "\n".join(lines) + "\n"


def _rows(*rows: tuple[str, int]) -> list[str]:
  return [f"| {label} | {count:,} | {count / memory_lib.GIB:.2f} |" for label, count in rows]


def _threshold(plan: memory_lib.MemoryPlan) -> str:
  if not plan.fits:
    return "none fits (0 shards every table, the least most tables cost)."
  if plan.partial_size_threshold is None:
    return (
      f"None: every table fits replicated ({gib(plan.partial_bytes_per_chip)} per chip, all "
      "included), and replicated lookups skip the embedding engine's exchange."
    )
  replicated = sum(
    1 for t in plan.per_table.values() if t.vocabulary_size <= plan.partial_size_threshold
  )
  return (
    f"{plan.partial_size_threshold:,}: replicates {replicated} of {len(plan.per_table)} tables "
    f"({gib(plan.partial_bytes_per_chip)} per chip, all included); the next larger table size "
    "would not fit."
  )


def _sparse_core_markdown(section: SparseCoreSection) -> list[str]:
  lines = ["## SparseCore input limits (the data's statistics)", ""]
  if section.stats is None:
    return lines + [f"SparseCore statistics: {section.note}."]
  suggested = section.config
  lines += [
    f"Over {section.batches} batch(es), as TPUEmbeddingV2's preprocessing counts them "
    f"(TF's default limit: {TF_DEFAULT_PER_PARTITION} ids and unique ids per partition).",
    "",
    "| stacked table | max ids / partition | max unique ids / partition | over TF's default? "
    "| suggested max_ids / max_unique_ids |",
    "|---|---:|---:|---|---:|",
  ]
  for name, counts in section.stats.items():
    if name == PER_CHIP:
      continue
    ids, unique = counts["max_ids_per_partition"], counts["max_unique_ids_per_partition"]
    over = "yes" if max(ids, unique) > TF_DEFAULT_PER_PARTITION else "no"
    advice = f"{suggested.max_ids_per_table[name]} / {suggested.max_unique_ids_per_table[name]}"
    lines.append(f"| {name} | {ids:,} | {unique:,} | {over} | {advice} |")
  per_chip = section.stats[PER_CHIP]
  lines += [
    "",
    f"max_ids_per_chip_per_sample needed: {per_chip} (TF's default {TF_DEFAULT_PER_CHIP}); "
    f"suggested {suggested.max_ids_per_chip_per_sample}.",
    "",
    "At TF's default limits:",
    "",
    "```",
    section.preview.summary(),
    "```",
  ]
  return lines


# ---------------------------------------------------------------------------------------------
# The plot


def require_matplotlib() -> Any:
  """matplotlib's pyplot on the Agg backend, or a ValueError saying how to get it."""
  try:
    matplotlib = importlib.import_module("matplotlib")
  except ImportError as error:
    raise ValueError(MATPLOTLIB_MISSING) from error
  matplotlib.use("Agg")
  return importlib.import_module("matplotlib.pyplot")


def write_plot(report: Report, path: str) -> None:
  """A PNG: per stacked table, the observed ids per partition against TF's default limit (on
  SparseCore topologies); and the memory per chip, stacked, against HBM, for every table on the
  embedding hardware and for the suggested threshold."""
  pyplot = require_matplotlib()
  stats = report.sparse_core.stats
  panels = 2 if stats else 1
  figure, axes = pyplot.subplots(1, panels, figsize=(6 * panels + 2, 4.5), squeeze=False)
  if stats:
    _ids_panel(axes[0][0], stats, report.sparse_core.config)
  _memory_panel(axes[0][-1], report.plan)
  figure.suptitle(f"TPU pre-flight: {report.source} on {report.plan.topology}")
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  pyplot.close(figure)


def _ids_panel(axis: Any, stats: dict, suggested: Any) -> None:
  names = [name for name in stats if name != PER_CHIP]
  positions = range(len(names))
  ids = [stats[n]["max_ids_per_partition"] for n in names]
  unique = [stats[n]["max_unique_ids_per_partition"] for n in names]
  axis.bar([p - 0.2 for p in positions], ids, 0.4, label="max ids / partition")
  axis.bar([p + 0.2 for p in positions], unique, 0.4, label="max unique ids / partition")
  axis.axhline(TF_DEFAULT_PER_PARTITION, color="red", linestyle="--", label="TF's default limit")
  axis.scatter(
    positions,
    [suggested.max_ids_per_table[n] for n in names],
    marker="_",
    s=400,
    color="black",
    label="suggested limit",
  )
  short = [name if len(name) <= 24 else name[:21] + "..." for name in names]
  axis.set_xticks(list(positions), short, rotation=30, ha="right", fontsize=7)
  axis.set_ylabel("ids")
  axis.set_title("Observed ids per SparseCore partition")
  axis.legend(fontsize=7)


def _memory_panel(axis: Any, plan: memory_lib.MemoryPlan) -> None:
  threshold = plan.partial_size_threshold
  replicated_side = memory_lib.bytes_with_threshold(plan.per_table, threshold)
  label = "replicate all" if threshold is None else f"threshold {threshold:,}"
  bars = {
    "tables + slots": (plan.tables_bytes_per_chip + plan.slots_bytes_per_chip, replicated_side),
    "activations + gradients": (plan.activations_bytes_per_chip,) * 2,
    "dense budget": (plan.dense_bytes_per_chip,) * 2,
  }
  bottoms = [0.0, 0.0]
  for name, values in bars.items():
    heights = [v / memory_lib.GIB for v in values]
    axis.bar(["all on engine", label], heights, bottom=bottoms, label=name)
    bottoms = [b + h for b, h in zip(bottoms, heights)]
  for position, top in enumerate(bottoms):
    axis.text(position, top, f"{top:.2f} GiB", ha="center", va="bottom", fontsize=8)
  axis.axhline(plan.hbm_bytes_per_chip / memory_lib.GIB, color="red", label="HBM")
  axis.set_ylabel("GiB per chip")
  axis.set_title("Memory per chip")
  axis.legend(fontsize=7)
