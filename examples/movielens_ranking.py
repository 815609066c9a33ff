"""MovieLens ranking quick start: train, evaluate, checkpoint, export, reload and recommend.

    python -m examples.movielens_ranking --output_dir demo_output
    python -m examples.movielens_ranking --source local --data_dir ~/ml-100k

The model of the Keras SparseCore ranking tutorial: user and movie ids looked up in one
`TPUEmbedding` layer (two tables of dimension 32, trained by Adam exactly as the TPU embedding
engine trains them), their concatenation fed to a 256-64-1 MLP trained by Keras Adagrad, MSE on
ratings scaled to [0, 1]. The training loop is a custom loop under `strategy.run`; on a TPU the
only thing that changes is the strategy `choose_strategy` returns.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from examples import quiet

# Run as a script, TensorFlow's start-up messages are dropped unless --verbose is given.
with quiet.tensorflow_start_up(verbose=__name__ != "__main__" or "--verbose" in sys.argv[1:]):
  import numpy as np
  import tensorflow as tf
  import tf_keras

  import tpu_embedding
  from examples.data import movielens
  from tpu_embedding import serving

EMBEDDING_DIM = 32
# Tuned on the synthetic data for the 5 default epochs (batch 256): embedding rates 0.001..0.03
# and dense rates 0.05..0.3 all land within 0.003 of the chosen pair's test RMSE. The TPU's Adam
# has no bias correction, so its first steps are smaller than Keras Adam's at the same rate.
EMBEDDING_LEARNING_RATE = 0.01
DENSE_LEARNING_RATE = 0.1
SPLIT_SEED = 42


# ---------------------------------------------------------------------------------------------
# Strategy: the one hardware decision of the script.


def tpu_present() -> bool:
  """A cheap local test, so that a laptop never waits on a TPU resolver."""
  return bool(
    os.environ.get("TPU_NAME") or glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
  )


def choose_strategy() -> tf.distribute.Strategy:
  """TPUStrategy when a TPU is attached, else the default strategy (CPU or one GPU)."""
  if tpu_present():
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
      tpu=os.environ.get("TPU_NAME", "local")
    )
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)
  return tf.distribute.get_strategy()


# ---------------------------------------------------------------------------------------------
# Model


def make_feature_config(
  num_users: int, num_movies: int, dim: int = EMBEDDING_DIM
) -> dict[str, tf.tpu.experimental.embedding.FeatureConfig]:
  """One table per id; ids are 1-based, so each table has one more row than the largest id."""
  embedding = tf.tpu.experimental.embedding
  user_table = embedding.TableConfig(vocabulary_size=num_users + 1, dim=dim, name="user_table")
  movie_table = embedding.TableConfig(vocabulary_size=num_movies + 1, dim=dim, name="movie_table")
  return {
    "user_id": embedding.FeatureConfig(table=user_table, name="user_id"),
    "movie_id": embedding.FeatureConfig(table=movie_table, name="movie_id"),
  }


class RankingModel(tf_keras.Model):
  """Embeddings of the user and the movie, concatenated, through a 256-64-1 MLP.

  The last layer is a sigmoid, as labels lie in [0, 1] (on the synthetic data it reached a
  test RMSE of 0.223 in 5 epochs where a linear output reached 0.235, overfitting sooner).
  """

  def __init__(
    self,
    feature_config: Any,
    embedding_optimizer: Any = None,
    output_activation: Optional[str] = "sigmoid",
    **kwargs,
  ):
    super().__init__(**kwargs)
    self.feature_config = feature_config
    self.embedding = tpu_embedding.TPUEmbedding(feature_config, embedding_optimizer)
    self.ratings = tf_keras.Sequential(
      [
        tf_keras.layers.Dense(256, activation="relu"),
        tf_keras.layers.Dense(64, activation="relu"),
        tf_keras.layers.Dense(1, activation=output_activation),
      ]
    )

  def call(self, features: dict[str, tf.Tensor], serving: bool = False) -> tf.Tensor:
    # Serving reads the tables with a plain CPU lookup; training goes through the engine.
    serving_config = self.feature_config if serving else None
    embeddings = self.embedding(features, serving_config=serving_config)
    joined = tf.concat([embeddings["user_id"], embeddings["movie_id"]], axis=1)
    return tf.squeeze(self.ratings(joined), axis=1)


def embedding_optimizer(learning_rate: float = EMBEDDING_LEARNING_RATE):
  """The tables' optimizer, as the TPU embedding engine runs it (there and on CPU)."""
  return tf.tpu.experimental.embedding.Adam(learning_rate=learning_rate)


