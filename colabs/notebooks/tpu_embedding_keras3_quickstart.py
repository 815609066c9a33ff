# %% [markdown]
# # TPUEmbedding quick start for Keras 3: ranking movies with `model.fit`
#
# The quick start's ranking model, written for Keras 3 (`tf.keras` on TensorFlow 2.16+, and
# keras-rs users) with `tpu_embedding.keras.DistributedEmbedding`, keras-rs's layer under
# this package's import (see docs/keras3.md): a functional model trained by
# `model.fit`, evaluated, saved as a `.keras` file and exported for serving. The tables are
# configured with keras-rs's `TableConfig`/`FeatureConfig`, as in the keras-rs tutorial, and
# trained with their own optimizer exactly as the TPU embedding engine trains them; the
# optimizer given to `model.compile` trains the dense layers only.

# %%
import os

# TPU_EMBEDDING_FAST=1 (set by the tests) trains briefly so the notebook runs in well under two
# minutes on a laptop CPU; leave it unset for the figures quoted in the text.
FAST = os.environ.get("TPU_EMBEDDING_FAST") == "1"
OUTPUT_DIR = os.environ.get("TPU_EMBEDDING_OUTPUT_DIR", "colab_output")
os.makedirs(OUTPUT_DIR, exist_ok=True)

# %% [markdown]
# ## Keras 3 with the TensorFlow backend
#
# The layer runs on TensorFlow: set the backend before Keras is imported. The strategy is the
# only hardware decision: on a TPU, create `tf.distribute.TPUStrategy(resolver)` instead and
# build the model under its scope; nothing else changes.

# %%
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import keras_rs
import numpy as np
import tensorflow as tf

import tpu_embedding.keras

strategy = tf.distribute.get_strategy()
print("Keras", keras.__version__, "on", keras.backend.backend(), "|", type(strategy).__name__)

# %% [markdown]
# ## Data
#
# The same MovieLens 100K split as the quick start (synthetic without network access; set
# `MOVIELENS_DIR` to an ml-100k directory for the real ratings), as `tf.data` datasets of
# `({"user_id", "movie_id"}, rating in [0, 1])`.

# %%
from examples.data import movielens

data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"), seed=42)
train, test = movielens.train_test_split(data, test_fraction=0.2, seed=42)
baseline_rmse = movielens.mean_rating_rmse(train, test)
BATCH_SIZE = 256
train_data = movielens.to_dataset(train, BATCH_SIZE, shuffle_seed=42, drop_remainder=True)
test_data = movielens.to_dataset(test, BATCH_SIZE)
print(
  f"{data.source}: {len(train)} training and {len(test)} test ratings; "
  f"RMSE of predicting the mean rating: {baseline_rmse:.4f}"
)

# %% [markdown]
# ## Tables and features, keras-rs style
#
# keras-rs's configs are accepted as they are: `embedding_dim` is the table width, the Keras
# `Adam` given to each table is translated to the TPU embedding `Adam`, and the global-batch
# `output_shape` to the per-replica shape the TPU needs.

# %%
EMBEDDING_DIM = 32


def table(name, rows):
  return keras_rs.layers.TableConfig(
    name=name,
    vocabulary_size=rows + 1,
    embedding_dim=EMBEDDING_DIM,
    optimizer=keras.optimizers.Adam(learning_rate=0.01),
  )


feature_configs = {
  name: keras_rs.layers.FeatureConfig(
    name=name, table=t, input_shape=(BATCH_SIZE,), output_shape=(BATCH_SIZE, EMBEDDING_DIM)
  )
  for name, t in [
    ("user_id", table("user_table", data.num_users)),
    ("movie_id", table("movie_table", data.num_movies)),
  ]
}

# %% [markdown]
# ## The model, compiled and fitted
#
# A functional model: the embedding layer takes the whole feature dict and returns a dict of
# embeddings, whose concatenation goes through a 256-64-1 MLP with a sigmoid output.
# `jit_compile=False`: the layer's XLA training path is not there yet (on CPU Keras' default
# leaves XLA off anyway).

# %%
with strategy.scope():
  inputs = {
    name: keras.Input(shape=(), dtype="int32", name=name) for name in ("user_id", "movie_id")
  }
  embeddings = tpu_embedding.keras.DistributedEmbedding(feature_configs)(inputs)
  joined = keras.ops.concatenate([embeddings["user_id"], embeddings["movie_id"]], axis=1)
  hidden = keras.layers.Dense(64, activation="relu")(
    keras.layers.Dense(256, activation="relu")(joined)
  )
  rating = keras.layers.Dense(1, activation="sigmoid")(hidden)
  model = keras.Model(inputs, keras.ops.squeeze(rating, axis=1))
  model.compile(
    optimizer=keras.optimizers.Adagrad(learning_rate=0.1),
    loss="mse",
    metrics=[keras.metrics.RootMeanSquaredError(name="rmse")],
    jit_compile=False,
  )

history = model.fit(train_data, epochs=1 if FAST else 5, validation_data=test_data)
test_rmse = model.evaluate(test_data, return_dict=True, verbose=0)["rmse"]
print(f"Test RMSE {test_rmse:.4f} vs {baseline_rmse:.4f} for the mean rating")
assert test_rmse < baseline_rmse

# %% [markdown]
# ## Save, reload, export
#
# `model.save` writes the tables and their optimizer slots into the `.keras` file, and
# `keras.models.load_model` gives a model that predicts the same. `export_for_serving` writes
# a SavedModel for CPU serving, the same function as for tf-keras models.

# %%
from tpu_embedding.keras import export_for_serving

keras_file = os.path.join(OUTPUT_DIR, "keras3_ranking.keras")
model.save(keras_file)
reloaded = keras.models.load_model(keras_file)
sample = {"user_id": np.array([1, 2, 3], np.int32), "movie_id": np.array([1, 1, 50], np.int32)}
np.testing.assert_allclose(
  reloaded.predict(sample, verbose=0), model.predict(sample, verbose=0), rtol=1e-5
)


@tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)])
def serve(user_id, movie_id):
  return {"rating": 1.0 + 4.0 * model({"user_id": user_id, "movie_id": movie_id})}


export_dir = export_for_serving(
  model, os.path.join(OUTPUT_DIR, "keras3_saved_model"), serve, overwrite=True
)
served = tf.saved_model.load(export_dir).signatures["serving_default"]
print(
  "Predicted ratings:",
  served(user_id=tf.constant(sample["user_id"]), movie_id=tf.constant(sample["movie_id"]))[
    "rating"
  ].numpy(),
)
