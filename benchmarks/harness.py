"""Harness logic with no TensorFlow in it: statistics, alternation, subprocesses, markdown."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Iterable, Optional, Sequence

IMPLS = ("ours", "ours-keras", "tfrs", "keras-embedding")
# The DLRM model with constant activations and no embedding work: what no embedding layer
# can beat, measured beside the others (DLRM workload only).
DENSE_ONLY = "dense-only"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Stats:
  """Median and spread of repeated measurements."""

  n: int
  median: float
  lo: float  # min
  hi: float  # max
  q1: float
  q3: float

  def scaled(self, f) -> "Stats":
    """Applies a monotonic map (e.g. 1/x, x*1000); a decreasing one swaps lo/hi and q1/q3."""
    vals = [f(v) for v in (self.median, self.lo, self.hi, self.q1, self.q3)]
    med, a, b, c, d = vals
    return Stats(self.n, med, min(a, b), max(a, b), min(c, d), max(c, d))


def quantile(sorted_values: Sequence[float], q: float) -> float:
  """Linear-interpolated quantile (NumPy's default method) of sorted values."""
  if not sorted_values:
    raise ValueError("no values")
  pos = (len(sorted_values) - 1) * q
  i = int(pos)
  j = min(i + 1, len(sorted_values) - 1)
  return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (pos - i)


def summarize(values: Iterable[float]) -> Stats:
  v = sorted(float(x) for x in values)
  if not v:
    raise ValueError("summarize() needs at least one value")
  return Stats(len(v), quantile(v, 0.5), v[0], v[-1], quantile(v, 0.25), quantile(v, 0.75))


def alternate(impls: Sequence[str], rounds: int) -> list[tuple[int, str]]:
  """[(round, impl)] in the order A B C A B C ...: each round runs every implementation once."""
  return [(r, impl) for r in range(rounds) for impl in impls]


def schedule(
  variants: Sequence[Any], impls: Sequence[str], rounds: int
) -> list[tuple[int, Any, str]]:
  """[(round, variant, impl)]: per round and variant, implementations alternate A B A B."""
  return [(r, v, impl) for r in range(rounds) for v in variants for impl in impls]


def fmt_num(x: Optional[float], digits: int = 3) -> str:
  """Human number with `digits` significant digits and thousands separators."""
  if x is None:
    return "–"
  if x == 0:
    return "0"
  ax = abs(x)
  if ax >= 10**digits:
    return f"{x:,.0f}"
  decimals = max(0, digits - 1 - int(_floor_log10(ax)))
  return f"{x:,.{decimals}f}"


def _floor_log10(x: float) -> int:
  n = 0
  while x >= 10:
    x /= 10
    n += 1
  while x < 1:
    x *= 10
    n -= 1
  return n


def fmt_stat(s: Optional[Stats], digits: int = 3) -> str:
  """'median (min–max, n=5)'."""
  if s is None:
    return "–"
  return f"{fmt_num(s.median, digits)} ({fmt_num(s.lo, digits)}–{fmt_num(s.hi, digits)}, n={s.n})"


def fmt_ratio(x: Optional[float]) -> str:
  if x is None:
    return "–"
  return f"{x:.2f}x" if x < 100 else f"{x:,.0f}x"


def fmt_bytes(b: Optional[float]) -> str:
  if b is None:
    return "–"
  return f"{b / 2**30:.2f} GiB"


def target_mark(value: Optional[float], target: float, higher_is_better: bool = True) -> str:
  if value is None:
    return "n/a"
  ok = value >= target if higher_is_better else value <= target
  return "MET" if ok else "NOT MET"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table; cells are str()-ed, pipes escaped."""
  cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
  for row in cells:
    if len(row) != len(headers):
      raise ValueError(f"row {row} has {len(row)} cells, expected {len(headers)}")
  out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
  out += ["| " + " | ".join(row) + " |" for row in cells]
  return "\n".join(out)


def parse_result(stdout: str) -> Optional[dict]:
  """The JSON of the last `RESULT {...}` line of a worker's stdout."""
  for line in reversed(stdout.splitlines()):
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT ") :])
  return None


def worker_env(impl: str) -> dict:
  env = dict(os.environ)
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  env.pop("TF_USE_LEGACY_KERAS", None)
  if impl == "tfrs":
    env["TF_USE_LEGACY_KERAS"] = "1"  # tfrs 0.7.7 only imports with legacy Keras
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def run_worker(spec: dict, timeout: float, log: Any = None) -> dict:
  """Runs `python -m benchmarks.worker spec` in a fresh process; {'error': ...} on failure."""
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
      cwd=REPO_ROOT,
      env=worker_env(spec.get("impl", "")),
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f}s", "wall_s": time.perf_counter() - t0}
  result = parse_result(proc.stdout)
  if result is None:
    tail = (proc.stderr or "").strip().splitlines()[-5:]
    return {
      "error": f"exit {proc.returncode}: " + " / ".join(tail),
      "wall_s": time.perf_counter() - t0,
    }
  result["process_wall_s"] = time.perf_counter() - t0
  if log is not None:
    print(
      f"    {spec.get('impl')} {spec.get('opt', '')}: {result['process_wall_s']:.0f}s",
      file=log,
      flush=True,
    )
  return result


def run_in_environment(
  python: str, module: str, folder: str, spec: dict, what: str, timeout: float
) -> dict:
  """Runs `python -m module folder` (`python` of another virtual environment, from the
  repository's root) with `spec` written to folder/spec.json; returns the folder/result.json it
  wrote, or raises naming `what`."""
  with open(os.path.join(folder, "spec.json"), "w", encoding="utf-8") as f:
    json.dump(spec, f)
  done = subprocess.run(
    [python, "-m", module, folder], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
  )
  if done.returncode:
    raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
  with open(os.path.join(folder, "result.json"), encoding="utf-8") as f:
    return json.load(f)
