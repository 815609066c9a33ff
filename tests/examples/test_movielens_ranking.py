"""The quick start (`make demo`) end to end, in a subprocess, with small settings."""

import os
import re
import subprocess
import sys

import pytest

from child_process import tensorflow_log_lines

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

# A user who set no TensorFlow log level (the tests' own environment sets one).
USER_ENV = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
  output_dir = tmp_path_factory.mktemp("demo")
  command = [
    sys.executable,
    "-m",
    "examples.movielens_ranking",
    "--output_dir",
    str(output_dir),
    "--epochs",
    "2",
    "--batch_size",
    "512",
  ]
  result = subprocess.run(
    command,
    capture_output=True,
    text=True,
    timeout=240,
    env=USER_ENV,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return output_dir, result.stdout, result.stderr


def test_prints_its_own_progress_not_tensorflows_messages(demo):
  _, stdout, stderr = demo
  assert "epoch 1: train loss" in stdout
  # Start-up (CUDA probes, CPU-feature notices) and graph-optimizer warnings about the layer's
  # input checks: none, in either stream.
  assert tensorflow_log_lines(stdout + stderr) == [], stderr[-3000:]


def test_verbose_shows_tensorflows_messages(tmp_path):
  command = [sys.executable, "-m", "examples.movielens_ranking", "--verbose"]
  command += ["--output_dir", str(tmp_path), "--epochs", "1", "--batch_size", "1024"]
  result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=USER_ENV)
  assert result.returncode == 0, result.stderr[-3000:]
  assert tensorflow_log_lines(result.stderr), result.stderr[-3000:]


def test_loss_falls(demo):
  _, stdout, _ = demo
  losses = [float(x) for x in re.findall(r"^epoch \d+: train loss ([\d.]+)", stdout, re.M)]
  assert len(losses) == 2, stdout
  assert losses[-1] < losses[0]


def test_beats_the_mean_rating(demo):
  _, stdout, _ = demo
  match = re.search(r"Test RMSE ([\d.]+) vs ([\d.]+) predicting the mean rating", stdout)
  assert match, stdout
  test_rmse, baseline = map(float, match.groups())
  assert baseline == pytest.approx(0.2645, abs=1e-3)  # the synthetic data's mean baseline
  assert test_rmse < baseline - 0.02


def test_checkpoint_and_saved_model_written(demo):
  output_dir, stdout, _ = demo
  checkpoints = output_dir / "checkpoints"
  assert (checkpoints / "checkpoint").is_file()
  assert list(checkpoints.glob("ckpt-1.index"))
  assert (output_dir / "saved_model" / "saved_model.pb").is_file()
  difference = float(re.search(r"max \|difference\| ([\d.e+-]+) stars", stdout).group(1))
  assert difference < 1e-4  # the reloaded export predicts what the trained model predicts


def test_plot_written(demo):
  output_dir, _, _ = demo
  plot = output_dir / "training_curves.png"
  assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_titled_recommendations_printed(demo):
  _, stdout, _ = demo
  blocks = re.findall(
    r"Top 5 movies for user \d+ \(reloaded SavedModel\):\n((?:  .*\n){5})", stdout
  )
  assert len(blocks) == 3, stdout
  for block in blocks:
    for line in block.splitlines():
      rating, title = re.match(r"\s+([\d.]+)  (.+)", line).groups()
      assert 1.0 <= float(rating) <= 5.0
      assert re.search(r"\(\d{4}\)$", title)  # a title with its year
