"""The benchmark report: one Markdown section (and plots) per case, targets and errors.

Each case writes its own section (`benchmarks/sections/<case>.py`); this module holds what they
share: the collected rows, the target table, saving plots, and the page around the sections.
"""

from __future__ import annotations

import os
from typing import Optional

from benchmarks import harness as h
from benchmarks.cases import Settings
from benchmarks.results import Row, collect, pyplot
from benchmarks.sections import batch, dlrm, jit, limit, memory, serving, table_size

# (case name, its section), in the report's order.
SECTIONS = (
  ("dlrm", dlrm),
  ("table-size", table_size),
  ("batch", batch),
  ("limit", limit),
  ("memory", memory),
  ("serving", serving),
  ("jit", jit),
)


class Report:
  """Markdown sections, target checks and PNG plots from collected rows."""

  def __init__(self, raw: dict, s: Settings, out_dir: str, command: str):
    self.raw, self.s, self.out_dir, self.command = raw, s, out_dir, command
    self.rows, self.errors = collect(raw)
    self.targets: list[tuple[str, str, str, str]] = []  # (target, measured, status, command)
    self.sections: list[str] = []
    self.plots: list[str] = []

  def get(self, family, workload, opt, batch, rows_key, impl) -> Optional[Row]:
    return self.rows.get((family, workload, opt, batch, rows_key, impl))

  def target(
    self, what: str, value: Optional[float], goal: float, fmt: str, higher: bool = True
  ) -> None:
    shown = "–" if value is None else fmt.format(value)
    self.targets.append((what, shown, h.target_mark(value, goal, higher), self.command))

  def save(self, fig, name: str) -> None:
    path = os.path.join(self.out_dir, name)
    try:
      fig.tight_layout()
      fig.savefig(path, dpi=90)
      self.plots.append(name)
    except ValueError as e:  # e.g. nothing measured: no positive value on a log axis
      self.errors.append(f"plot {name} not written: {e}")
    finally:
      pyplot().close(fig)

  def build(self) -> str:
    cases = set(self.raw["cases"])
    for name, section in SECTIONS:
      if name in cases:
        try:
          section.write(self)
        except Exception as e:
          self.errors.append(f"report section {name} failed: {type(e).__name__}: {e}")
    s = self.s
    head = [
      f"# Benchmarks ({'quick' if s.quick else 'full'})",
      "",
      f"Command: `{self.command}`. Started {self.raw['started']}, took "
      f"{self.raw['total_s'] / 60:.1f} min. Machine: {os.cpu_count()} CPU(s); 1-min load "
      f"average {self.raw['load_avg_start'][0]:.1f} at start, "
      f"{self.raw['load_avg_end'][0]:.1f} at end (other processes share this machine, "
      "so absolute numbers are noisy; ratios between neighbouring runs less so).",
      "",
      f"Method: every implementation runs in its own fresh process ({s.rounds} round(s), "
      "implementations alternating ours, ours-keras, tfrs, keras-embedding in each "
      f"round); after one tracing step and up to {s.warmup} warm-up steps, {s.reps} timed "
      f"repetitions per process of ~{s.rep_seconds:g}s each (at least 1 and at most "
      f"{s.max_steps} steps). Slow implementations are capped at {s.budget_s:g}s of timed "
      "repetitions per measurement: fewer repetitions are marked PARTIAL. Figures are "
      "the median and (min–max) of the repetitions.",
      "",
    ]
    if self.targets:
      head += [
        "## Targets",
        "",
        h.markdown_table(["target", "measured", "status"], [t[:3] for t in self.targets]),
        "",
      ]
    if self.errors:
      head += ["## Errors", ""] + [f"* {e}" for e in self.errors] + [""]
    plots = [f"![{p}]({p})" for p in self.plots]
    return "\n".join(head + ["\n\n".join(self.sections), ""] + plots) + "\n"
