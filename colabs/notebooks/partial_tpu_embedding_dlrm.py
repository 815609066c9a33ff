# %% [markdown]
# # DLRM on Criteo-shaped data with PartialTPUEmbedding
#
# Click-through models such as DLRM mix a few huge categorical features (ids in the millions)
# with many small ones. `tpu_embedding.PartialTPUEmbedding` puts the large tables in the TPU
# embedding engine, sharded over the chips, and keeps small tables whole on every device,
# where a lookup is cheap; on CPU it trains both kinds exactly as the TPU would. One
# `size_threshold` decides, and `placement()` reports where each table went and what it
# costs per device.
#
# The data is synthetic but shaped like Criteo: 13 dense features and categorical features of
# very different vocabulary sizes with Zipf-distributed ids. Clicks come from a known logistic
# model, so we know the best log loss achievable and can check the model approaches it.

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

# %% [markdown]
# ## Data with a known answer
#
# Each id of each categorical feature has a planted weight, and two features also interact
# through planted 4-dimensional factors; the click logit adds a linear function of the
# (log-transformed) dense features. Frequent ids get their weights learned quickly; the long
# tail is what a large table holds.

# %%
import numpy as np

rng = np.random.default_rng(0)
NUM_DENSE = 13
VOCABULARIES = {  # Criteo-like spread: a few tiny, a few large
  "c1_device": 8,
  "c2_site_category": 30,
  "c3_advertiser": 2_000,
  "c4_site": 20_000,
  "c5_user": 100_000,
  "c6_ad": 200_000,
}
NUM_EXAMPLES = 60_000 if FAST else 300_000


def zipf_ids(vocabulary_size, size, exponent=1.1):
  popularity = np.arange(1, vocabulary_size + 1, dtype=np.float64) ** -exponent
  ranks = rng.choice(vocabulary_size, size=size, p=popularity / popularity.sum())
  return rng.permutation(vocabulary_size)[ranks]  # popular ids scattered over the table


weights = {name: rng.normal(0.0, 0.6, size) for name, size in VOCABULARIES.items()}
site_factors = rng.normal(0.0, 0.5, (VOCABULARIES["c4_site"], 4))
ad_factors = rng.normal(0.0, 0.5, (VOCABULARIES["c6_ad"], 4))
dense_weights = rng.normal(0.0, 0.3, NUM_DENSE)


def make_data(n):
  dense = np.log1p(rng.lognormal(1.0, 1.0, (n, NUM_DENSE))).astype(np.float32)
  ids = {name: zipf_ids(size, n).astype(np.int32) for name, size in VOCABULARIES.items()}
  logit = -1.3 + (dense - dense.mean(0)) @ dense_weights
  logit += sum(weights[name][ids[name]] for name in VOCABULARIES)
  logit += np.sum(site_factors[ids["c4_site"]] * ad_factors[ids["c6_ad"]], axis=1)
  probability = 1.0 / (1.0 + np.exp(-logit))
  clicks = (rng.random(n) < probability).astype(np.float32)
  return dense, ids, clicks, probability


