"""The keras-rs comparison benchmark's report on fake numbers: no timing, no training."""

from benchmarks import keras_rs_movielens as bench


def run(implementation, rmse, step_ms):
  return {
    "implementation": implementation,
    "source": "synthetic",
    "test_rmse": rmse,
    "mean_predictor_rmse": 0.26,
    "steps_per_epoch": 312,
    "train_rmse_by_epoch": [0.4, 0.3, 0.25],
    "step_ms_by_epoch": step_ms,
  }


def test_summary_takes_medians_over_rounds_without_first_epochs():
  summary = bench.summarize(
    [
      run("tpu_embedding", 0.23, [50.0, 2.0, 4.0]),
      run("tpu_embedding", 0.21, [60.0, 3.0, 9.0]),
      run("tpu_embedding", 0.22, [70.0, 1.0, 5.0]),
    ]
  )
  assert summary["rounds"] == 3
  assert summary["test_rmse"] == 0.22
  assert summary["step_ms_median"] == 3.5  # median of 2, 4, 3, 9, 1, 5


def test_markdown_table_rows_and_speedup():
  table = bench.markdown(
    [run("tpu_embedding", 0.23, [9.0, 2.0]), run("keras_rs", 0.28, [9.0, 5.0])]
  )
  lines = table.splitlines()
  assert lines[2].startswith("| `tpu_embedding.keras.DistributedEmbedding` |")
  assert "| 0.2300 | 0.2600 | 2.00 |" in lines[2]
  assert "| 0.2800 | 0.2600 | 5.00 |" in lines[3]
  assert lines[-1].endswith("tpu_embedding is 2.50x keras-rs's speed per step.")
