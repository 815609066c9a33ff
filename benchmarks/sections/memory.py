"""Case 5: peak RSS training one 1e7 x 32 table against its bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks import harness as h
from benchmarks.cases import OPTS, SLOTS

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  n, dim = 10**7, 32
  table_bytes = n * dim * 4
  out = [
    "## 5. Memory: peak RSS training one 1e7 x 32 table (batch 4096)",
    "",
    "VmHWM of the fresh worker process (interpreter, TensorFlow, ids and building "
    "included), read right after the 1e7-row measurement, which runs first in its "
    "process. Table + slots = 1.28 GB x (1 + slots).",
    "",
  ]
  table = []
  for opt in OPTS:
    ts = table_bytes * (1 + SLOTS[opt])
    for impl in h.IMPLS:
      row = report.get("table", "emb", opt, 4096, n, impl)
      peak = row.vmhwm if row else None
      base = next(
        (
          r["result"].get("rss_after_import")
          for r in report.raw["runs"]
          if r["spec"].get("impl") == impl
          and r["spec"].get("opt") == opt
          and "measurements" in r["result"]
        ),
        None,
      )
      table.append(
        [
          opt,
          impl,
          h.fmt_bytes(base),
          h.fmt_bytes(peak),
          h.fmt_bytes(ts),
          h.fmt_bytes(peak - ts) if peak else "–",
          f"{peak / ts:.2f}" if peak else "–",
        ]
      )
      if impl == "ours" and opt == "adagrad":
        report.target(
          "memory, ours Adagrad 1e7x32: peak RSS <= table + slot + 1 GiB",
          None if peak is None else (peak - ts) / 2**30,
          1.0,
          "{:.2f} GiB over",
          higher=False,
        )
  out.append(
    h.markdown_table(
      [
        "optimizer",
        "implementation",
        "RSS after imports",
        "peak RSS",
        "table + slots",
        "peak - (table + slots)",
        "peak / (table + slots)",
      ],
      table,
    )
  )
  report.sections.append("\n".join(out))
