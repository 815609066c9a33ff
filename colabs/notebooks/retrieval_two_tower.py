# %% [markdown]
# # Two-tower retrieval with TPUEmbedding
#
# A retrieval model scores every movie for a user with a dot product between a *user tower*
# and a *movie tower*, so the best candidates come out of one matrix product (brute force
# here; an approximate index at scale). Both towers look their ids up in **one**
# `TPUEmbedding` layer called once per step: on a TPU, one call per step is all the embedding
# engine allows, so the towers share the layer rather than owning one each.
#
# We evaluate on held-out ratings: for every test user, does the top 10 (excluding movies the
# user rated in training) contain the movies the user rated 4 or 5 stars? That is recall@10,
# compared with recommending the most popular movies.

# %%
import os

# TPU_EMBEDDING_FAST=1 (set by the tests) trains briefly so the notebook runs in well under two
# minutes on a laptop CPU; leave it unset for the figures quoted in the text.
FAST = os.environ.get("TPU_EMBEDDING_FAST") == "1"
OUTPUT_DIR = os.environ.get("TPU_EMBEDDING_OUTPUT_DIR", "colab_output")
os.makedirs(OUTPUT_DIR, exist_ok=True)

# %%
import tensorflow as tf
import tf_keras

from examples.movielens_ranking import choose_strategy

# TPUStrategy when a TPU is attached (Colab TPU runtime, Cloud TPU VM), else the default strategy.
# This is the only line that knows about the hardware: everything below runs unchanged on both.
strategy = choose_strategy()
print(type(strategy).__name__, "with", strategy.num_replicas_in_sync, "replica(s)")

# %%
import numpy as np

from examples.data import movielens

data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"), seed=42)
train, test = movielens.train_test_split(data, test_fraction=0.2, seed=42)
print(f"{data.source}: {len(train)} training and {len(test)} test ratings")

# How often each movie is rated in training: the popularity the baseline recommends, and
# the prior the model's retrieval score uses (see below). +1 smooths unseen movies.
counts = np.bincount(train.movie_ids, minlength=data.num_movies + 1).astype(np.float32)
log_popularity = np.log((counts + 1.0) / (counts + 1.0).sum()).astype(np.float32)

# %% [markdown]
# ## Objective
#
# What is rated and how it is rated are two different questions. In MovieLens, *which* movies
# a user rates is dominated by popularity, and in the synthetic stand-in it is popularity
# alone. An in-batch softmax over rated pairs learns how much more likely a movie is for this
# user than for anyone (the popularity of the sampled negatives cancels out), which is close
# to nothing here; we measured it below the popularity baseline.
#
# So the towers learn the second question, as in the Keras data-parallel retrieval tutorial
# (which regresses the rating on the dot product): the dot product is the logit of "the user
# rates this movie 4 or more", trained with binary cross-entropy on every training rating.
# Retrieval then ranks by `log P(liked | user, movie) + log popularity(movie)`, which is
# `log P(rated and liked)`.

# %%
import tpu_embedding

EMBEDDING_DIM = 32
BATCH_SIZE = 1024
embedding = tf.tpu.experimental.embedding

user_table = embedding.TableConfig(data.num_users + 1, EMBEDDING_DIM, name="user_table")
movie_table = embedding.TableConfig(data.num_movies + 1, EMBEDDING_DIM, name="movie_table")
feature_config = {
  "user_id": embedding.FeatureConfig(table=user_table, name="user_id"),
  "movie_id": embedding.FeatureConfig(table=movie_table, name="movie_id"),
}


class TwoTowerModel(tf_keras.Model):
  def __init__(self, feature_config, embedding_optimizer):
    super().__init__()
    # One layer, one call per step, for both towers.
    self.embedding = tpu_embedding.TPUEmbedding(feature_config, embedding_optimizer)
    self.user_tower = tf_keras.layers.Dense(EMBEDDING_DIM, name="user_tower")
    self.movie_tower = tf_keras.layers.Dense(EMBEDDING_DIM, name="movie_tower")

  def call(self, features):
    embeddings = self.embedding(features)
    return (self.user_tower(embeddings["user_id"]), self.movie_tower(embeddings["movie_id"]))


