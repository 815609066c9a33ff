"""The keras-rs MovieLens ranking tutorial on CPU: `tpu_embedding.keras` next to keras-rs.

The model, data and recipe of the keras-rs tutorial "DistributedEmbedding using TPU SparseCore":
tables `user` and `movie` (ids + 1 rows, dimension 32) whose own optimizer is "adam", dense
256-relu, 64-relu, 1 on the concatenated embeddings, mean squared error on ratings mapped to
[0, 1], `model.compile(optimizer="adagrad")`, batches of 256 (remainder dropped), 80% of the
ratings for training, 20% for test, 5 epochs. The same keras-rs configs and the same
constructor call go to `keras_rs.layers.DistributedEmbedding` and to
`tpu_embedding.keras.DistributedEmbedding`: switching is the one import.

Off TPU, keras-rs builds plain Keras embeddings that the model's Adagrad trains (the tables'
"adam" is ignored); `tpu_embedding` trains each table with its own Adam, as the TPU does. Reported
per implementation: test RMSE after training, the RMSE of predicting the training mean (the bar
any model must clear), and the median time per training step over epochs 2..N (epoch 1 holds
tracing) of every round. Each round trains each implementation once, in its own fresh process,
alternating, so that load from other processes on the machine falls on both alike.

Data: `examples.data.movielens` (synthetic MovieLens 100K by default, no network; pass
--source local --data_dir ~/ml-100k for the real files).

Usage: python benchmarks/keras_rs_movielens.py [--epochs 5] [--rounds 3] [--source ...]
                                               [--data_dir ...] [--out benchmarks/results]
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
IMPLEMENTATIONS = ("tpu_embedding", "keras_rs")
BATCH_SIZE = 256
EMBEDDING_DIM = 32
SEED = 42


# ---------------------------------------------------------------------------------------------
# One implementation, in a fresh process


def _train(implementation: str, args: argparse.Namespace, result_file: str) -> None:
  import time

  import keras
  import keras_rs

  from examples.data import movielens
  from tpu_embedding.keras import DistributedEmbedding

  keras.utils.set_random_seed(SEED)
  data = movielens.load_movielens(args.source, args.data_dir, seed=SEED)
  train, test = movielens.train_test_split(data, 0.2, seed=SEED)
  train_batches = movielens.to_dataset(
    train, BATCH_SIZE, shuffle_seed=SEED, drop_remainder=True
  ).cache()
  test_batches = movielens.to_dataset(test, BATCH_SIZE, drop_remainder=True).cache()

  def table(name: str, rows: int) -> keras_rs.layers.TableConfig:
    return keras_rs.layers.TableConfig(
      name=name, vocabulary_size=rows + 1, embedding_dim=EMBEDDING_DIM, optimizer="adam"
    )

  user_table, movie_table = (
    table("user_table", data.num_users),
    table("movie_table", data.num_movies),
  )
  feature_configs = {
    name: keras_rs.layers.FeatureConfig(
      name=name, table=t, input_shape=(BATCH_SIZE,), output_shape=(BATCH_SIZE, EMBEDDING_DIM)
    )
    for name, t in [("movie_id", movie_table), ("user_id", user_table)]
  }
  layer_class = (
    DistributedEmbedding
    if implementation == "tpu_embedding"
    else keras_rs.layers.DistributedEmbedding
  )
  embedding = layer_class(feature_configs)

  class EmbeddingModel(keras.Model):
    def __init__(self):
      super().__init__()
      self.embedding_layer = embedding
      self.ratings = keras.Sequential(
        [
          keras.layers.Dense(256, activation="relu"),
          keras.layers.Dense(64, activation="relu"),
          keras.layers.Dense(1),
        ]
      )

    def call(self, features):
      activations = self.embedding_layer(features)
      return self.ratings(
        keras.ops.concatenate([activations["user_id"], activations["movie_id"]], axis=1)
      )

  class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
      super().__init__()
      self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
      self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      self.seconds.append(time.perf_counter() - self._start)

  model = EmbeddingModel()
  model.compile(
    loss=keras.losses.MeanSquaredError(),
    metrics=[keras.metrics.RootMeanSquaredError()],
    optimizer="adagrad",
    jit_compile=False,
  )
  timer = EpochTimer()
  history = model.fit(train_batches, epochs=args.epochs, callbacks=[timer], verbose=0)
  steps = len(train) // BATCH_SIZE
  test_rmse = model.evaluate(test_batches, return_dict=True, verbose=0)["root_mean_squared_error"]
  with open(result_file, "w") as f:
    json.dump(
      {
        "implementation": implementation,
        "source": data.source,
        "train_rmse_by_epoch": history.history["root_mean_squared_error"],
        "test_rmse": test_rmse,
        "mean_predictor_rmse": movielens.mean_rating_rmse(train, test),
        "steps_per_epoch": steps,
        "step_ms_by_epoch": [1000 * s / steps for s in timer.seconds],
      },
      f,
    )


def _run_fresh(implementation: str, argv: list[str], result_file: str) -> dict:
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    KERAS_BACKEND="tensorflow",
    TF_CPP_MIN_LOG_LEVEL="3",
  )
  subprocess.run(
    [
      sys.executable,
      os.path.abspath(__file__),
      "--worker",
      implementation,
      "--result_file",
      result_file,
      *argv,
    ],
    env=env,
    check=True,
  )
  with open(result_file) as f:
    return json.load(f)


# ---------------------------------------------------------------------------------------------
# Report


def _median(values: list[float]) -> float:
  ordered = sorted(values)
  middle = len(ordered) // 2
  return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def summarize(runs: list[dict]) -> dict:
  """One implementation over its rounds: median test RMSE, median step time of epochs 2..N."""
  first = runs[0]
  return {
    **first,
    "rounds": len(runs),
    "test_rmse": _median([r["test_rmse"] for r in runs]),
    "step_ms_median": _median(
      [ms for r in runs for ms in r["step_ms_by_epoch"][1:]] or first["step_ms_by_epoch"]
    ),
  }


def markdown(results: list[dict]) -> str:
  by_name = {
    name: summarize([r for r in results if r["implementation"] == name]) for name in IMPLEMENTATIONS
  }
  ours, theirs = by_name["tpu_embedding"], by_name["keras_rs"]
  lines = [
    "| layer (CPU, Keras 3) | tables trained by | test RMSE | mean-predictor RMSE | "
    "ms/step (median) |",
    "|---|---|---|---|---|",
    f"| `tpu_embedding.keras.DistributedEmbedding` | each table's own Adam (as on TPU) | "
    f"{ours['test_rmse']:.4f} | {ours['mean_predictor_rmse']:.4f} | "
    f"{ours['step_ms_median']:.2f} |",
    f"| `keras_rs.layers.DistributedEmbedding` | the model's Adagrad (tables' Adam ignored) | "
    f"{theirs['test_rmse']:.4f} | {theirs['mean_predictor_rmse']:.4f} | "
    f"{theirs['step_ms_median']:.2f} |",
  ]
  speedup = theirs["step_ms_median"] / ours["step_ms_median"]
  lines.append("")
  lines.append(
    f"MovieLens 100K ({ours['source']}), batch {BATCH_SIZE}, "
    f"{ours['steps_per_epoch']} steps/epoch, {len(ours['train_rmse_by_epoch'])} "
    f"epochs, {ours['rounds']} round(s); medians over rounds; tpu_embedding is "
    f"{speedup:.2f}x keras-rs's speed per step."
  )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--source", default=None, help="MovieLens source (default: synthetic)")
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--out", default=os.path.join(HERE, "results"))
  parser.add_argument("--worker", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
  parser.add_argument("--result_file", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    _train(args.worker, args, args.result_file)
    return
  argv = ["--epochs", str(args.epochs)]
  argv += ["--source", args.source] if args.source else []
  argv += ["--data_dir", args.data_dir] if args.data_dir else []
  with tempfile.TemporaryDirectory() as scratch:
    results = [
      _run_fresh(name, argv, os.path.join(scratch, f"{name}-{round_}.json"))
      for round_ in range(args.rounds)
      for name in IMPLEMENTATIONS
    ]
  table = markdown(results)
  print(table)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "keras_rs_movielens.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(args.out, "keras_rs_movielens.json"), "w") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
