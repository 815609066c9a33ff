"""The workers' results, pooled per measurement, and the statistics the report shows."""

from __future__ import annotations

import dataclasses
from typing import Optional

from benchmarks import harness as h
from benchmarks.cases import Settings, impl_label


@dataclasses.dataclass
class Row:
  family: str
  impl: str
  opt: str
  workload: str
  batch: int
  sizes: tuple
  step_s: list
  partial: bool
  steps_per_rep: int
  unique_rows: float
  vmhwm: int
  first_step_s: float


def collect(raw: dict) -> tuple[dict, list[str]]:
  """{(family, workload, opt, batch, rows-key, impl): Row (reps of all rounds pooled)}, errors."""
  rows: dict = {}
  errors = []
  for run_ in raw["runs"]:
    spec, result = run_["spec"], run_["result"]
    if "error" in result:
      errors.append(f"{run_['family']} {spec.get('impl')} {spec.get('opt', '')}: {result['error']}")
      continue
    for m in result.get("measurements", []):
      sizes = tuple(m["sizes"])
      kind = m.get("kind") or run_["family"]
      impl = impl_label(spec["impl"], spec.get("jit_compile", False))
      key = (
        kind,
        m["workload"],
        spec["opt"],
        m["batch"],
        sizes[0] if kind == "table" else "dlrm",
        impl,
      )
      if key in rows:
        old = rows[key]
        old.step_s += m["step_s"]
        old.partial = old.partial or m["partial"]
        old.vmhwm = max(old.vmhwm, m["vmhwm"])
      else:
        rows[key] = Row(
          kind,
          impl,
          spec["opt"],
          m["workload"],
          m["batch"],
          sizes,
          list(m["step_s"]),
          m["partial"],
          m["steps_per_rep"],
          m["unique_rows"],
          m["vmhwm"],
          m["first_step_s"],
        )
  return rows, errors


def ex_per_s(row: Optional[Row]) -> Optional[h.Stats]:
  if row is None or not row.step_s:
    return None
  return h.summarize(row.step_s).scaled(lambda t: row.batch / t)


def ms(row: Optional[Row]) -> Optional[h.Stats]:
  if row is None or not row.step_s:
    return None
  return h.summarize(row.step_s).scaled(lambda t: t * 1000)


def ratio(a: Optional[h.Stats], b: Optional[h.Stats]) -> Optional[float]:
  if a is None or b is None or b.median == 0:
    return None
  return a.median / b.median


def note(row: Optional[Row], s: Settings) -> str:
  if row is None:
    return "not run"
  bits = [f"{row.steps_per_rep} step(s)/rep"]
  if row.partial:
    bits.append(
      f"PARTIAL: {len(row.step_s)} of {s.reps * s.rounds} reps within the {s.budget_s:.0f}s budget"
    )
  return "; ".join(bits)


def timing_row(model: str, opt: str, impl: str, row: Optional[Row], ratio_text: str, s) -> list:
  """One row of a timing table (see `timing_table`)."""
  return [
    model,
    opt,
    impl,
    h.fmt_stat(ms(row)),
    h.fmt_stat(ex_per_s(row)),
    ratio_text,
    note(row, s),
  ]


def timing_table(rows: list, ratio_header: str) -> str:
  """Markdown table of `timing_row`s: ms/step and examples/s per model, optimizer and
  implementation, with a ratio column named `ratio_header`."""
  header = ["model", "optimizer", "implementation", "ms/step median (min–max, n)"]
  header += ["examples/s median (min–max, n)", ratio_header, "notes"]
  return h.markdown_table(header, rows)


def pyplot():
  """matplotlib.pyplot on the file-only backend, imported when a plot is drawn."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt
