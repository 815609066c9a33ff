"""Case 2: step time per size of one table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from benchmarks import harness as h
from benchmarks.cases import OPTS
from benchmarks.results import ms, pyplot

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  sizes = sorted(report.s.table_sizes)
  out = [
    "## 2. Scaling with table size (one table, dim 32, batch 4096, one-hot Zipf ids)",
    "",
    "Step time in ms, median (min–max, n). Loss = sum of squared activations.",
    "",
  ]
  table = []
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, opt in zip(axes, OPTS):
    for impl in h.IMPLS:
      cells, med = [], []
      for n in sizes:
        st = ms(report.get("table", "emb", opt, 4096, n, impl))
        cells.append(h.fmt_stat(st))
        med.append(st.median if st else np.nan)
      r = med[-1] / med[0] if len(med) > 1 and not np.isnan(med[0] + med[-1]) else None
      got = [report.get("table", "emb", opt, 4096, n, impl) for n in sizes]
      partial = any(r.partial for r in got if r is not None)
      table.append(
        [opt, impl]
        + cells
        + ["–" if r is None else f"{r:.2f}", "PARTIAL (budget)" if partial else ""]
      )
      if impl == "ours" and opt == "adam":
        report.target(
          f"table size, ours Adam: t({sizes[-1]:.0e})/t({sizes[0]:.0e}) <= 1.3",
          r,
          1.3,
          "{:.2f}",
          higher=False,
        )
      ax.plot(sizes, med, marker="o", label=impl)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("table rows")
    ax.set_title(f"{opt}, dim 32, batch 4096")
  axes[0].set_ylabel("ms/step (log)")
  axes[0].legend(fontsize=8)
  report.save(fig, "table_size.png")
  out.append(
    h.markdown_table(
      ["optimizer", "implementation"]
      + [f"{n:.0e} rows" for n in sizes]
      + [f"t({sizes[-1]:.0e})/t({sizes[0]:.0e})", "notes"],
      table,
    )
  )
  report.sections.append("\n".join(out))