train = make_data(NUM_EXAMPLES)
test = make_data(NUM_EXAMPLES // 5)


def log_loss(p, y):
  p = np.clip(p, 1e-7, 1 - 1e-7)
  return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


click_rate = train[2].mean()
constant_loss = log_loss(np.full_like(test[2], click_rate), test[2])
best_loss = log_loss(test[3], test[2])
print(
  f"click rate {click_rate:.3f}; test log loss: constant {constant_loss:.4f}, "
  f"the planted model {best_loss:.4f}"
)

# %% [markdown]
# ## PartialTPUEmbedding and its placement
#
# Tables above `size_threshold` rows are sharded (TPU embedding engine), the others
# replicated. Every table is trained by its own mid-level optimizer, here Adagrad.

# %%
import tpu_embedding

EMBEDDING_DIM = 16
embedding = tf.tpu.experimental.embedding
feature_config = {
  name: embedding.FeatureConfig(
    table=embedding.TableConfig(vocabulary_size=size, dim=EMBEDDING_DIM, name=name), name=name
  )
  for name, size in VOCABULARIES.items()
}

with strategy.scope():
  partial_embedding = tpu_embedding.PartialTPUEmbedding(
    feature_config, embedding.Adagrad(learning_rate=0.2), size_threshold=10_000
  )

print(partial_embedding.placement(num_replicas=strategy.num_replicas_in_sync))
print()
print("On an 8-chip TPU slice:")
print(partial_embedding.placement(num_replicas=8))

# %% [markdown]
# ## DLRM
#
# A bottom MLP maps the dense features to the embedding dimension; the pairwise dot products
# of all 7 vectors (dense + 6 embeddings) are the interactions; a top MLP reads the dense
# vector, the interactions and the embeddings, and outputs the click logit.


# %%
class DLRM(tf_keras.Model):
  def __init__(self, embedding_layer):
    super().__init__()
    self.embedding = embedding_layer
    self.bottom = tf_keras.Sequential(
      [
        tf_keras.layers.Dense(64, activation="relu"),
        tf_keras.layers.Dense(EMBEDDING_DIM, activation="relu"),
      ]
    )
    self.top = tf_keras.Sequential(
      [
        tf_keras.layers.Dense(64, activation="relu"),
        tf_keras.layers.Dense(32, activation="relu"),
        tf_keras.layers.Dense(1),
      ]
    )

  def call(self, inputs):
    dense = self.bottom(inputs["dense"])
    embeddings = self.embedding(inputs["sparse"])
    vectors = tf.stack([dense] + [embeddings[name] for name in VOCABULARIES], axis=1)
    products = tf.matmul(vectors, vectors, transpose_b=True)  # [batch, 7, 7]
    upper = np.triu_indices(vectors.shape[1], k=1)
    interactions = tf.gather_nd(
      tf.transpose(products, [1, 2, 0]), np.stack(upper, axis=1)
    )  # [21, batch]
    # The top MLP also reads each embedding itself (DCN/DLRM variants do): per-id
    # effects then need no detour through a dot product.
    features = tf.concat(
      [dense, tf.transpose(interactions)] + [embeddings[n] for n in VOCABULARIES], axis=1
    )
    return tf.squeeze(self.top(features), axis=1)


BATCH_SIZE = 512
with strategy.scope():
  model = DLRM(partial_embedding)
  optimizer = tf_keras.optimizers.Adam(learning_rate=0.001)


def step_fn(inputs, clicks):
  with tf.GradientTape() as tape:
    logits = model(inputs)
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=clicks, logits=logits)
    loss = tf.nn.compute_average_loss(losses, global_batch_size=BATCH_SIZE)
  gradients = tape.gradient(loss, model.trainable_variables)
  optimizer.apply_gradients(zip(gradients, model.trainable_variables))
  return loss


@tf.function
def train_step(iterator):
  loss = strategy.run(step_fn, args=next(iterator))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)


def dataset(split, shuffle):
  dense, ids, clicks, _ = split
  data = tf.data.Dataset.from_tensor_slices(({"dense": dense, "sparse": ids}, clicks))
  if shuffle:
    data = data.shuffle(len(clicks), seed=0)
  return data.batch(BATCH_SIZE, drop_remainder=True)


# %%
EPOCHS = 1 if FAST else 3
train_data = strategy.experimental_distribute_dataset(dataset(train, shuffle=True))
steps = len(train[2]) // BATCH_SIZE
losses = []
for epoch in range(EPOCHS):
  progbar = tf_keras.utils.Progbar(steps, stateful_metrics=["loss"])
  iterator = iter(train_data)
  for step in range(steps):
    losses.append(float(train_step(iterator)))
    progbar.update(step + 1, [("loss", float(np.mean(losses[-100:])))])

predict = tf.function(lambda inputs: tf.sigmoid(model(inputs)))
probabilities = np.concatenate(
  [
    np.concatenate(strategy.experimental_local_results(strategy.run(predict, args=(x,))))
    for x, _ in strategy.experimental_distribute_dataset(dataset(test, shuffle=False))
  ]
)
kept = len(probabilities)
test_loss = log_loss(probabilities, test[2][:kept])
print(
  f"test log loss: DLRM {test_loss:.4f}, constant click rate {constant_loss:.4f}, "
  f"planted model {log_loss(test[3][:kept], test[2][:kept]):.4f}"
)
assert test_loss < constant_loss

# %% [markdown]
# ## Training loss

# %%
# %matplotlib inline
import matplotlib.pyplot as plt

window = 50
smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(losses, alpha=0.25, label="per step")
ax.plot(np.arange(window - 1, len(losses)), smooth, label=f"mean of {window} steps")
ax.axhline(constant_loss, color="gray", linestyle="--", label="constant click rate (test)")
ax.axhline(best_loss, color="green", linestyle=":", label="planted model (test)")
ax.set(xlabel="step", ylabel="log loss", title="DLRM with PartialTPUEmbedding")
ax.legend()
fig.savefig(os.path.join(OUTPUT_DIR, "dlrm_training_loss.png"), dpi=100)
plt.show()
