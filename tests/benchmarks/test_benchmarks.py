"""The benchmark harness's own logic on fake numbers (no timing, no TensorFlow), and tiny runs of
the stand-alone benchmark scripts."""

import json
import os

import pytest

from benchmarks import cases
from benchmarks import harness as h
from benchmarks import report as report_lib


def test_summarize_median_spread_and_quartiles():
  s = h.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
  assert (s.n, s.median, s.lo, s.hi, s.q1, s.q3) == (5, 3.0, 1.0, 5.0, 2.0, 4.0)
  assert h.summarize([1.0, 2.0]).median == 1.5
  with pytest.raises(ValueError):
    h.summarize([])


def test_scaled_by_decreasing_map_keeps_lo_below_hi():
  s = h.summarize([0.1, 0.2, 0.4]).scaled(lambda t: 100 / t)  # seconds/step -> examples/s
  assert s.median == pytest.approx(500)
  assert (s.lo, s.hi) == (pytest.approx(250), pytest.approx(1000))
  assert s.q1 <= s.median <= s.q3


def test_alternation_runs_every_implementation_once_per_round():
  assert h.alternate(["A", "B"], 2) == [(0, "A"), (0, "B"), (1, "A"), (1, "B")]
  order = h.schedule(["adagrad", "adam"], ["A", "B"], 2)
  assert [impl for _, _, impl in order] == ["A", "B"] * 4
  assert [v for _, v, _ in order[:4]] == ["adagrad", "adagrad", "adam", "adam"]


def test_markdown_table_and_formatting():
  table = h.markdown_table(["a", "b"], [[1, "x|y"], [h.fmt_num(12345.6), h.fmt_num(0.012345)]])
  assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | x\\|y |", "| 12,346 | 0.0123 |"]
  with pytest.raises(ValueError):
    h.markdown_table(["a"], [[1, 2]])
  assert h.fmt_stat(h.summarize([1, 2, 3])) == "2.00 (1.00–3.00, n=3)"
  assert h.fmt_ratio(2.345) == "2.35x" and h.fmt_ratio(None) == "–"
  assert h.target_mark(5.1, 5) == "MET" and h.target_mark(1.4, 1.3, False) == "NOT MET"
  assert h.target_mark(None, 1) == "n/a"


def test_parse_result_and_worker_env():
  assert h.parse_result('noise\nRESULT {"x": 1}\n') == {"x": 1}
  assert h.parse_result("no result") is None
  assert h.worker_env("tfrs")["TF_USE_LEGACY_KERAS"] == "1"
  assert "TF_USE_LEGACY_KERAS" not in h.worker_env("ours")


def test_plan_shares_processes_and_alternates():
  s = cases.Settings.make(quick=True)
  jobs = cases.plan(set(cases.CASES) - {"jit"}, s)
  train = [spec for fam, _, spec in jobs if fam == "train"]
  assert [j["impl"] for j in train] == (list(h.IMPLS) + [h.DENSE_ONLY]) * 2
  assert [j["opt"] for j in train] == ["adagrad"] * 5 + ["adam"] * 5
  # The dense-only bound runs the DLRM alone.
  assert [[m["workload"] for m in g["measure"]] for g in train[4]["groups"]] == [["dlrm"]]
  groups = train[0]["groups"]
  # memory: the 1e7 table first, in a fresh process; then DLRM tables; then smaller tables
  assert [g["kind"] for g in groups] == ["table", "dlrm", "table"]
  assert groups[0]["sizes"] == [10**7] and groups[2]["sizes"] == [10**4]
  assert {m["batch"] for m in groups[1]["measure"]} == {4096, *s.batches}
  assert {m["batch"] for m in train[5]["groups"][1]["measure"]} == {4096}  # Adam: no sweep
  memory_only = cases.plan({"memory"}, s)
  assert [len(spec["groups"]) for _, _, spec in memory_only] == [1] * 8


def test_jit_plan_runs_each_variant_in_its_own_process_and_partial_on_small_tables():
  jobs = cases.plan({"jit"}, cases.Settings.make(quick=True))
  labels = [cases.impl_label(spec["impl"], spec["jit_compile"]) for _, _, spec in jobs]
  assert (
    labels
    == ["ours/xla", "ours", "tfrs", "keras-embedding/xla", "ours-partial/xla", "ours-partial"] * 2
  )
  partial = jobs[4][2]["groups"][0]
  assert partial["kind"] == "jit-partial" and max(partial["sizes"]) <= 10_000
  assert [m["workload"] for m in partial["measure"]] == ["emb"]


