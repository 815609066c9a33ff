"""Case 1: the DLRM-shaped step and the embedding part alone, with the dense-only bound."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from benchmarks import harness as h
from benchmarks.cases import DLRM_BATCH, OPTS
from benchmarks.results import ex_per_s, pyplot, ratio, timing_row, timing_table

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  out = [
    "## 1. DLRM-shaped training step (batch 4096) and the embedding part alone",
    "",
    "26 tables (ten of 1e6 rows, sixteen of 1e2..1e5 rows, log-spaced), dim 16, "
    "features 0-2 multi-hot (1-5 ids, ragged, sum combiner), Zipf(1.2) ids. DLRM: 13 "
    "dense features -> bottom MLP 512-256-16, **concat** interaction (16 + 26 x 16 = "
    "432 inputs), top MLP 512-256-1, BCE. Embedding alone: loss = sum of squared "
    "activations. Same optimizer for tables and dense layers (Adagrad lr 0.01, Adam lr "
    "0.001; tfrs/ours-keras/keras-embedding use `optimizers.legacy`). `ours/x` = ours' "
    "examples/s over x's. **dense-only** is the same DLRM with constant activations "
    "and no embedding work: the bound the dense MLPs leave to any embedding layer.",
    "",
  ]
  table = []
  for workload, wname in (("dlrm", "DLRM"), ("emb", "embedding only")):
    for opt in OPTS:
      ours = ex_per_s(report.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", "ours"))
      for impl in h.IMPLS + ((h.DENSE_ONLY,) if workload == "dlrm" else ()):
        row = report.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", impl)
        speed_up = "1" if impl == "ours" else h.fmt_ratio(ratio(ours, ex_per_s(row)))
        table.append(timing_row(wname, opt, impl, row, speed_up, report.s))
  out.append(timing_table(table, "ours/x"))
  out += ["", _dense_bound(report)]
  report.sections.append("\n".join(out))
  for workload, opt, goal, label in (
    ("dlrm", "adam", 5, "DLRM Adam: ours >= 5x tfrs"),
    ("dlrm", "adagrad", 1.15, "DLRM Adagrad: ours >= 1.15x tfrs"),
    ("emb", "adagrad", 2, "embedding only Adagrad: ours >= 2x tfrs"),
    ("emb", "adam", 20, "embedding only Adam: ours >= 20x tfrs"),
  ):
    r = ratio(
      ex_per_s(report.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", "ours")),
      ex_per_s(report.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", "tfrs")),
    )
    report.target(label, r, goal, "{:.2f}x")
  _bar_plot(report)


def _dense_bound(report: Report) -> str:
  """How much of the speed-up the dense MLPs allow over tfrs ours reaches, with Adagrad."""
  get = lambda impl: ex_per_s(report.get("dlrm", "dlrm", "adagrad", DLRM_BATCH, "dlrm", impl))
  ours, tfrs, bound = get("ours"), get("tfrs"), get(h.DENSE_ONLY)
  if not (ours and tfrs and bound):
    return "Dense-only bound: not measured."
  achieved, possible = ratio(ours, tfrs), ratio(bound, tfrs)
  return (
    f"With Adagrad the dense MLPs alone run at {possible:.2f}x tfrs's examples/s: no "
    f"embedding layer can beat that. Ours is at {achieved:.2f}x, i.e. "
    f"{(achieved - 1) / (possible - 1):.0%} of the speed-up left above tfrs "
    "(ms/step: ours - dense-only = our embedding part's cost in the whole step)."
  )


def _bar_plot(report: Report) -> None:
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, (workload, title) in zip(axes, (("dlrm", "DLRM step"), ("emb", "embedding only"))):
    x = np.arange(len(OPTS))
    width = 0.2
    for i, impl in enumerate(h.IMPLS):
      vals, errs = [], [[], []]
      for opt in OPTS:
        st = ex_per_s(report.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", impl))
        vals.append(st.median if st else 0)
        errs[0].append(st.median - st.lo if st else 0)
        errs[1].append(st.hi - st.median if st else 0)
      ax.bar(x + (i - 1.5) * width, vals, width, yerr=errs, label=impl, capsize=2)
    ax.set_xticks(x, OPTS)
    ax.set_yscale("log")
    ax.set_ylabel("examples/s (log)")
    ax.set_title(f"{title}, batch {DLRM_BATCH}")
  axes[0].legend(fontsize=8)
  report.save(fig, "dlrm.png")
