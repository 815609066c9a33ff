"""The benchmark cases: what each worker process runs, and the report built from the results.

Cases (names for `python -m benchmarks <case>`):
  dlrm        1. DLRM-shaped training step + the embedding part alone (Adagrad, Adam)
  table-size  2. one table of 1e4..1e7 rows, dim 32, one-hot: step time per size
  batch       3. DLRM tables, embedding part alone, batch 256..65536 (Adagrad): examples/s
  limit       4. random-row gather/scatter bandwidth vs. the bytes the engine moves
  memory      5. peak RSS training a 1e7 x 32 table (Adagrad, Adam) vs. table + slot bytes
  serving     6. serving latency (benchmarks/serving_latency.py, another engineer's script)
  jit         7. DLRM and embedding only with jit_compile=True: ours (XLA path) vs tfrs and
                 Keras Embedding under jit, and vs ours without XLA (compiled kernels); the
                 PartialTPUEmbedding replicated side (tables of <= 10,000 rows) with and without XLA

Processes are shared where cases measure the same tables: `dlrm` and `batch` run in one process
per (implementation, optimizer); `table-size` and `memory` too (the 1e7 table is built first, so
the peak RSS read right after it is that of a fresh process training only that table).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Optional

import numpy as np

from benchmarks import harness as h

CASES = ("dlrm", "table-size", "batch", "limit", "memory", "serving", "jit")
OPTS = ("adagrad", "adam")
SLOTS = {"adagrad": 1, "adam": 2}
DLRM_BATCH = 4096
# Case 7: (implementation, jit_compile) in run order; `<impl>/xla` labels the compiled ones.
# tfrs runs without XLA only: it requires a legacy Keras optimizer, whose sparse update
# deduplicates with tf.unique, which XLA cannot compile (measured: the step fails to compile).
JIT_VARIANTS = (("ours", True), ("ours", False), ("tfrs", False), ("keras-embedding", True))
PARTIAL_VARIANTS = (("ours-partial", True), ("ours-partial", False))
REPLICATED_ROWS = 10_000  # PartialTPUEmbedding's default size_threshold


def dlrm_sizes() -> list[int]:
  return [10**6] * 10 + [int(v) for v in np.logspace(2, 5, 16)]


@dataclasses.dataclass
class Settings:
  quick: bool
  reps: int  # timed repetitions per process (after warm-up)
  rounds: int  # fresh processes per implementation, alternating A B A B
  rep_seconds: float  # target length of one repetition (steps per rep adapt, >= 1)
  max_steps: int
  warmup: int  # steps after the tracing step
  budget_s: float  # per measurement: slow implementations get fewer reps, marked partial
  table_sizes: tuple
  batches: tuple
  timeout_s: float
  limit_rows: int  # random rows per bandwidth measurement

  @classmethod
  def make(cls, quick: bool) -> "Settings":
    if quick:
      return cls(
        True,
        reps=5,
        rounds=1,
        rep_seconds=0.15,
        max_steps=10,
        warmup=1,
        budget_s=3,
        table_sizes=(10**7, 10**4),
        batches=(1024,),
        timeout_s=400,
        limit_rows=500_000,
      )
    return cls(
      False,
      reps=5,
      rounds=1,
      rep_seconds=1.0,
      max_steps=40,
      warmup=3,
      budget_s=45,
      table_sizes=(10**7, 10**6, 10**5, 10**4),
      batches=(256, 1024, 16384, 65536),
      timeout_s=1200,
      limit_rows=2_000_000,
    )


def base_spec(s: Settings, impl: str, opt: str, dim: int) -> dict:
  return {
    "impl": impl,
    "opt": opt,
    "dim": dim,
    "reps": s.reps,
    "rep_seconds": s.rep_seconds,
    "max_steps": s.max_steps,
    "warmup": s.warmup,
    "budget_s": s.budget_s,
    "num_batches": 4,
  }


def plan(cases: set[str], s: Settings) -> list[tuple[str, str, dict]]:
  """[(family, label, spec)] in run order: one process per (optimizer, implementation).

  Implementations alternate A B C D A B C D within each optimizer and round. A process first
  trains the 1e7-row table (so its peak RSS is that of a fresh process: case 5), then the DLRM
  tables (cases 1 and 3), then the smaller single tables (case 2).
  """
  jobs = []
  impls = h.IMPLS + ((h.DENSE_ONLY,) if "dlrm" in cases else ())
  for r, opt, impl in h.schedule(OPTS, impls, s.rounds):
    if impl == h.DENSE_ONLY:
      jobs.append(
        (
          "train",
          f"round {r + 1}: {opt} {impl}",
          dict(
            base_spec(s, impl, opt, 16),
            groups=[
              {
                "kind": "dlrm",
                "sizes": dlrm_sizes(),
                "dim": 16,
                "multi_hot": [0, 1, 2],
                "measure": [{"workload": "dlrm", "batch": DLRM_BATCH}],
              }
            ],
          ),
        )
      )
      continue
    groups = []
    one_table = lambda n: {
      "kind": "table",
      "sizes": [n],
      "dim": 32,
      "multi_hot": [],
      "measure": [{"workload": "emb", "batch": 4096}],
    }
    if cases & {"table-size", "memory"}:
      groups.append(one_table(max(s.table_sizes)))
    measure = []
    if "dlrm" in cases:
      measure += [
        {"workload": "emb", "batch": DLRM_BATCH},
        {"workload": "dlrm", "batch": DLRM_BATCH},
      ]
    if "batch" in cases and opt == "adagrad":
      if "dlrm" not in cases:
        measure.append({"workload": "emb", "batch": DLRM_BATCH})
      measure += [{"workload": "emb", "batch": b} for b in s.batches if b != DLRM_BATCH]
    if measure:
      groups.append(
        {
          "kind": "dlrm",
          "sizes": dlrm_sizes(),
          "dim": 16,
          "multi_hot": [0, 1, 2],
          "measure": measure,
        }
      )
    if "table-size" in cases:
      groups += [one_table(n) for n in sorted(s.table_sizes, reverse=True)[1:]]
    if groups:
      jobs.append(
        ("train", f"round {r + 1}: {opt} {impl}", dict(base_spec(s, impl, opt, 16), groups=groups))
      )
  if "jit" in cases:
    jobs += jit_plan(s)
  if cases & {"limit"}:
    jobs.append(
      (
        "limit",
        "gather/scatter bandwidth",
        {
          "workload": "limit",
          "impl": "numpy",
          "reps": 3 if s.quick else 5,
          "n_rows": s.limit_rows,
          "shapes": [[10**6, 16], [10**7, 32]],
        },
      )
    )
  return jobs


def impl_label(impl: str, jit_compile: bool) -> str:
  return f"{impl}/xla" if jit_compile else impl


def jit_plan(s: Settings) -> list[tuple[str, str, dict]]:
  """Case 7: one process per (optimizer, implementation, jit_compile)."""
  jobs = []
  for r, opt, (impl, jit) in h.schedule(OPTS, JIT_VARIANTS + PARTIAL_VARIANTS, s.rounds):
    if impl == "ours-partial":
      group = {
        "kind": "jit-partial",
        "sizes": [n for n in dlrm_sizes() if n <= REPLICATED_ROWS],
        "dim": 16,
        "multi_hot": [],
        "measure": [{"workload": "emb", "batch": DLRM_BATCH}],
      }
    else:
      group = {
        "kind": "jit",
        "sizes": dlrm_sizes(),
        "dim": 16,
        "multi_hot": [0, 1, 2],
        # DLRM first: a current tf-keras optimizer is built on the variables of its
        # first step and then refuses any other; the embedding-only step uses a subset.
        "measure": [
          {"workload": "dlrm", "batch": DLRM_BATCH},
          {"workload": "emb", "batch": DLRM_BATCH},
        ],
      }
    jobs.append(
      (
        "train",
        f"round {r + 1}: {opt} {impl_label(impl, jit)}",
        dict(base_spec(s, impl, opt, 16), jit_compile=jit, groups=[group]),
      )
    )
  return jobs


def run(cases: set[str], s: Settings, out_dir: str) -> dict:
  """Runs the planned processes one after another; returns raw results (saved as JSON)."""
  jobs = plan(cases, s)
  raw = {
    "settings": dataclasses.asdict(s),
    "cases": sorted(cases),
    "runs": [],
    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    "load_avg_start": os.getloadavg(),
  }
  t0 = time.perf_counter()
  for i, (family, label, spec) in enumerate(jobs):
    print(f"[{time.perf_counter() - t0:6.0f}s] ({i + 1}/{len(jobs)}) {family}: {label}", flush=True)
    result = h.run_worker(spec, s.timeout_s)
    if "error" in result:
      print(f"    ERROR: {result['error']}", flush=True)
    else:
      print(f"    done in {result.get('process_wall_s', 0):.0f}s", flush=True)
    raw["runs"].append({"family": family, "spec": spec, "result": result})
  if "serving" in cases:
    raw["serving"] = run_serving(s, out_dir)
  raw["total_s"] = time.perf_counter() - t0
  raw["load_avg_end"] = os.getloadavg()
  return raw


SERVING_SCRIPT = os.path.join(h.REPO_ROOT, "benchmarks", "serving_latency.py")


def run_serving(s: Settings, out_dir: str) -> dict:
  if not os.path.exists(SERVING_SCRIPT):
    return {"missing": True}
  cmd = [sys.executable, SERVING_SCRIPT, "--out", out_dir] + (["--quick"] if s.quick else [])
  print("serving: " + " ".join(cmd[1:]), flush=True)
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(
      cmd,
      cwd=h.REPO_ROOT,
      env=h.worker_env(""),
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return {"error": "timed out after 600s"}
  return {
    "returncode": proc.returncode,
    "stdout": proc.stdout,
    "stderr_tail": "\n".join(proc.stderr.splitlines()[-5:]),
    "wall_s": time.perf_counter() - t0,
    "command": "python benchmarks/serving_latency.py" + (" --quick" if s.quick else ""),
  }


# ---------------------------------------------------------------------------------------------
# Report


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

  # 1 ----------------------------------------------------------------------------------------
  def dlrm(self) -> None:
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
        ours = ex_per_s(self.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", "ours"))
        for impl in h.IMPLS + ((h.DENSE_ONLY,) if workload == "dlrm" else ()):
          row = self.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", impl)
          eps = ex_per_s(row)
          table.append(
            [
              wname,
              opt,
              impl,
              h.fmt_stat(ms(row)),
              h.fmt_stat(eps),
              "1" if impl == "ours" else h.fmt_ratio(ratio(ours, eps)),
              note(row, self.s),
            ]
          )
    out.append(
      h.markdown_table(
        [
          "model",
          "optimizer",
          "implementation",
          "ms/step median (min–max, n)",
          "examples/s median (min–max, n)",
          "ours/x",
          "notes",
        ],
        table,
      )
    )
    out += ["", self._dense_bound()]
    self.sections.append("\n".join(out))
    for workload, opt, goal, label in (
      ("dlrm", "adam", 5, "DLRM Adam: ours >= 5x tfrs"),
      ("dlrm", "adagrad", 1.15, "DLRM Adagrad: ours >= 1.15x tfrs"),
      ("emb", "adagrad", 2, "embedding only Adagrad: ours >= 2x tfrs"),
      ("emb", "adam", 20, "embedding only Adam: ours >= 20x tfrs"),
    ):
      r = ratio(
        ex_per_s(self.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", "ours")),
        ex_per_s(self.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", "tfrs")),
      )
      self.target(label, r, goal, "{:.2f}x")
    self._bar_plot()

  # 7 ----------------------------------------------------------------------------------------
  def jit(self) -> None:
    out = [
      "## 7. Under jit_compile=True: the XLA path",
      "",
      "Case 1's tables and workloads, every step a `tf.function(jit_compile=True)` (`/xla`), "
      "except `ours` (no XLA: the compiled-kernel path) and `tfrs`, which cannot compile "
      "with XLA (it requires a legacy Keras optimizer, whose sparse update calls "
      "`tf.unique`); `keras-embedding/xla` uses the current tf-keras optimizers, which do. "
      "`x/tfrs` = x's examples/s over tfrs's. Partial: `PartialTPUEmbedding(size_threshold=None)` on case 1's tables "
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
        base = ex_per_s(self.get(family, workload, opt, DLRM_BATCH, "dlrm", "tfrs"))
        for impl, jit in variants:
          row = self.get(family, workload, opt, DLRM_BATCH, "dlrm", impl_label(impl, jit))
          eps = ex_per_s(row)
          table.append(
            [
              f"{'partial ' if family == 'jit-partial' else ''}{workload}",
              opt,
              impl_label(impl, jit),
              h.fmt_stat(ms(row)),
              h.fmt_stat(eps),
              h.fmt_ratio(ratio(eps, base)),
              note(row, self.s),
            ]
          )
    out.append(
      h.markdown_table(
        [
          "model",
          "optimizer",
          "implementation",
          "ms/step median (min–max, n)",
          "examples/s median (min–max, n)",
          "x/tfrs",
          "notes",
        ],
        table,
      )
    )
    self.sections.append("\n".join(out))
    speed = lambda family, workload, opt, impl: ex_per_s(
      self.get(family, workload, opt, DLRM_BATCH, "dlrm", impl)
    )
    for workload, opt, goal, label in (
      ("dlrm", "adam", 5, "jit DLRM Adam: ours/xla >= 5x tfrs"),
      ("dlrm", "adagrad", 1, "jit DLRM Adagrad: ours/xla >= tfrs"),
      ("emb", "adagrad", 1.5, "jit embedding only Adagrad: ours/xla >= 1.5x tfrs"),
      ("emb", "adam", 1.5, "jit embedding only Adam: ours/xla >= 1.5x tfrs"),
    ):
      self.target(
        label,
        ratio(speed("jit", workload, opt, "ours/xla"), speed("jit", workload, opt, "tfrs")),
        goal,
        "{:.2f}x",
      )
    for opt in OPTS:
      self.target(
        f"Partial replicated side {opt}: XLA step within 2x of compiled kernels",
        ratio(
          speed("jit-partial", "emb", opt, "ours-partial/xla"),
          speed("jit-partial", "emb", opt, "ours-partial"),
        ),
        0.5,
        "{:.2f}x",
      )

  def _dense_bound(self) -> str:
    """How much of the speed-up the dense MLPs allow over tfrs ours reaches, with Adagrad."""
    get = lambda impl: ex_per_s(self.get("dlrm", "dlrm", "adagrad", DLRM_BATCH, "dlrm", impl))
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

  def _bar_plot(self) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (workload, title) in zip(axes, (("dlrm", "DLRM step"), ("emb", "embedding only"))):
      x = np.arange(len(OPTS))
      width = 0.2
      for i, impl in enumerate(h.IMPLS):
        vals, errs = [], [[], []]
        for opt in OPTS:
          st = ex_per_s(self.get("dlrm", workload, opt, DLRM_BATCH, "dlrm", impl))
          vals.append(st.median if st else 0)
          errs[0].append(st.median - st.lo if st else 0)
          errs[1].append(st.hi - st.median if st else 0)
        ax.bar(x + (i - 1.5) * width, vals, width, yerr=errs, label=impl, capsize=2)
      ax.set_xticks(x, OPTS)
      ax.set_yscale("log")
      ax.set_ylabel("examples/s (log)")
      ax.set_title(f"{title}, batch {DLRM_BATCH}")
    axes[0].legend(fontsize=8)
    self._save(fig, "dlrm.png")

  # 2 ----------------------------------------------------------------------------------------
  def table_size(self) -> None:
    sizes = sorted(self.s.table_sizes)
    out = [
      "## 2. Scaling with table size (one table, dim 32, batch 4096, one-hot Zipf ids)",
      "",
      "Step time in ms, median (min–max, n). Loss = sum of squared activations.",
      "",
    ]
    table = []
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, opt in zip(axes, OPTS):
      for impl in h.IMPLS:
        cells, med = [], []
        for n in sizes:
          st = ms(self.get("table", "emb", opt, 4096, n, impl))
          cells.append(h.fmt_stat(st))
          med.append(st.median if st else np.nan)
        r = med[-1] / med[0] if len(med) > 1 and not np.isnan(med[0] + med[-1]) else None
        got = [self.get("table", "emb", opt, 4096, n, impl) for n in sizes]
        partial = any(r.partial for r in got if r is not None)
        table.append(
          [opt, impl]
          + cells
          + ["–" if r is None else f"{r:.2f}", "PARTIAL (budget)" if partial else ""]
        )
        if impl == "ours" and opt == "adam":
          self.target(
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
    self._save(fig, "table_size.png")
    out.append(
      h.markdown_table(
        ["optimizer", "implementation"]
        + [f"{n:.0e} rows" for n in sizes]
        + [f"t({sizes[-1]:.0e})/t({sizes[0]:.0e})", "notes"],
        table,
      )
    )
    self.sections.append("\n".join(out))

  # 3 ----------------------------------------------------------------------------------------
  def batch(self) -> None:
    batches = sorted(set(self.s.batches) | {DLRM_BATCH})
    out = [
      "## 3. Scaling with batch (DLRM tables, embedding part alone, Adagrad)",
      "",
      "Examples/s, median (min–max, n).",
      "",
    ]
    table = []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in h.IMPLS:
      cells, med = [], []
      for b in batches:
        st = ex_per_s(self.get("dlrm", "emb", "adagrad", b, "dlrm", impl))
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
    self._save(fig, "batch.png")
    out.append(h.markdown_table(["implementation"] + [f"batch {b}" for b in batches], table))
    self.sections.append("\n".join(out))

  # 4 ----------------------------------------------------------------------------------------
  def limit(self) -> None:
    lim = next((r["result"] for r in self.raw["runs"] if r["family"] == "limit"), None)
    out = ["## 4. Physical limit: random-row bandwidth vs. what the engine moves", ""]
    if lim is None or "error" in lim:
      out.append(f"Bandwidth measurement failed: {lim and lim.get('error')}")
      self.sections.append("\n".join(out))
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
    cases = [
      ("case 1 emb", "dlrm", "emb", opt, DLRM_BATCH, "dlrm", 16, "1000000x16") for opt in OPTS
    ]
    cases += [
      (f"case 2 {n:.0e} rows", "table", "emb", opt, 4096, n, 32, "10000000x32")
      for n in sorted(self.s.table_sizes)
      for opt in OPTS
    ]
    for label, fam, wl, opt, b, key, dim, shape in cases:
      row = self.get(fam, wl, opt, b, key, "ours")
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
    self.sections.append("\n".join(out))
    for label, opt, frac in fractions:
      if label.startswith("case 1") or "1e+07" in label:
        self.target(f"bandwidth fraction, {label} {opt}: >= 1/4 of gather", frac, 0.25, "{:.3f}")

  # 5 ----------------------------------------------------------------------------------------
  def memory(self) -> None:
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
        row = self.get("table", "emb", opt, 4096, n, impl)
        peak = row.vmhwm if row else None
        base = next(
          (
            r["result"].get("rss_after_import")
            for r in self.raw["runs"]
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
          self.target(
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
    self.sections.append("\n".join(out))

  # 6 ----------------------------------------------------------------------------------------
  def serving(self) -> None:
    sv = self.raw.get("serving")
    out = ["## 6. Serving latency (exported SavedModel, batch 1 / 64 / 1024)", ""]
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
        f"From `{sv['command']}` (written by another engineer; its own output follows).",
        "",
        "\n".join(
          line for line in sv["stdout"].strip().splitlines() if not line.startswith("Wrote ")
        ),
      ]
    self.sections.append("\n".join(out))

  # -----------------------------------------------------------------------------------------
  def _save(self, fig, name: str) -> None:
    path = os.path.join(self.out_dir, name)
    try:
      fig.tight_layout()
      fig.savefig(path, dpi=90)
      self.plots.append(name)
    except ValueError as e:  # e.g. nothing measured: no positive value on a log axis
      self.errors.append(f"plot {name} not written: {e}")
    finally:
      _plt().close(fig)

  def build(self) -> str:
    cases = set(self.raw["cases"])
    for name, section in (
      ("dlrm", self.dlrm),
      ("table-size", self.table_size),
      ("batch", self.batch),
      ("limit", self.limit),
      ("memory", self.memory),
      ("serving", self.serving),
      ("jit", self.jit),
    ):
      if name in cases:
        try:
          section()
        except Exception as e:  # pylint: disable=broad-except
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


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt
