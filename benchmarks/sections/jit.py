"""Case 7: jit_compile=True (the XLA path) against the other implementations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks import harness as h
from benchmarks.cases import (
  DLRM_BATCH,
  JIT_VARIANTS,
  OPTS,
  PARTIAL_VARIANTS,
  REPLICATED_ROWS,
  impl_label,
)
from benchmarks.results import ex_per_s, ratio, timing_row, timing_table

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  out = [
    "## 7. Under jit_compile=True: the XLA path",
    "",
    "Case 1's tables and workloads, every step a `tf.function(jit_compile=True)` (`/xla`), "
    "except `ours` (no XLA: the compiled-kernel path) and `tfrs`, which cannot compile "
    "with XLA (it requires a legacy Keras optimizer, whose sparse update calls "
    "`tf.unique`); `keras-embedding/xla` uses the current tf-keras optimizers, which do. "
    "`x/tfrs` = x's examples/s over tfrs's. Partial: `PartialTPUEmbedding(size_threshold=None)` "
    "on case 1's tables "
    f"of <= {REPLICATED_ROWS:,} rows (its replicated side), embedding only.",
    "",
  ]
  table = []
  for family, workload, variants in (
    ("jit", "dlrm", JIT_VARIANTS),
    ("jit", "emb", JIT_VARIANTS),
    ("jit-partial", "emb", PARTIAL_VARIANTS),
  ):
    for opt in OPTS:
      base = ex_per_s(report.get(family, workload, opt, DLRM_BATCH, "dlrm", "tfrs"))
      for impl, jit in variants:
        row = report.get(family, workload, opt, DLRM_BATCH, "dlrm", impl_label(impl, jit))
        model = f"{'partial ' if family == 'jit-partial' else ''}{workload}"
        speed_up = h.fmt_ratio(ratio(ex_per_s(row), base))
        table.append(timing_row(model, opt, impl_label(impl, jit), row, speed_up, report.s))
  out.append(timing_table(table, "x/tfrs"))
  report.sections.append("\n".join(out))
  speed = lambda family, workload, opt, impl: ex_per_s(
    report.get(family, workload, opt, DLRM_BATCH, "dlrm", impl)
  )
  for workload, opt, goal, label in (
    ("dlrm", "adam", 5, "jit DLRM Adam: ours/xla >= 5x tfrs"),
    ("dlrm", "adagrad", 1, "jit DLRM Adagrad: ours/xla >= tfrs"),
    ("emb", "adagrad", 1.5, "jit embedding only Adagrad: ours/xla >= 1.5x tfrs"),
    ("emb", "adam", 1.5, "jit embedding only Adam: ours/xla >= 1.5x tfrs"),
  ):
    report.target(
      label,
      ratio(speed("jit", workload, opt, "ours/xla"), speed("jit", workload, opt, "tfrs")),
      goal,
      "{:.2f}x",
    )
  for opt in OPTS:
    report.target(
      f"Partial replicated side {opt}: XLA step within 2x of compiled kernels",
      ratio(
        speed("jit-partial", "emb", opt, "ours-partial/xla"),
        speed("jit-partial", "emb", opt, "ours-partial"),
      ),
      0.5,
      "{:.2f}x",
    )