def dense_optimizer(learning_rate: float = DENSE_LEARNING_RATE) -> tf_keras.optimizers.Optimizer:
  return tf_keras.optimizers.Adagrad(learning_rate=learning_rate)


# ---------------------------------------------------------------------------------------------
# Steps: the same code on CPU, GPU and TPU.


def make_train_step(
  strategy: tf.distribute.Strategy,
  model: tf_keras.Model,
  optimizer: tf_keras.optimizers.Optimizer,
  global_batch_size: int,
) -> Callable[[Any], dict[str, tf.Tensor]]:
  """A compiled step taking an iterator over the distributed dataset.

  Returns the batch's mean loss and sum of squared errors (for the running RMSE).
  """

  def step_fn(features, labels):
    with tf.GradientTape() as tape:
      predictions = model(features)
      squared_errors = tf.square(labels - predictions)
      loss = tf.nn.compute_average_loss(squared_errors, global_batch_size=global_batch_size)
    # The tables' gradients never reach `optimizer`: the embedding layer applies them with
    # the tables' own optimizer when the tape reaches its activations.
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return {"loss": loss, "squared_error": tf.reduce_sum(squared_errors)}

  @tf.function
  def train_step(iterator):
    per_replica = strategy.run(step_fn, args=next(iterator))
    return {
      name: strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
      for name, value in per_replica.items()
    }

  return train_step


def make_eval_step(
  strategy: tf.distribute.Strategy, model: tf_keras.Model
) -> Callable[[Any], dict[str, tf.Tensor]]:
  """Sums of squared errors and of example weights (padding rows weigh 0)."""

  def step_fn(features, labels, weights):
    predictions = model(features)
    return {
      "squared_error": tf.reduce_sum(weights * tf.square(labels - predictions)),
      "count": tf.reduce_sum(weights),
    }

  @tf.function
  def eval_step(batch):
    per_replica = strategy.run(step_fn, args=batch)
    return {
      name: strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
      for name, value in per_replica.items()
    }

  return eval_step


def eval_dataset(data: movielens.MovieLens, batch_size: int) -> tf.data.Dataset:
  """Every test rating once, in full batches (a TPU needs static shapes): the last batch is
  padded with weight-0 rows of id 0 (row 0 of both tables is unused)."""

  def pad(features, labels):
    missing = batch_size - tf.shape(labels)[0]
    padded = {
      name: tf.ensure_shape(tf.pad(ids, [[0, missing]]), [batch_size])
      for name, ids in features.items()
    }
    weights = tf.ensure_shape(tf.pad(tf.ones_like(labels), [[0, missing]]), [batch_size])
    labels = tf.ensure_shape(tf.pad(labels, [[0, missing]]), [batch_size])
    return padded, labels, weights

  return movielens.to_dataset(data, batch_size).map(pad)


# ---------------------------------------------------------------------------------------------
# Loops


def train_and_evaluate(
  strategy: tf.distribute.Strategy,
  model: tf_keras.Model,
  optimizer: tf_keras.optimizers.Optimizer,
  train: movielens.MovieLens,
  test: movielens.MovieLens,
  epochs: int,
  batch_size: int,
  seed: int = SPLIT_SEED,
  verbose: int = 1,
) -> dict[str, list[float]]:
  """Trains for `epochs`, evaluating on `test` after each; returns the per-epoch history."""
  train_data = strategy.experimental_distribute_dataset(
    movielens.to_dataset(train, batch_size, shuffle_seed=seed, drop_remainder=True)
  )
  test_data = strategy.experimental_distribute_dataset(eval_dataset(test, batch_size))
  steps = len(train) // batch_size
  train_step = make_train_step(strategy, model, optimizer, batch_size)
  eval_step = make_eval_step(strategy, model)

  history = {"loss": [], "rmse": [], "test_rmse": [], "step_loss": []}
  for epoch in range(epochs):
    if verbose:
      print(f"Epoch {epoch + 1}/{epochs}")
    progbar = tf_keras.utils.Progbar(
      steps, stateful_metrics=["loss", "rmse", "test_rmse"], verbose=verbose
    )
    iterator = iter(train_data)
    loss_sum = squared_error = 0.0
    for step in range(steps):
      result = train_step(iterator)
      loss = float(result["loss"])
      loss_sum += loss
      squared_error += float(result["squared_error"])
      history["step_loss"].append(loss)
      values = [
        ("loss", loss_sum / (step + 1)),
        ("rmse", np.sqrt(squared_error / ((step + 1) * batch_size))),
      ]
      if step + 1 == steps:
        test_rmse = evaluate(eval_step, test_data)
        values.append(("test_rmse", test_rmse))
      progbar.update(step + 1, values)
    history["loss"].append(loss_sum / steps)
    history["rmse"].append(float(np.sqrt(squared_error / (steps * batch_size))))
    history["test_rmse"].append(test_rmse)
  return history