with strategy.scope():
  model = TwoTowerModel(feature_config, embedding.Adam(learning_rate=0.01))
  optimizer = tf_keras.optimizers.Adagrad(learning_rate=0.1)


def step_fn(features, liked):
  with tf.GradientTape() as tape:
    users, movies = model(features)
    logits = tf.reduce_sum(users * movies, axis=1)
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=liked, logits=logits)
    loss = tf.nn.compute_average_loss(losses, global_batch_size=BATCH_SIZE)
  gradients = tape.gradient(loss, model.trainable_variables)
  optimizer.apply_gradients(zip(gradients, model.trainable_variables))
  return loss


@tf.function
def train_step(iterator):
  loss = strategy.run(step_fn, args=next(iterator))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)


# %%
EPOCHS = 2 if FAST else 4
liked = lambda features, rating: (features, tf.cast(rating >= 0.75, tf.float32))  # 4+ stars
train_data = strategy.experimental_distribute_dataset(
  movielens.to_dataset(train, BATCH_SIZE, shuffle_seed=42, drop_remainder=True).map(liked)
)
steps = len(train) // BATCH_SIZE
losses = []
for epoch in range(EPOCHS):
  progbar = tf_keras.utils.Progbar(steps, stateful_metrics=["loss"])
  iterator = iter(train_data)
  for step in range(steps):
    losses.append(float(train_step(iterator)))
    progbar.update(step + 1, [("loss", float(np.mean(losses[-steps:])))])
assert np.mean(losses[-steps:]) < np.mean(losses[:steps])

# %% [markdown]
# ## Brute-force retrieval and recall@10
#
# The tower outputs for every user and every movie are computed once; a user's scores over all
# movies are one matrix-vector product, and `tf.math.top_k` picks the best. Movies the user
# rated in training are masked out.

# %%
tables = {table.name: variable for table, variable in model.embedding.embedding_tables.items()}
user_vectors = model.user_tower(tables["user_table"])
movie_vectors = model.movie_tower(tables["movie_table"])
scores = (
  tf.math.log_sigmoid(tf.matmul(user_vectors, movie_vectors, transpose_b=True))
  + log_popularity[None, :]
).numpy()

seen = np.zeros([data.num_users + 1, data.num_movies + 1], bool)
seen[train.user_ids, train.movie_ids] = True
seen[:, 0] = True  # row 0 is no movie


def top_k(user_ids, user_scores, k=10):
  masked = np.where(seen[user_ids], -np.inf, user_scores)
  return tf.math.top_k(masked, k=k).indices.numpy()


relevant = {}
for user_id, movie_id, rating in zip(test.user_ids, test.movie_ids, test.ratings):
  if rating >= 4:
    relevant.setdefault(int(user_id), set()).add(int(movie_id))
users = np.array(sorted(relevant))


def recall_at_10(recommended):
  hits = [
    len(set(recommended[i]) & relevant[u]) / min(10, len(relevant[u])) for i, u in enumerate(users)
  ]
  return float(np.mean(hits))


model_recall = recall_at_10(top_k(users, scores[users]))
popularity_recall = recall_at_10(top_k(users, np.tile(counts, (len(users), 1))))
print(
  f"recall@10 over {len(users)} test users: model {model_recall:.4f}, "
  f"most popular movies {popularity_recall:.4f}"
)
assert model_recall > popularity_recall

# %% [markdown]
# With the default 4 epochs on the synthetic data we measured recall@10 of 0.120 for the
# model against 0.091 for the most-rated movies (0.111 for the movies most often rated 4+;
# the planted model itself, which generated the data, reaches 0.143). The gain over
# popularity is real but small: in this data set, *which* movies a user rates carries no
# information about the user, so all a model can add is the user's taste among popular
# movies. The fast mode's two epochs gave 0.112.

# %%
for user_id in users[:3]:
  print(f"Top 10 for user {user_id} (held-out 4+ ratings marked *):")
  for movie_id in top_k([user_id], scores[[user_id]])[0]:
    mark = "*" if movie_id in relevant[user_id] else " "
    print(f"  {mark} {data.titles[int(movie_id)]}")
