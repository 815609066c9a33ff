"""Case 3: examples/s per batch size on the DLRM tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from benchmarks import harness as h
from benchmarks.cases import DLRM_BATCH
from benchmarks.results import ex_per_s, pyplot

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  batches = sorted(set(report.s.batches) | {DLRM_BATCH})
  out = [
    "## 3. Scaling with batch (DLRM tables, embedding part alone, Adagrad)",
    "",
    "Examples/s, median (min–max, n).",
    "",
  ]
  table = []
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for impl in h.IMPLS:
    cells, med = [], []
    for b in batches:
      st = ex_per_s(report.get("dlrm", "emb", "adagrad", b, "dlrm", impl))
      cells.append(h.fmt_stat(st))
      med.append(st.median if st else np.nan)
    table.append([impl] + cells)
    ax.plot(batches, med, marker="o", label=impl)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("batch")
  ax.set_ylabel("examples/s (log)")
  ax.set_title("embedding only, DLRM tables, Adagrad")
  ax.legend(fontsize=8)
  report.save(fig, "batch.png")
  out.append(h.markdown_table(["implementation"] + [f"batch {b}" for b in batches], table))
  report.sections.append("\n".join(out))
