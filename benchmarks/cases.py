"""The benchmark cases: which worker processes run what, in which order.

The report is built from their results by `benchmarks/report.py`, one section per case in
`benchmarks/sections/<case>.py`; the plan stays in one place because cases share processes
(below).

Cases (names for `python -m benchmarks <case>`):
  dlrm        1. DLRM-shaped training step + the embedding part alone (Adagrad, Adam)
  table-size  2. one table of 1e4..1e7 rows, dim 32, one-hot: step time per size
  batch       3. DLRM tables, embedding part alone, batch 256..65536 (Adagrad): examples/s
  limit       4. random-row gather/scatter bandwidth vs. the bytes the engine moves
  memory      5. peak RSS training a 1e7 x 32 table (Adagrad, Adam) vs. table + slot bytes
  serving     6. serving latency, table bytes and peak RSS per table dtype (serving_latency.py)
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
      dlrm = [{"workload": "dlrm", "batch": DLRM_BATCH}]
      groups = [_dlrm_group(dlrm)]
    else:
      groups = _training_groups(cases, s, opt)
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


def _one_table(n: int) -> dict:
  return {
    "kind": "table",
    "sizes": [n],
    "dim": 32,
    "multi_hot": [],
    "measure": [{"workload": "emb", "batch": 4096}],
  }


def _dlrm_group(measure: list[dict]) -> dict:
  return {
    "kind": "dlrm",
    "sizes": dlrm_sizes(),
    "dim": 16,
    "multi_hot": [0, 1, 2],
    "measure": measure,
  }


def _training_groups(cases: set[str], s: Settings, opt: str) -> list[dict]:
  """What one (optimizer, implementation) process trains: the 1e7-row table first (case 5's
  peak RSS is a fresh process's), then the DLRM tables (cases 1 and 3), then the smaller
  single tables (case 2)."""
  groups = []
  if cases & {"table-size", "memory"}:
    groups.append(_one_table(max(s.table_sizes)))
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
    groups.append(_dlrm_group(measure))
  if "table-size" in cases:
    groups += [_one_table(n) for n in sorted(s.table_sizes, reverse=True)[1:]]
  return groups


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
