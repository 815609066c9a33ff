"""The MovieLens quick start served at each table dtype: test RMSE, table bytes, output error.

Trains the quick start (`examples.movielens_ranking`, synthetic MovieLens by
default, 5 epochs), exports it with `export_for_serving` at table_dtype float32, float16,
bfloat16, int8 and int4, serves every export in one fresh process that imports only TensorFlow,
and prints each export's test RMSE (on the quick start's [0, 1] scale) against float32's, with
the issue's targets, the bytes of its tables, and `serving_error_by_dtype` on 4,096 test pairs.

Usage, from the repository's root: python -m benchmarks.movielens_table_dtypes [--epochs 5]
[--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
# The issue's targets: |test RMSE - float32's| on the [0, 1] scale.
TARGETS = {"float16": 0.0005, "bfloat16": None, "int8": 0.001, "int4": 0.005}

# Run in a fresh process: loads each export with TensorFlow alone and writes its predictions.
SERVE = """
import json, sys
import numpy as np
import tensorflow as tf

exports, test, out = json.loads(sys.argv[1])
ids = np.load(test)
served = {}
for dtype, directory in exports.items():
  serve = tf.saved_model.load(directory).signatures["serving_default"]
  rating = serve(user_id=tf.constant(ids["user_id"]), movie_id=tf.constant(ids["movie_id"]))
  served[dtype] = rating["rating"].numpy().ravel()
assert not [m for m in sys.modules if m.startswith(("tpu_embedding", "tf_keras"))]
np.savez(out, **served)
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  args = parser.parse_args()

  import numpy as np
  import tensorflow as tf

  import tpu_embedding
  from benchmarks.serving_latency import table_bytes
  from examples import movielens_ranking as quick_start
  from examples.data import movielens

  with tempfile.TemporaryDirectory() as work:
    trained = quick_start.main(["--output_dir", work, "--epochs", str(args.epochs)])
    data = movielens.load_movielens(seed=quick_start.SPLIT_SEED)
    _, test = movielens.train_test_split(data, test_fraction=0.2, seed=quick_start.SPLIT_SEED)
    test_ids = os.path.join(work, "test.npz")
    np.savez(test_ids, user_id=test.user_ids, movie_id=test.movie_ids)
    exports = {
      dtype: quick_start.export_saved_model(
        trained["checkpoint"],
        os.path.join(work, dtype),
        data.num_users,
        data.num_movies,
        None if dtype == "float32" else dtype,
      )
      for dtype in DTYPES
    }
    rows = (data.num_users + 1, data.num_movies + 1)
    sizes = {dtype: table_bytes(directory, rows) for dtype, directory in exports.items()}
    out = os.path.join(work, "served.npz")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    argument = json.dumps([exports, test_ids, out])
    subprocess.run([sys.executable, "-c", SERVE, argument], env=env, check=True)
    served = dict(np.load(out))

    model = quick_start.RankingModel(
      quick_start.make_feature_config(data.num_users, data.num_movies), embedding_optimizer=None
    )
    model({"user_id": tf.ones([1], tf.int32), "movie_id": tf.ones([1], tf.int32)})
    tf.train.Checkpoint(model=model).restore(trained["checkpoint"]).expect_partial()
    module = quick_start.ServingModule(model)
    sample = {"user_id": test.user_ids[:4096], "movie_id": test.movie_ids[:4096]}
    errors = tpu_embedding.serving_error_by_dtype(module, module.serve, sample)

  labels = movielens.rating_labels(test)
  rmse = {d: float(np.sqrt(np.mean(((served[d] - 1) / 4 - labels) ** 2))) for d in DTYPES}
  lines = [
    f"MovieLens quick start ({data.source} data, {args.epochs} epochs), {len(test)} test "
    "ratings, each export served by a fresh TF-only process.",
    "",
    "| table_dtype | test RMSE | - float32's | target | tables MB | x float32 |",
    "|---|---:|---:|---|---:|---:|",
  ]
  for dtype in DTYPES:
    delta = rmse[dtype] - rmse["float32"]
    target = TARGETS.get(dtype)
    verdict = (
      "" if target is None else f"<= {target}: {'met' if abs(delta) <= target else 'NOT met'}"
    )
    lines.append(
      f"| {dtype} | {rmse[dtype]:.5f} | {delta:+.6f} | {verdict} | "
      f"{sizes[dtype] / 1e6:.3f} | {sizes[dtype] / sizes['float32']:.3f} |"
    )
  lines += [
    "",
    "`serving_error_by_dtype` on 4,096 test pairs (ratings 1..5; one table lowered at a time):",
    "",
    "| table | dtype | max abs diff | mean abs diff |",
    "|---|---|---:|---:|",
  ]
  for table, by_dtype in errors.items():
    for dtype, error in by_dtype.items():
      lines.append(f"| {table} | {dtype} | {error.max_abs:.2e} | {error.mean_abs:.2e} |")
  text = "\n".join(lines)
  print(text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "movielens_table_dtypes.md"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
