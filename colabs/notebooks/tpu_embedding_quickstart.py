# %% [markdown]
# # TPUEmbedding quick start: ranking movies
#
# This notebook trains the ranking model of the Keras SparseCore tutorial with
# `tpu_embedding.TPUEmbedding`: user and movie ids go through embedding tables, their
# embeddings through a small MLP that predicts the rating. The same code runs on a CPU, a GPU
# or a TPU; on CPU the tables are trained exactly as the TPU embedding engine trains them.
#
# It is the step-by-step version of `python -m examples.movielens_ranking`.

# %%
import os

# TPU_EMBEDDING_FAST=1 (set by the tests) trains briefly so the notebook runs in well under two
# minutes on a laptop CPU; leave it unset for the figures quoted in the text.
FAST = os.environ.get("TPU_EMBEDDING_FAST") == "1"
OUTPUT_DIR = os.environ.get("TPU_EMBEDDING_OUTPUT_DIR", "colab_output")
os.makedirs(OUTPUT_DIR, exist_ok=True)

# %% [markdown]
# ## The strategy: the one hardware decision
#
# `choose_strategy` connects to a TPU when one is attached and otherwise returns the default
# strategy. Models are created under `strategy.scope()` and steps run in `strategy.run`; on a
# TPU, the layer then places its tables in the TPU embedding engine (or SparseCore).

# %%
import tensorflow as tf
import tf_keras

from examples.movielens_ranking import choose_strategy

# TPUStrategy when a TPU is attached (Colab TPU runtime, Cloud TPU VM), else the default strategy.
# This is the only line that knows about the hardware: everything below runs unchanged on both.
strategy = choose_strategy()
print(type(strategy).__name__, "with", strategy.num_replicas_in_sync, "replica(s)")

# %% [markdown]
# ## Data
#
# MovieLens 100K from the package's data module. Without network access it uses a synthetic
# stand-in with ml-100k's shape and a planted low-rank structure; set `MOVIELENS_DIR` to an
# ml-100k directory (with `u.data` and `u.item`) to use the real ratings. Ratings are scaled
# to [0, 1], and 20% of them (shuffled with seed 42) are held out for evaluation.
# Predicting the mean training rating is the baseline to beat.

# %%
from examples.data import movielens

data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"), seed=42)
train, test = movielens.train_test_split(data, test_fraction=0.2, seed=42)
baseline_rmse = movielens.mean_rating_rmse(train, test)
print(
  f"{data.source}: {len(train)} training and {len(test)} test ratings, "
  f"{data.num_users} users, {data.num_movies} movies"
)
print(f"RMSE of predicting the mean rating: {baseline_rmse:.4f}")

# %% [markdown]
# ## Tables and features
#
# One `TableConfig` per id, one `FeatureConfig` per input. Ids are 1-based, so each table has
# one row more than the largest id. The tables' optimizer is a mid-level
# `tf.tpu.experimental.embedding.Adam`: it is what the TPU runs, and what the CPU engine
# reproduces (the TPU's Adam has no bias correction). The dense layers get a Keras optimizer
# as usual.

# %%
EMBEDDING_DIM = 32
embedding = tf.tpu.experimental.embedding

user_table = embedding.TableConfig(
  vocabulary_size=data.num_users + 1, dim=EMBEDDING_DIM, name="user_table"
)
movie_table = embedding.TableConfig(
  vocabulary_size=data.num_movies + 1, dim=EMBEDDING_DIM, name="movie_table"
)
feature_config = {
  "user_id": embedding.FeatureConfig(table=user_table, name="user_id"),
  "movie_id": embedding.FeatureConfig(table=movie_table, name="movie_id"),
}

# %% [markdown]
# ## The model
#
# `TPUEmbedding` takes the whole feature dict in one call (on a TPU there is exactly one call
# of the layer per step) and returns a dict of embeddings with the same keys. Their
# concatenation goes through a 256-64-1 MLP with a sigmoid output, since labels lie in [0, 1].

# %%
import tpu_embedding


class RankingModel(tf_keras.Model):
  def __init__(self, feature_config, embedding_optimizer=None):
    super().__init__()
    self.feature_config = feature_config
    self.embedding = tpu_embedding.TPUEmbedding(feature_config, embedding_optimizer)
    self.ratings = tf_keras.Sequential(
      [
        tf_keras.layers.Dense(256, activation="relu"),
        tf_keras.layers.Dense(64, activation="relu"),
        tf_keras.layers.Dense(1, activation="sigmoid"),
      ]
    )

  def call(self, features, serving=False):
    embeddings = self.embedding(features, serving_config=self.feature_config if serving else None)
    joined = tf.concat([embeddings["user_id"], embeddings["movie_id"]], axis=1)
    return tf.squeeze(self.ratings(joined), axis=1)


