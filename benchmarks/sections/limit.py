"""Case 4: random-row bandwidth against the bytes the engine moves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks import harness as h
from benchmarks.cases import DLRM_BATCH, OPTS, SLOTS

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  lim = next((r["result"] for r in report.raw["runs"] if r["family"] == "limit"), None)
  out = ["## 4. Physical limit: random-row bandwidth vs. what the engine moves", ""]
  if lim is None or "error" in lim:
    out.append(f"Bandwidth measurement failed: {lim and lim.get('error')}")
    report.sections.append("\n".join(out))
    return
  bw = {k: {m: h.summarize(v) for m, v in d.items()} for k, d in lim["limit"].items()}
  out += [
    "1,000,000 uniformly random row indices into a float32 table; GB/s of row bytes "
    "moved. take = `np.take(table, idx, axis=0, out=preallocated)` (the gather limit "
    "used below), fancy = `table[idx]` (allocates its output), scatter = "
    "`table[unique_idx] = rows`.",
    "",
  ]
  out.append(
    h.markdown_table(
      [
        "table",
        "NumPy take GB/s",
        "NumPy fancy gather GB/s",
        "NumPy scatter GB/s",
        "tf.gather GB/s",
      ],
      [
        [
          k,
          h.fmt_stat(d["numpy_take_gbs"]),
          h.fmt_stat(d["numpy_gather_gbs"]),
          h.fmt_stat(d["numpy_scatter_gbs"]),
          h.fmt_stat(d["tf_gather_gbs"]),
        ]
        for k, d in bw.items()
      ],
    )
  )
  out += [
    "",
    "Engine traffic (`ours`): per step every distinct touched row of the table and "
    "of each slot is read once and written once: bytes = 2 x unique rows x dim x 4 x "
    "(1 + slots). The table's rows are counted once although the lookup reads them and "
    "the update kernel reads them again, so the figure is a lower bound. "
    "Fraction = engine GB/s over "
    "the NumPy take GB/s of the matching shape (1e6x16 for case 1, 1e7x32 for "
    "case 2). Zipf ids are cache-friendlier than uniform ones.",
    "",
  ]
  table, fractions = [], []
  cases = [("case 1 emb", "dlrm", "emb", opt, DLRM_BATCH, "dlrm", 16, "1000000x16") for opt in OPTS]
  cases += [
    (f"case 2 {n:.0e} rows", "table", "emb", opt, 4096, n, 32, "10000000x32")
    for n in sorted(report.s.table_sizes)
    for opt in OPTS
  ]
  for label, fam, wl, opt, b, key, dim, shape in cases:
    row = report.get(fam, wl, opt, b, key, "ours")
    if row is None or not row.step_s or shape not in bw:
      continue
    t = h.summarize(row.step_s).median
    nbytes = 2 * row.unique_rows * dim * 4 * (1 + SLOTS[opt])
    gbs = nbytes / t / 1e9
    frac = gbs / bw[shape]["numpy_take_gbs"].median
    fractions.append((label, opt, frac))
    table.append(
      [
        label,
        opt,
        f"{row.unique_rows:,.0f}",
        f"{nbytes / 1e6:.2f}",
        f"{t * 1000:.1f}",
        f"{gbs:.3f}",
        f"{frac:.3f}",
      ]
    )
  out.append(
    h.markdown_table(
      [
        "workload",
        "optimizer",
        "unique rows/step",
        "MB/step",
        "ms/step (median)",
        "engine GB/s",
        "fraction of gather BW",
      ],
      table,
    )
  )
  report.sections.append("\n".join(out))
  for label, opt, frac in fractions:
    if label.startswith("case 1") or "1e+07" in label:
      report.target(f"bandwidth fraction, {label} {opt}: >= 1/4 of gather", frac, 0.25, "{:.3f}")