def evaluate(eval_step: Callable, test_data: Any) -> float:
  """RMSE over the whole distributed test set, on the [0, 1] label scale."""
  squared_error = count = 0.0
  for batch in test_data:
    result = eval_step(batch)
    squared_error += float(result["squared_error"])
    count += float(result["count"])
  return float(np.sqrt(squared_error / count))


# ---------------------------------------------------------------------------------------------
# Export and serving


class ServingModule(tf.Module):
  """The model behind a `serve(user_id, movie_id)` signature returning ratings on 1..5."""

  def __init__(self, model: RankingModel):
    super().__init__()
    self.model = model

  @tf.function(
    input_signature=[
      tf.TensorSpec([None], tf.int32, name="user_id"),
      tf.TensorSpec([None], tf.int32, name="movie_id"),
    ]
  )
  def serve(self, user_id, movie_id):
    scaled = self.model({"user_id": user_id, "movie_id": movie_id}, serving=True)
    return {"rating": 1.0 + 4.0 * tf.clip_by_value(scaled, 0.0, 1.0)}


def export_saved_model(
  checkpoint_path: str,
  export_dir: str,
  num_users: int,
  num_movies: int,
  table_dtype: Optional[str] = None,
) -> str:
  """Restores the checkpoint into a serving copy of the model and saves it as a SavedModel.

  The copy is built outside any TPU strategy, so its tables are ordinary CPU variables
  whatever hardware trained them: the checkpoint's table names are the same on every path.
  `table_dtype` is `export_for_serving`'s (None: float32 tables).
  """
  with tf.distribute.get_strategy().scope():  # the default strategy, even under a TPU scope
    model = RankingModel(make_feature_config(num_users, num_movies), embedding_optimizer=None)
    model({"user_id": tf.ones([1], tf.int32), "movie_id": tf.ones([1], tf.int32)})
    tf.train.Checkpoint(model=model).restore(checkpoint_path).expect_partial()
    module = ServingModule(model)
    signatures = {"serving_default": module.serve}
    serving.export_for_serving(
      module, export_dir, signatures=signatures, overwrite=True, table_dtype=table_dtype
    )
  return export_dir


def recommend(
  serve: Callable, user_ids: Sequence[int], movie_ids: np.ndarray, k: int = 5
) -> dict[int, list[tuple[int, float]]]:
  """Top-k (movie id, predicted 1..5 rating) among `movie_ids` for each user."""
  movie_ids = np.asarray(movie_ids, np.int32)
  top = {}
  for user_id in user_ids:
    users = np.full_like(movie_ids, user_id)
    ratings = serve(user_id=tf.constant(users), movie_id=tf.constant(movie_ids))["rating"]
    ratings = ratings.numpy()
    best = np.argsort(-ratings, kind="stable")[:k]
    top[int(user_id)] = [(int(movie_ids[i]), float(ratings[i])) for i in best]
  return top


# ---------------------------------------------------------------------------------------------
# Plot