with strategy.scope():
  model = RankingModel(feature_config, embedding.Adam(learning_rate=0.01))
  optimizer = tf_keras.optimizers.Adagrad(learning_rate=0.1)

# %% [markdown]
# ## The training step
#
# A custom step under `strategy.run`. The loss is averaged over the *global* batch, as every
# replica computes a part of it. `tape.gradient` over the model's trainable variables is all
# it takes for the tables too: when the tape reaches the embedding activations, the layer
# applies the tables' gradients with the tables' own optimizer (on TPU, in the embedding
# engine). The Keras optimizer only ever sees the dense variables.

# %%
BATCH_SIZE = 256  # global batch: a multiple of the number of replicas


def step_fn(features, labels):
  with tf.GradientTape() as tape:
    predictions = model(features)
    squared_errors = tf.square(labels - predictions)
    loss = tf.nn.compute_average_loss(squared_errors, global_batch_size=BATCH_SIZE)
  gradients = tape.gradient(loss, model.trainable_variables)
  optimizer.apply_gradients(zip(gradients, model.trainable_variables))
  return loss


@tf.function
def train_step(iterator):
  per_replica_loss = strategy.run(step_fn, args=next(iterator))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)


# %% [markdown]
# ## Training and evaluation
#
# Training batches have a static shape (`drop_remainder=True`, required on TPU). The test set
# is evaluated in full: `eval_dataset` pads its last batch with weight-0 rows.

# %%
import numpy as np

from examples import movielens_ranking

EPOCHS = 2 if FAST else 5
train_data = strategy.experimental_distribute_dataset(
  movielens.to_dataset(train, BATCH_SIZE, shuffle_seed=42, drop_remainder=True)
)
test_data = strategy.experimental_distribute_dataset(
  movielens_ranking.eval_dataset(test, BATCH_SIZE)
)
eval_step = movielens_ranking.make_eval_step(strategy, model)
steps = len(train) // BATCH_SIZE

history = {"loss": [], "test_rmse": []}
for epoch in range(EPOCHS):
  print(f"Epoch {epoch + 1}/{EPOCHS}")
  progbar = tf_keras.utils.Progbar(steps, stateful_metrics=["loss", "test_rmse"])
  iterator = iter(train_data)
  total = 0.0
  for step in range(steps):
    total += float(train_step(iterator))
    values = [("loss", total / (step + 1))]
    if step + 1 == steps:
      values.append(("test_rmse", movielens_ranking.evaluate(eval_step, test_data)))
    progbar.update(step + 1, values)
  history["loss"].append(total / steps)
  history["test_rmse"].append(values[-1][1])

print(f"Test RMSE {history['test_rmse'][-1]:.4f} vs {baseline_rmse:.4f} for the mean rating")
assert history["loss"][-1] < history["loss"][0]
assert history["test_rmse"][-1] < baseline_rmse

# %% [markdown]
# ## Checkpoint, export, reload, recommend
#
# A `tf.train.Checkpoint` holds the tables under the same names on every hardware path.
# `export_saved_model` restores it into a copy of the model built *outside* any TPU strategy,
# so the export looks its tables up with plain CPU ops whatever trained it, and saves a
# `serve(user_id, movie_id)` signature returning ratings on the 1-5 scale.

# %%
checkpoint_path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
  os.path.join(OUTPUT_DIR, "quickstart", "ckpt")
)
export_dir = movielens_ranking.export_saved_model(
  checkpoint_path,
  os.path.join(OUTPUT_DIR, "quickstart_saved_model"),
  data.num_users,
  data.num_movies,
)

serve = tf.saved_model.load(export_dir).signatures["serving_default"]
all_movies = np.array(sorted(data.titles), np.int32)
top = movielens_ranking.recommend(serve, [1, 2, 3], all_movies, k=5)
for user_id, picks in top.items():
  print(f"Top 5 for user {user_id}:")
  for movie_id, rating in picks:
    print(f"  {rating:.2f}  {data.titles[movie_id]}")

# %% [markdown]
# ## On a TPU
#
# Nothing changes but what `choose_strategy()` returns: run the same cells on a TPU runtime.
# The layer picks the TPU embedding API for the chip it finds (embedding engine, SparseCore,
# or replicated tables on TPUs without either).
