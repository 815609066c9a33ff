"""The quick start (`make demo`) end to end, in a subprocess, with small settings."""

import os
import re
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
  output_dir = tmp_path_factory.mktemp("demo")
  command = [
    sys.executable,
    "-m",
    "tpu_embedding.examples.movielens_ranking",
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
    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return output_dir, result.stdout


def test_loss_falls(demo):
  _, stdout = demo
  losses = [float(x) for x in re.findall(r"^epoch \d+: train loss ([\d.]+)", stdout, re.M)]
  assert len(losses) == 2, stdout
  assert losses[-1] < losses[0]


def test_beats_the_mean_rating(demo):
  _, stdout = demo
  match = re.search(r"Test RMSE ([\d.]+) vs ([\d.]+) predicting the mean rating", stdout)
  assert match, stdout
  test_rmse, baseline = map(float, match.groups())
  assert baseline == pytest.approx(0.2645, abs=1e-3)  # the synthetic data's mean baseline
  assert test_rmse < baseline - 0.02


def test_checkpoint_and_saved_model_written(demo):
  output_dir, stdout = demo
  checkpoints = output_dir / "checkpoints"
  assert (checkpoints / "checkpoint").is_file()
  assert list(checkpoints.glob("ckpt-1.index"))
  assert (output_dir / "saved_model" / "saved_model.pb").is_file()
  difference = float(re.search(r"max \|difference\| ([\d.e+-]+) stars", stdout).group(1))
  assert difference < 1e-4  # the reloaded export predicts what the trained model predicts


def test_plot_written(demo):
  output_dir, _ = demo
  plot = output_dir / "training_curves.png"
  assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_titled_recommendations_printed(demo):
  _, stdout = demo
  blocks = re.findall(
    r"Top 5 movies for user \d+ \(reloaded SavedModel\):\n((?:  .*\n){5})", stdout
  )
  assert len(blocks) == 3, stdout
  for block in blocks:
    for line in block.splitlines():
      rating, title = re.match(r"\s+([\d.]+)  (.+)", line).groups()
      assert 1.0 <= float(rating) <= 5.0
      assert re.search(r"\(\d{4}\)$", title)  # a title with its year