def save_curves(history: dict[str, list[float]], baseline: float, path: str) -> str:
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, (loss_ax, rmse_ax) = plt.subplots(1, 2, figsize=(11, 4))
  steps = np.arange(1, len(history["step_loss"]) + 1)
  loss_ax.plot(steps, history["step_loss"], alpha=0.3, label="per step")
  window = max(1, len(steps) // 50)
  smooth = np.convolve(history["step_loss"], np.ones(window) / window, mode="valid")
  loss_ax.plot(steps[window - 1 :], smooth, label=f"moving mean ({window} steps)")
  loss_ax.set(xlabel="step", ylabel="MSE loss ([0, 1] scale)", title="Training loss")
  loss_ax.legend()
  epochs = np.arange(1, len(history["rmse"]) + 1)
  rmse_ax.plot(epochs, history["rmse"], "o-", label="train")
  rmse_ax.plot(epochs, history["test_rmse"], "o-", label="test")
  rmse_ax.axhline(baseline, color="gray", linestyle="--", label="predict the mean (test)")
  rmse_ax.set(xlabel="epoch", ylabel="RMSE ([0, 1] scale)", title="RMSE")
  rmse_ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--source",
    choices=movielens.SOURCES,
    default=None,
    help="default: 'local' with --data_dir, else 'synthetic'",
  )
  parser.add_argument(
    "--data_dir", default=None, help="ml-100k directory (local) or TFDS data directory (tfds)"
  )
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument(
    "--batch_size",
    type=int,
    default=256,
    help="global batch size (a multiple of the number of replicas)",
  )
  parser.add_argument("--output_dir", default="demo_output")
  parser.add_argument(
    "--seed",
    type=int,
    default=SPLIT_SEED,
    help="seed of the synthetic data, the split and the shuffling",
  )
  parser.add_argument("--embedding_learning_rate", type=float, default=EMBEDDING_LEARNING_RATE)
  parser.add_argument("--dense_learning_rate", type=float, default=DENSE_LEARNING_RATE)
  parser.add_argument(
    "--verbose", action="store_true", help="show TensorFlow's start-up and log messages"
  )
  return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  args = parse_args(argv)
  start = time.time()
  os.makedirs(args.output_dir, exist_ok=True)
  tf_keras.utils.set_random_seed(args.seed)

  strategy = choose_strategy()
  print(f"Strategy: {type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)")

  data = movielens.load_movielens(args.source, args.data_dir, seed=args.seed)
  train, test = movielens.train_test_split(data, test_fraction=0.2, seed=args.seed)
  baseline = movielens.mean_rating_rmse(train, test)
  print(
    f"MovieLens ({data.source}): {len(data)} ratings, {data.num_users} users, "
    f"{data.num_movies} movies; {len(train)} to train, {len(test)} to test"
  )

  with strategy.scope():
    model = RankingModel(
      make_feature_config(data.num_users, data.num_movies),
      embedding_optimizer(args.embedding_learning_rate),
    )
    optimizer = dense_optimizer(args.dense_learning_rate)
  history = train_and_evaluate(
    strategy, model, optimizer, train, test, args.epochs, args.batch_size, seed=args.seed
  )
  for epoch, (loss, rmse, test_rmse) in enumerate(
    zip(history["loss"], history["rmse"], history["test_rmse"]), start=1
  ):
    print(f"epoch {epoch}: train loss {loss:.4f}, train RMSE {rmse:.4f}, test RMSE {test_rmse:.4f}")
  test_rmse = history["test_rmse"][-1]
  print(
    f"Test RMSE {test_rmse:.4f} vs {baseline:.4f} predicting the mean rating "
    f"([0, 1] scale; {4 * test_rmse:.3f} vs {4 * baseline:.3f} stars)"
  )

  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
  checkpoint_path = checkpoint.save(os.path.join(args.output_dir, "checkpoints", "ckpt"))
  print(f"Checkpoint: {checkpoint_path}")
  export_dir = export_saved_model(
    checkpoint_path,
    os.path.join(args.output_dir, "saved_model"),
    data.num_users,
    data.num_movies,
  )
  print(f"SavedModel: {export_dir}")

  reloaded = tf.saved_model.load(export_dir)
  serve = reloaded.signatures["serving_default"]
  check = {"user_id": test.user_ids[:512], "movie_id": test.movie_ids[:512]}
  served = serve(**{name: tf.constant(ids) for name, ids in check.items()})["rating"]
  trained = 1.0 + 4.0 * model({name: tf.constant(ids) for name, ids in check.items()})
  difference = float(tf.reduce_max(tf.abs(served - trained)))
  print(
    f"Reloaded SavedModel vs trained model on 512 test pairs: max |difference| "
    f"{difference:.2e} stars"
  )
  all_movies = np.array(sorted(data.titles), np.int32)
  users = np.random.default_rng(args.seed).choice(np.unique(test.user_ids), size=3, replace=False)
  top = recommend(serve, users, all_movies, k=5)
  for user_id, picks in top.items():
    print(f"Top 5 movies for user {user_id} (reloaded SavedModel):")
    for movie_id, rating in picks:
      print(f"  {rating:.2f}  {data.titles[movie_id]}")

  plot = save_curves(history, baseline, os.path.join(args.output_dir, "training_curves.png"))
  print(f"Plot: {plot}")
  elapsed = time.time() - start
  print(f"Done in {elapsed:.0f} s")
  return {
    "history": history,
    "baseline_rmse": baseline,
    "test_rmse": test_rmse,
    "checkpoint": checkpoint_path,
    "saved_model": export_dir,
    "recommendations": top,
    "plot": plot,
    "seconds": elapsed,
  }


if __name__ == "__main__":
  main(sys.argv[1:])
