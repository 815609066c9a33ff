"""Case 6: serving latency, from benchmarks/serving_latency.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks import harness as h

if TYPE_CHECKING:
  from benchmarks.report import Report


def write(report: Report) -> None:
  sv = report.raw.get("serving")
  out = ["## 6. Serving: latency, table bytes and memory per table dtype (batch 1 / 64 / 1024)", ""]
  if not sv or sv.get("missing"):
    out.append(
      h.markdown_table(
        ["status"],
        [["TODO: benchmarks/serving_latency.py is missing; serving latency not measured"]],
      )
    )
  elif "error" in sv or sv.get("returncode"):
    out.append(
      f"`benchmarks/serving_latency.py` failed: {sv.get('error') or sv['returncode']}"
      f"\n\n```\n{sv.get('stderr_tail', '')}\n```"
    )
  else:
    out += [
      f"From `{sv['command']}` (its own output follows).",
      "",
      "\n".join(
        line for line in sv["stdout"].strip().splitlines() if not line.startswith("Wrote ")
      ),
    ]
  report.sections.append("\n".join(out))
