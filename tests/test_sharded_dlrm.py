"""The launcher `python -m tpu_embedding.examples.sharded_dlrm`, run as a user runs it."""

import subprocess
import sys

import tensorflow as tf


def test_launcher_trains_checkpoints_and_exports_with_sharded_tables(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "tpu_embedding.examples.sharded_dlrm",
      "--ps",
      "2",
      "--workers",
      "2",
      "--tables",
      "1",
      "--vocabulary",
      "20000",
      "--batch",
      "32",
      "--steps",
      "3",
      "--timeout",
      "240",
      "--output_dir",
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "1 tables of 20000 x 16, each in 2 shards" in result.stdout
  assert "3 steps of 32 examples" in result.stdout
  exported = tf.saved_model.load(str(tmp_path / "export"))
  assert exported.embedding_tables["table_0"].shape == (20000, 16)
  predict = exported.signatures["serving_default"]
  out = predict(dense=tf.zeros([2, 13]), cat_0=tf.constant([1, 19999], tf.int64))
  probabilities = next(iter(out.values())).numpy()
  assert probabilities.shape == (2,) and ((probabilities > 0) & (probabilities < 1)).all()