def _fake_raw(s):
  runs = []
  for fam, _, spec in cases.plan(set(cases.CASES) - {"serving"}, s):
    if fam == "limit":
      one = {
        "numpy_take_gbs": [2.0] * 5,
        "numpy_gather_gbs": [1.0] * 5,
        "numpy_scatter_gbs": [1.0] * 5,
        "tf_gather_gbs": [1.0] * 5,
      }
      runs.append(
        {"family": fam, "spec": spec, "result": {"limit": {"1000000x16": one, "10000000x32": one}}}
      )
      continue

    speed = {
      "ours": 1.0,
      "ours-keras": 2.0,
      "tfrs": 4.0,
      "keras-embedding": 3.0,
      "dense-only": 0.5,
      "ours/xla": 0.5,
      "keras-embedding/xla": 3.0,
      "ours-partial/xla": 1.5,
      "ours-partial": 1.0,
    }[cases.impl_label(spec["impl"], spec.get("jit_compile", False))]
    ms = [
      {
        "workload": m["workload"],
        "batch": m["batch"],
        "sizes": g["sizes"],
        "step_s": [0.01 * speed * k for k in (1, 1, 1.1, 0.9, 1)],
        "partial": False,
        "steps_per_rep": 3,
        "unique_rows": 1000.0,
        "vmhwm": 3 * 2**30,
        "first_step_s": 1.0,
        "kind": g["kind"],
      }
      for g in spec["groups"]
      for m in g["measure"]
    ]
    runs.append({"family": fam, "spec": spec, "result": {"measurements": ms}})
  return {
    "settings": {},
    "cases": sorted(set(cases.CASES) - {"serving"}),
    "runs": runs,
    "started": "now",
    "load_avg_start": [0.0],
    "load_avg_end": [0.0],
    "total_s": 60,
  }


def test_report_on_fake_results(tmp_path):
  s = cases.Settings.make(quick=True)
  raw = json.loads(json.dumps(_fake_raw(s)))
  report = report_lib.Report(raw, s, str(tmp_path), "python -m benchmarks all --quick")
  text = report.build()
  assert not report.errors, report.errors
  targets = {t[0]: t for t in report.targets}
  assert targets["DLRM Adam: ours >= 5x tfrs"][1:3] == ("4.00x", "NOT MET")
  assert targets["DLRM Adagrad: ours >= 1.15x tfrs"][1:3] == ("4.00x", "MET")
  assert "| DLRM | adam | tfrs | 40.0 (36.0–44.0, n=5) |" in text
  # dense-only takes half of ours' time: bound 8x tfrs, ours 4x = (4-1)/(8-1) of the gain.
  assert "dense MLPs alone run at 8.00x tfrs's examples/s" in text
  assert "Ours is at 4.00x, i.e. 43% of the speed-up" in text
  assert "t(1e+07)/t(1e+04)" in text
  assert targets["jit DLRM Adam: ours/xla >= 5x tfrs"][1:3] == ("8.00x", "MET")
  assert targets["Partial replicated side adam: XLA step within 2x of compiled kernels"][1:3] == (
    "0.67x",
    "MET",
  )
  assert "| partial emb | adagrad | ours-partial/xla | 15.0 (13.5–16.5, n=5) |" in text
  for png in ("dlrm.png", "table_size.png", "batch.png"):
    assert os.path.exists(tmp_path / png)


def test_static_path_formulations_times_both_and_names_the_one_update_for_picks(tmp_path):
  """One tiny run of the script (one table size, one round): its table and its saved results."""
  from benchmarks import static_path_formulations as spf  # imports TensorFlow

  settings = dict(optimizers=("adagrad",), ids=(16,), rows=(8, 64), rounds=1, steps=1)
  text = spf.run(settings, str(tmp_path), "cmd")
  lines = [line for line in text.splitlines() if line.startswith("| adagrad")]
  assert [line.split(" | ")[2:4] for line in lines] == [["8", "0.5"], ["64", "4"]]
  assert [line.split(" | ")[-2] for line in lines] == ["whole table", "unique rows"]
  saved = json.loads((tmp_path / "static_path_formulations.json").read_text())
  assert [len(r["us"]["whole table"]) for r in saved] == [1, 1]
  assert (tmp_path / "static_path_formulations.md").read_text() == text


def test_model_garden_says_how_to_set_up_the_client_when_it_is_missing(tmp_path, monkeypatch):
  from benchmarks import model_garden

  monkeypatch.setenv("MODEL_GARDEN_DIR", str(tmp_path))
  with pytest.raises(SystemExit) as exit_info:
    model_garden.main([])
  message = str(exit_info.value)
  assert f"not found under {tmp_path}" in message
  assert "pip download tf-models-official==2.20.0 --no-deps" in message
  assert "install --no-deps --target site gin-config pyyaml tensorboard" in message


def test_model_garden_table_takes_medians_per_loop_and_ours_over_tfrs():
  from benchmarks import model_garden

  def run(impl, loop, seconds, rate):
    figures = dict.fromkeys(model_garden.FIGURES, seconds)
    return {"impl": impl, "loop": loop, **figures, "steady_examples_per_s": rate}

  runs = [run("tfrs", "fit", s, 1000.0) for s in (10.0, 30.0, 20.0)]
  runs += [run("ours", "fit", s, 2000.0) for s in (24.0, 12.0, 99.0)]
  (row,) = model_garden.summarize(runs)
  assert row["medians"]["tfrs"]["first_100_steps_s"] == 20.0
  assert row["medians"]["ours"]["first_100_steps_s"] == 24.0
  assert row["ratio"]["first_100_steps_s"] == pytest.approx(1.2)
  assert row["ratio"]["steady_examples_per_s"] == 2.0
  table = model_garden.markdown([row], "partial", 300, "load 1")
  assert "| fit | ours / tfrs | 1.20x | 1.20x | 1.20x | 2.00x |" in table
