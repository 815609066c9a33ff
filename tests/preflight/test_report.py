"""The pre-flight report: its markdown (figures worked by hand), its plot and its command line
(in process; one child process in the integration tier)."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import preflight, tf_internals
from tpu_embedding.preflight import __main__ as cli
from tpu_embedding.preflight import report, sources

from preflight_features import feature_config

emb = tf.tpu.experimental.embedding
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = 16


def _batches(count=3, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      "user": tf.constant(rng.integers(0, 100, BATCH)),
      "movie": tf.constant(rng.integers(0, 50, BATCH)),
    }
    for _ in range(count)
  ]


def _model():
  return sources.ModelConfig(feature_config(), "adagrad", "two tables")


@pytest.mark.skipif(tf_internals.SPARSE_CORE_CONFIG is None, reason="no SparseCore limits")
def test_the_markdown_on_sparse_core_holds_the_plan_and_the_data_statistics():
  """v5p-8: 4 chips x 4 SparseCores, rows padded to multiples of 128: each table 32 rows a
  chip at width 8 (dim 4 padded), 32 * 8 * 4 = 1024 B, and 1024 B of Adagrad accumulators.
  Activations: 16 / 4 = 4 samples, (8 + 4) floats each, forward and back: 384 B."""
  stream = io.StringIO()
  built = report.build_report(
    _model(), iter(_batches()), topology="v5p-8", batch_size=BATCH, total=3, stream=stream
  )
  text = report.markdown(built)
  assert "# TPU pre-flight: `two tables` on v5p-8" in text
  assert "v5p-8: 4 chip(s), 95.00 GiB HBM each; tables on TPUEmbeddingV2 (SparseCore)" in text
  for row in [
    "| tables | 2,048 | 0.00 |",
    "| optimizer slots | 2,048 | 0.00 |",
    "| activations + gradients | 384 | 0.00 |",
    "| **total, every table on the embedding hardware** | 4,480 | 0.00 |",
    "| HBM | 102,005,473,280 | 95.00 |",
    "| user | 100 | 8 | accumulators | 32 | 8 | 1,024 | 1,024 | 6,400 |",
    "| movie | 50 | 4 | accumulators | 32 | 8 | 1,024 | 1,024 | 1,600 |",
  ]:
    assert row in text
  assert "**PartialTPUEmbedding size_threshold:** None: every table fits replicated" in text
  # Part 1's figures, as its functions give them for the same batches:
  stats = preflight.sparse_core_stats(
    feature_config(), _batches(), num_chips=4, sparse_cores_per_chip=4, optimizer="adagrad"
  )
  limits = preflight.sparse_core_config(stats)
  (name,) = [key for key in stats if key != report.PER_CHIP]
  assert name == "movie_user"
  ids, unique = stats[name]["max_ids_per_partition"], stats[name]["max_unique_ids_per_partition"]
  assert (
    f"| movie_user | {ids} | {unique} | no | {limits.max_ids_per_table[name]} / "
    f"{limits.max_unique_ids_per_table[name]} |"
  ) in text
  assert "Over 3 batch(es)" in text
  assert "3 batches, " in text and "0 batches would fail the step" in text
  assert stream.getvalue().endswith("[##############################] 3/3 batches\n")


def test_off_sparse_core_the_data_is_not_read():
  def untouchable():
    raise AssertionError("the data was read")
    yield

  built = report.build_report(_model(), untouchable(), topology="v4-8", batch_size=BATCH)
  text = report.markdown(built)
  assert "tables on TPUEmbedding (V1 embedding engine)" in text
  # v4-8 is 4 chips: ceil(100 / 4) = 25 rows of 8, ceil(50 / 4) = 13 rows of 4, float32.
  assert f"| tables | {25 * 8 * 4 + 13 * 4 * 4:,} |" in text
  assert "SparseCore statistics: not applicable: v4-8 runs TPUEmbedding (V1" in text


def test_without_sparse_core_limits_the_plan_is_made_and_the_data_not_read(monkeypatch):
  # As under TF 2.15 and 2.16, which have no SparseCoreEmbeddingConfig.
  monkeypatch.setattr(tf_internals, "SPARSE_CORE_CONFIG", None)

  def untouchable():
    raise AssertionError("the data was read")
    yield

  built = report.build_report(_model(), untouchable(), topology="v5p-8", batch_size=BATCH)
  text = report.markdown(built)
  # v5p-8 is 4 chips of 4 SparseCores: both tables pad to 8 rows a SparseCore (100 / 16 and
  # 50 / 16 round up to 7 and 4) and to 8 columns, so 32 rows of 8 float32 a chip each.
  assert f"| tables | {2 * 32 * 8 * 4:,} |" in text
  assert f"SparseCore statistics: not computed: TensorFlow {tf.__version__} has no" in text


def test_the_plot_is_a_png_and_a_missing_matplotlib_is_named(tmp_path, monkeypatch):
  built = report.build_report(_model(), _batches(1), topology="v6e-8", batch_size=BATCH)
  path = tmp_path / "report.png"
  report.write_plot(built, str(path))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ValueError, match="The plot needs matplotlib, which is not installed"):
    report.write_plot(built, str(tmp_path / "other.png"))
  assert not (tmp_path / "other.png").exists()


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--config", "no_such_module_43"], "cannot import 'no_such_module_43'"),
    (["--config", "tpu_embedding.preflight.report:nothing"], "has no 'nothing'"),
    (["--config", "missing.keras"], "'missing.keras': no such file"),
    (["--topology", "v9-8"], "Unknown TPU topology 'v9-8'"),
    (["--data", "plain"], "expected a .csv or .tfrecord file"),
    (["--data", "no_such_module_43:batches"], "--data 'no_such_module_43:batches': cannot import"),
    (["--data", "tpu_embedding.preflight:nothing"], "has no 'nothing'"),
    (["--batch-size", "0"], "batch_size=0"),
  ],
)
def test_bad_command_lines_are_refused_by_name_and_write_nothing(tmp_path, capsys, argv, message):
  args = {
    "--config": "examples.preflight_movielens",
    "--data": "examples.preflight_movielens:batches",
    "--topology": "v6e-8",
    "--batch-size": "1024",
  }
  args.update(dict(zip(argv[::2], argv[1::2])))
  output = tmp_path / "report.md"
  flat = [item for pair in args.items() for item in pair] + ["--output", str(output)]
  assert cli.main(flat) == 2
  assert message in capsys.readouterr().err
  assert not output.exists()


@pytest.mark.integration
def test_the_command_line_on_movielens_writes_the_markdown_and_the_plot(tmp_path):
  """One child process: `python -m tpu_embedding.preflight` on the MovieLens example (its
  synthetic ratings), v6e-8."""
  output, plot = tmp_path / "report.md", tmp_path / "report.png"
  completed = subprocess.run(
    [
      sys.executable,
      "-m",
      "tpu_embedding.preflight",
      "--config",
      "examples.preflight_movielens",
      "--data",
      "examples.preflight_movielens:batches",
      "--topology",
      "v6e-8",
      "--batch-size",
      "1024",
      "--output",
      str(output),
      "--plot",
      str(plot),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert completed.returncode == 0, completed.stderr[-3000:]
  text = output.read_text()
  assert "# TPU pre-flight: `examples.preflight_movielens` on v6e-8" in text
  assert "| movie_table_user_table |" in text
  assert "**Verdict:** fits on v6e-8 (8 chip(s))" in text
  assert "/97 batches" in completed.stderr  # the progress bar: 100,000 ratings // 1024
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_on_the_dlrm_configuration(tmp_path, capsys):
  """In process (no child): the benchmarks' DLRM tables and 8 Zipf batches of 4096 on v5p-8."""
  output, plot = tmp_path / "dlrm.md", tmp_path / "dlrm.png"
  argv = ["--config", "benchmarks.preflight_dlrm", "--data", "benchmarks.preflight_dlrm:batches"]
  argv += ["--topology", "v5p-8", "--batch-size", "4096", "--output", str(output)]
  assert cli.main(argv + ["--plot", str(plot)]) == 0
  text = output.read_text()
  # Ten 10^6-row tables padded to 1000064 rows (a multiple of 8 x 16 SparseCores), 250016 a
  # chip at width 16: 16,001,024 B each, as much for Adagrad's accumulators.
  assert "| t0 | 1,000,000 | 16 | accumulators | 250,016 | 16 | 16,001,024 | 16,001,024 |" in text
  assert "PartialTPUEmbedding(size_threshold=None), every table replicated" in text
  assert "Over 8 batch(es)" in text and "8 batches would fail the step" in text
  assert "8/8 batches" in capsys.readouterr().err
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
