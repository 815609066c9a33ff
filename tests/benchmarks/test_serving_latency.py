"""benchmarks/serving_latency.py's id draws and report, on made-up timings (no export)."""

from __future__ import annotations

import numpy as np

from benchmarks import serving_latency as sl


def test_draw_ids_in_range_and_zipf_is_skewed():
  rng = np.random.default_rng(0)
  for distribution in ("uniform", "zipf"):
    ids = sl.draw_ids(rng, 1_000, 10_000, distribution)
    assert ids.shape == (10_000,) and ids.min() >= 0 and ids.max() < 1_000
  uniform = np.bincount(sl.draw_ids(rng, 1_000, 10_000, "uniform"), minlength=1_000)
  zipf = np.bincount(sl.draw_ids(rng, 1_000, 10_000, "zipf"), minlength=1_000)
  assert zipf.max() > 10 * uniform.max()  # a few hot rows
  assert np.argmax(zipf) != 0  # scattered: the hottest row is not row 0


def _results():
  results = {}
  for i, name in enumerate(sl.NAMES):
    rows = [
      {"ids": ids, "batch": batch, "calls": 50, "p50_ms": 1.0 + i, "p99_ms": 2.0 + i}
      | {"examples_per_s": batch / (1.0 + i) * 1e3}
      for ids in ("uniform", "zipf")
      for batch in sl.BATCH_SIZES
    ]
    results[name] = {"rows": rows, "table_mb": 10.0 / (i + 1), "export_mb": 11.0, "peak_rss_mb": 9}
  return results


def test_report_of_the_large_case_shape(tmp_path):
  results = _results()
  table = sl._table(results, 500.0)
  assert "| tpu_embedding int8 | zipf | 1024 | 4.000 | 5.000 | 4.00 | 2.50 |" in table
  verdicts = sl._verdicts(results)
  assert "int8 p50 at batch 1024, uniform ids, 4.00x float32's" in verdicts
  assert "int8 p50 at batch 1024, zipf ids, 4.00x float32's" in verdicts
  sl._plot(results, str(tmp_path / "plot.png"), "title")
  assert (tmp_path / "plot.png").stat().st_size > 0
  assert sl.CASES["large"]["ids"] == sl.CASES["wide"]["ids"] == ("uniform", "zipf")


def test_python_m_benchmarks_serving_large_runs_the_script_on_its_own(monkeypatch):
  import subprocess

  from benchmarks import __main__ as entry

  calls = []
  monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd))
  assert not entry._stand_alone(["serving", "--quick"])  # the default case runs in cases.py
  assert entry._stand_alone(["serving", "--large", "--quick"])
  assert entry._stand_alone(["serving", "--case", "wide"])
  assert [c[1].endswith("serving_latency.py") for c in calls] == [True, True]
  assert [c[2:] for c in calls] == [["--large", "--quick"], ["--case", "wide"]]
