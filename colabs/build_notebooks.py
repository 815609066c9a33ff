"""Writes the colabs (nbformat v4, no outputs) from the cell sources below.

    .venv/bin/python colabs/build_notebooks.py

Edit the notebooks here, not in Jupyter, so that the sources stay reviewable; `tests/test_colabs.py`
runs every notebook top to bottom in fast mode.
"""

from __future__ import annotations

import os
import textwrap

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))

# The first code cell of every notebook: fast mode and where files go.
SETUP = """\
import os

# TPU_EMBEDDING_FAST=1 (set by the tests) trains briefly so the notebook runs in well under two
# minutes on a laptop CPU; leave it unset for the figures quoted in the text.
FAST = os.environ.get("TPU_EMBEDDING_FAST") == "1"
OUTPUT_DIR = os.environ.get("TPU_EMBEDDING_OUTPUT_DIR", "colab_output")
os.makedirs(OUTPUT_DIR, exist_ok=True)"""

STRATEGY = """\
import tensorflow as tf
import tf_keras

from tpu_embedding.examples.movielens_ranking import choose_strategy

# TPUStrategy when a TPU is attached (Colab TPU runtime, Cloud TPU VM), else the default strategy.
# This is the only line that knows about the hardware: everything below runs unchanged on both.
strategy = choose_strategy()
print(type(strategy).__name__, "with", strategy.num_replicas_in_sync, "replica(s)")"""


def md(text: str) -> nbformat.NotebookNode:
  return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str) -> nbformat.NotebookNode:
  return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


# ---------------------------------------------------------------------------------------------
# Quick start: the ranking model of the example script, step by step.

QUICKSTART = [
  md("""
    # TPUEmbedding quick start: ranking movies

    This notebook trains the ranking model of the Keras SparseCore tutorial with
    `tpu_embedding.TPUEmbedding`: user and movie ids go through embedding tables, their
    embeddings through a small MLP that predicts the rating. The same code runs on a CPU, a GPU
    or a TPU; on CPU the tables are trained exactly as the TPU embedding engine trains them.

    It is the step-by-step version of `python -m tpu_embedding.examples.movielens_ranking`.
    """),
  code(SETUP),
  md("""
    ## The strategy: the one hardware decision

    `choose_strategy` connects to a TPU when one is attached and otherwise returns the default
    strategy. Models are created under `strategy.scope()` and steps run in `strategy.run`; on a
    TPU, the layer then places its tables in the TPU embedding engine (or SparseCore).
    """),
  code(STRATEGY),
  md("""
    ## Data

    MovieLens 100K from the package's data module. Without network access it uses a synthetic
    stand-in with ml-100k's shape and a planted low-rank structure; set `MOVIELENS_DIR` to an
    ml-100k directory (with `u.data` and `u.item`) to use the real ratings. Ratings are scaled
    to [0, 1], and 20% of them (shuffled with seed 42) are held out for evaluation.
    Predicting the mean training rating is the baseline to beat.
    """),
  code("""
    from tpu_embedding.data import movielens

    data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"), seed=42)
    train, test = movielens.train_test_split(data, test_fraction=0.2, seed=42)
    baseline_rmse = movielens.mean_rating_rmse(train, test)
    print(f"{data.source}: {len(train)} training and {len(test)} test ratings, "
          f"{data.num_users} users, {data.num_movies} movies")
    print(f"RMSE of predicting the mean rating: {baseline_rmse:.4f}")
    """),
  md("""
    ## Tables and features

    One `TableConfig` per id, one `FeatureConfig` per input. Ids are 1-based, so each table has
    one row more than the largest id. The tables' optimizer is a mid-level
    `tf.tpu.experimental.embedding.Adam`: it is what the TPU runs, and what the CPU engine
    reproduces (the TPU's Adam has no bias correction). The dense layers get a Keras optimizer
    as usual.
    """),
  code("""
    EMBEDDING_DIM = 32
    embedding = tf.tpu.experimental.embedding

    user_table = embedding.TableConfig(
        vocabulary_size=data.num_users + 1, dim=EMBEDDING_DIM, name="user_table")
    movie_table = embedding.TableConfig(
        vocabulary_size=data.num_movies + 1, dim=EMBEDDING_DIM, name="movie_table")
    feature_config = {
        "user_id": embedding.FeatureConfig(table=user_table, name="user_id"),
        "movie_id": embedding.FeatureConfig(table=movie_table, name="movie_id"),
    }
    """),
  md("""
    ## The model

    `TPUEmbedding` takes the whole feature dict in one call (on a TPU there is exactly one call
    of the layer per step) and returns a dict of embeddings with the same keys. Their
    concatenation goes through a 256-64-1 MLP with a sigmoid output, since labels lie in [0, 1].
    """),
  code("""
    import tpu_embedding


    class RankingModel(tf_keras.Model):
        def __init__(self, feature_config, embedding_optimizer=None):
            super().__init__()
            self.feature_config = feature_config
            self.embedding = tpu_embedding.TPUEmbedding(feature_config, embedding_optimizer)
            self.ratings = tf_keras.Sequential([
                tf_keras.layers.Dense(256, activation="relu"),
                tf_keras.layers.Dense(64, activation="relu"),
                tf_keras.layers.Dense(1, activation="sigmoid"),
            ])

        def call(self, features, serving=False):
            embeddings = self.embedding(
                features, serving_config=self.feature_config if serving else None)
            joined = tf.concat([embeddings["user_id"], embeddings["movie_id"]], axis=1)
            return tf.squeeze(self.ratings(joined), axis=1)


    with strategy.scope():
        model = RankingModel(feature_config, embedding.Adam(learning_rate=0.01))
        optimizer = tf_keras.optimizers.Adagrad(learning_rate=0.1)
    """),
  md("""
    ## The training step

    A custom step under `strategy.run`. The loss is averaged over the *global* batch, as every
    replica computes a part of it. `tape.gradient` over the model's trainable variables is all
    it takes for the tables too: when the tape reaches the embedding activations, the layer
    applies the tables' gradients with the tables' own optimizer (on TPU, in the embedding
    engine). The Keras optimizer only ever sees the dense variables.
    """),
  code("""
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
    """),
  md("""
    ## Training and evaluation

    Training batches have a static shape (`drop_remainder=True`, required on TPU). The test set
    is evaluated in full: `eval_dataset` pads its last batch with weight-0 rows.
    """),
  code("""
    import numpy as np

    from tpu_embedding.examples import movielens_ranking

    EPOCHS = 2 if FAST else 5
    train_data = strategy.experimental_distribute_dataset(
        movielens.to_dataset(train, BATCH_SIZE, shuffle_seed=42, drop_remainder=True))
    test_data = strategy.experimental_distribute_dataset(
        movielens_ranking.eval_dataset(test, BATCH_SIZE))
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
    """),
  md("""
    ## Checkpoint, export, reload, recommend

    A `tf.train.Checkpoint` holds the tables under the same names on every hardware path.
    `export_saved_model` restores it into a copy of the model built *outside* any TPU strategy,
    so the export looks its tables up with plain CPU ops whatever trained it, and saves a
    `serve(user_id, movie_id)` signature returning ratings on the 1-5 scale.
    """),
  code("""
    checkpoint_path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(OUTPUT_DIR, "quickstart", "ckpt"))
    export_dir = movielens_ranking.export_saved_model(
        checkpoint_path, os.path.join(OUTPUT_DIR, "quickstart_saved_model"),
        data.num_users, data.num_movies)

    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    all_movies = np.array(sorted(data.titles), np.int32)
    top = movielens_ranking.recommend(serve, [1, 2, 3], all_movies, k=5)
    for user_id, picks in top.items():
        print(f"Top 5 for user {user_id}:")
        for movie_id, rating in picks:
            print(f"  {rating:.2f}  {data.titles[movie_id]}")
    """),
  md("""
    ## On a TPU

    Nothing changes but what `choose_strategy()` returns: run the same cells on a TPU runtime.
    The layer picks the TPU embedding API for the chip it finds (embedding engine, SparseCore,
    or replicated tables on TPUs without either).
    """),
]

# ---------------------------------------------------------------------------------------------
# Retrieval: two towers sharing one TPUEmbedding call.

RETRIEVAL = [
  md("""
    # Two-tower retrieval with TPUEmbedding

    A retrieval model scores every movie for a user with a dot product between a *user tower*
    and a *movie tower*, so the best candidates come out of one matrix product (brute force
    here; an approximate index at scale). Both towers look their ids up in **one**
    `TPUEmbedding` layer called once per step: on a TPU, one call per step is all the embedding
    engine allows, so the towers share the layer rather than owning one each.

    We evaluate on held-out ratings: for every test user, does the top 10 (excluding movies the
    user rated in training) contain the movies the user rated 4 or 5 stars? That is recall@10,
    compared with recommending the most popular movies.
    """),
  code(SETUP),
  code(STRATEGY),
  code("""
    import numpy as np

    from tpu_embedding.data import movielens

    data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"), seed=42)
    train, test = movielens.train_test_split(data, test_fraction=0.2, seed=42)
    print(f"{data.source}: {len(train)} training and {len(test)} test ratings")

    # How often each movie is rated in training: the popularity the baseline recommends, and
    # the prior the model's retrieval score uses (see below). +1 smooths unseen movies.
    counts = np.bincount(train.movie_ids, minlength=data.num_movies + 1).astype(np.float32)
    log_popularity = np.log((counts + 1.0) / (counts + 1.0).sum()).astype(np.float32)
    """),
  md("""
    ## Objective

    What is rated and how it is rated are two different questions. In MovieLens, *which* movies
    a user rates is dominated by popularity, and in the synthetic stand-in it is popularity
    alone. An in-batch softmax over rated pairs learns how much more likely a movie is for this
    user than for anyone (the popularity of the sampled negatives cancels out), which is close
    to nothing here; we measured it below the popularity baseline.

    So the towers learn the second question, as in the Keras data-parallel retrieval tutorial
    (which regresses the rating on the dot product): the dot product is the logit of "the user
    rates this movie 4 or more", trained with binary cross-entropy on every training rating.
    Retrieval then ranks by `log P(liked | user, movie) + log popularity(movie)`, which is
    `log P(rated and liked)`.
    """),
  code("""
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
            return (self.user_tower(embeddings["user_id"]),
                    self.movie_tower(embeddings["movie_id"]))


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
    """),
  code("""
    EPOCHS = 2 if FAST else 4
    liked = lambda features, rating: (features, tf.cast(rating >= 0.75, tf.float32))  # 4+ stars
    train_data = strategy.experimental_distribute_dataset(
        movielens.to_dataset(train, BATCH_SIZE, shuffle_seed=42, drop_remainder=True).map(liked))
    steps = len(train) // BATCH_SIZE
    losses = []
    for epoch in range(EPOCHS):
        progbar = tf_keras.utils.Progbar(steps, stateful_metrics=["loss"])
        iterator = iter(train_data)
        for step in range(steps):
            losses.append(float(train_step(iterator)))
            progbar.update(step + 1, [("loss", float(np.mean(losses[-steps:])))])
    assert np.mean(losses[-steps:]) < np.mean(losses[:steps])
    """),
  md("""
    ## Brute-force retrieval and recall@10

    The tower outputs for every user and every movie are computed once; a user's scores over all
    movies are one matrix-vector product, and `tf.math.top_k` picks the best. Movies the user
    rated in training are masked out.
    """),
  code("""
    tables = {table.name: variable for table, variable in model.embedding.embedding_tables.items()}
    user_vectors = model.user_tower(tables["user_table"])
    movie_vectors = model.movie_tower(tables["movie_table"])
    scores = (tf.math.log_sigmoid(tf.matmul(user_vectors, movie_vectors, transpose_b=True))
              + log_popularity[None, :]).numpy()

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
        hits = [len(set(recommended[i]) & relevant[u]) / min(10, len(relevant[u]))
                for i, u in enumerate(users)]
        return float(np.mean(hits))


    model_recall = recall_at_10(top_k(users, scores[users]))
    popularity_recall = recall_at_10(top_k(users, np.tile(counts, (len(users), 1))))
    print(f"recall@10 over {len(users)} test users: model {model_recall:.4f}, "
          f"most popular movies {popularity_recall:.4f}")
    assert model_recall > popularity_recall
    """),
  md("""
    With the default 4 epochs on the synthetic data we measured recall@10 of 0.120 for the
    model against 0.091 for the most-rated movies (0.111 for the movies most often rated 4+;
    the planted model itself, which generated the data, reaches 0.143). The gain over
    popularity is real but small: in this data set, *which* movies a user rates carries no
    information about the user, so all a model can add is the user's taste among popular
    movies. The fast mode's two epochs gave 0.112.
    """),
  code("""
    for user_id in users[:3]:
        print(f"Top 10 for user {user_id} (held-out 4+ ratings marked *):")
        for movie_id in top_k([user_id], scores[[user_id]])[0]:
            mark = "*" if movie_id in relevant[user_id] else " "
            print(f"  {mark} {data.titles[int(movie_id)]}")
    """),
]

# ---------------------------------------------------------------------------------------------
# DLRM with PartialTPUEmbedding on synthetic Criteo-shaped data.

DLRM = [
  md("""
    # DLRM on Criteo-shaped data with PartialTPUEmbedding

    Click-through models such as DLRM mix a few huge categorical features (ids in the millions)
    with many small ones. `tpu_embedding.PartialTPUEmbedding` puts the large tables in the TPU
    embedding engine, sharded over the chips, and keeps small tables whole on every device,
    where a lookup is cheap; on CPU it trains both kinds exactly as the TPU would. One
    `size_threshold` decides, and `placement()` reports where each table went and what it
    costs per device.

    The data is synthetic but shaped like Criteo: 13 dense features and categorical features of
    very different vocabulary sizes with Zipf-distributed ids. Clicks come from a known logistic
    model, so we know the best log loss achievable and can check the model approaches it.
    """),
  code(SETUP),
  code(STRATEGY),
  md("""
    ## Data with a known answer

    Each id of each categorical feature has a planted weight, and two features also interact
    through planted 4-dimensional factors; the click logit adds a linear function of the
    (log-transformed) dense features. Frequent ids get their weights learned quickly; the long
    tail is what a large table holds.
    """),
  code("""
    import numpy as np

    rng = np.random.default_rng(0)
    NUM_DENSE = 13
    VOCABULARIES = {  # Criteo-like spread: a few tiny, a few large
        "c1_device": 8, "c2_site_category": 30, "c3_advertiser": 2_000,
        "c4_site": 20_000, "c5_user": 100_000, "c6_ad": 200_000,
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
    print(f"click rate {click_rate:.3f}; test log loss: constant {constant_loss:.4f}, "
          f"the planted model {best_loss:.4f}")
    """),
  md("""
    ## PartialTPUEmbedding and its placement

    Tables above `size_threshold` rows are sharded (TPU embedding engine), the others
    replicated. Every table is trained by its own mid-level optimizer, here Adagrad.
    """),
  code("""
    import tpu_embedding

    EMBEDDING_DIM = 16
    embedding = tf.tpu.experimental.embedding
    feature_config = {
        name: embedding.FeatureConfig(
            table=embedding.TableConfig(vocabulary_size=size, dim=EMBEDDING_DIM, name=name),
            name=name)
        for name, size in VOCABULARIES.items()
    }

    with strategy.scope():
        partial_embedding = tpu_embedding.PartialTPUEmbedding(
            feature_config, embedding.Adagrad(learning_rate=0.2), size_threshold=10_000)

    print(partial_embedding.placement(num_replicas=strategy.num_replicas_in_sync))
    print()
    print("On an 8-chip TPU slice:")
    print(partial_embedding.placement(num_replicas=8))
    """),
  md("""
    ## DLRM

    A bottom MLP maps the dense features to the embedding dimension; the pairwise dot products
    of all 7 vectors (dense + 6 embeddings) are the interactions; a top MLP reads the dense
    vector, the interactions and the embeddings, and outputs the click logit.
    """),
  code("""
    class DLRM(tf_keras.Model):
        def __init__(self, embedding_layer):
            super().__init__()
            self.embedding = embedding_layer
            self.bottom = tf_keras.Sequential([
                tf_keras.layers.Dense(64, activation="relu"),
                tf_keras.layers.Dense(EMBEDDING_DIM, activation="relu"),
            ])
            self.top = tf_keras.Sequential([
                tf_keras.layers.Dense(64, activation="relu"),
                tf_keras.layers.Dense(32, activation="relu"),
                tf_keras.layers.Dense(1),
            ])

        def call(self, inputs):
            dense = self.bottom(inputs["dense"])
            embeddings = self.embedding(inputs["sparse"])
            vectors = tf.stack([dense] + [embeddings[name] for name in VOCABULARIES], axis=1)
            products = tf.matmul(vectors, vectors, transpose_b=True)   # [batch, 7, 7]
            upper = np.triu_indices(vectors.shape[1], k=1)
            interactions = tf.gather_nd(
                tf.transpose(products, [1, 2, 0]), np.stack(upper, axis=1))  # [21, batch]
            # The top MLP also reads each embedding itself (DCN/DLRM variants do): per-id
            # effects then need no detour through a dot product.
            features = tf.concat(
                [dense, tf.transpose(interactions)] + [embeddings[n] for n in VOCABULARIES], axis=1)
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
    """),
  code("""
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
    probabilities = np.concatenate([
        np.concatenate(strategy.experimental_local_results(strategy.run(predict, args=(x,))))
        for x, _ in strategy.experimental_distribute_dataset(dataset(test, shuffle=False))])
    kept = len(probabilities)
    test_loss = log_loss(probabilities, test[2][:kept])
    print(f"test log loss: DLRM {test_loss:.4f}, constant click rate {constant_loss:.4f}, "
          f"planted model {log_loss(test[3][:kept], test[2][:kept]):.4f}")
    assert test_loss < constant_loss
    """),
  md("""
    ## Training loss
    """),
  code("""
    %matplotlib inline
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
    """),
]

# ---------------------------------------------------------------------------------------------
# Quick start for Keras 3: the same model with `tpu_embedding.keras` and `model.fit`.

KERAS3_QUICKSTART = [
  md("""
    # TPUEmbedding quick start for Keras 3: ranking movies with `model.fit`

    The quick start's ranking model, written for Keras 3 (`tf.keras` on TensorFlow 2.16+, and
    keras-rs users) with `tpu_embedding.keras.DistributedEmbedding`, keras-rs's layer under
    this package's import (see docs/keras-rs.md): a functional model trained by
    `model.fit`, evaluated, saved as a `.keras` file and exported for serving. The tables are
    configured with keras-rs's `TableConfig`/`FeatureConfig`, as in the keras-rs tutorial, and
    trained with their own optimizer exactly as the TPU embedding engine trains them; the
    optimizer given to `model.compile` trains the dense layers only.
    """),
  code(SETUP),
  md("""
    ## Keras 3 with the TensorFlow backend

    The layer runs on TensorFlow: set the backend before Keras is imported. The strategy is the
    only hardware decision: on a TPU, create `tf.distribute.TPUStrategy(resolver)` instead and
    build the model under its scope; nothing else changes.
    """),
  code("""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

    import keras
    import keras_rs
    import numpy as np
    import tensorflow as tf

    import tpu_embedding.keras

    strategy = tf.distribute.get_strategy()
    print("Keras", keras.__version__, "on", keras.backend.backend(), "|",
          type(strategy).__name__)
    """),
  md("""
    ## Data

    The same MovieLens 100K split as the quick start (synthetic without network access; set
    `MOVIELENS_DIR` to an ml-100k directory for the real ratings), as `tf.data` datasets of
    `({"user_id", "movie_id"}, rating in [0, 1])`.
    """),
  code("""
    from tpu_embedding.data import movielens

    data = movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"), seed=42)
    train, test = movielens.train_test_split(data, test_fraction=0.2, seed=42)
    baseline_rmse = movielens.mean_rating_rmse(train, test)
    BATCH_SIZE = 256
    train_data = movielens.to_dataset(train, BATCH_SIZE, shuffle_seed=42, drop_remainder=True)
    test_data = movielens.to_dataset(test, BATCH_SIZE)
    print(f"{data.source}: {len(train)} training and {len(test)} test ratings; "
          f"RMSE of predicting the mean rating: {baseline_rmse:.4f}")
    """),
  md("""
    ## Tables and features, keras-rs style

    keras-rs's configs are accepted as they are: `embedding_dim` is the table width, the Keras
    `Adam` given to each table is translated to the TPU embedding `Adam`, and the global-batch
    `output_shape` to the per-replica shape the TPU needs.
    """),
  code("""
    EMBEDDING_DIM = 32


    def table(name, rows):
        return keras_rs.layers.TableConfig(
            name=name, vocabulary_size=rows + 1, embedding_dim=EMBEDDING_DIM,
            optimizer=keras.optimizers.Adam(learning_rate=0.01))


    feature_configs = {
        name: keras_rs.layers.FeatureConfig(
            name=name, table=t, input_shape=(BATCH_SIZE,),
            output_shape=(BATCH_SIZE, EMBEDDING_DIM))
        for name, t in [("user_id", table("user_table", data.num_users)),
                        ("movie_id", table("movie_table", data.num_movies))]
    }
    """),
  md("""
    ## The model, compiled and fitted

    A functional model: the embedding layer takes the whole feature dict and returns a dict of
    embeddings, whose concatenation goes through a 256-64-1 MLP with a sigmoid output.
    `jit_compile=False`: the layer's XLA training path is not there yet (on CPU Keras' default
    leaves XLA off anyway).
    """),
  code("""
    with strategy.scope():
        inputs = {name: keras.Input(shape=(), dtype="int32", name=name)
                  for name in ("user_id", "movie_id")}
        embeddings = tpu_embedding.keras.DistributedEmbedding(feature_configs)(inputs)
        joined = keras.ops.concatenate([embeddings["user_id"], embeddings["movie_id"]], axis=1)
        hidden = keras.layers.Dense(64, activation="relu")(
            keras.layers.Dense(256, activation="relu")(joined))
        rating = keras.layers.Dense(1, activation="sigmoid")(hidden)
        model = keras.Model(inputs, keras.ops.squeeze(rating, axis=1))
        model.compile(optimizer=keras.optimizers.Adagrad(learning_rate=0.1), loss="mse",
                      metrics=[keras.metrics.RootMeanSquaredError(name="rmse")],
                      jit_compile=False)

    history = model.fit(train_data, epochs=1 if FAST else 5, validation_data=test_data)
    test_rmse = model.evaluate(test_data, return_dict=True, verbose=0)["rmse"]
    print(f"Test RMSE {test_rmse:.4f} vs {baseline_rmse:.4f} for the mean rating")
    assert test_rmse < baseline_rmse
    """),
  md("""
    ## Save, reload, export

    `model.save` writes the tables and their optimizer slots into the `.keras` file, and
    `keras.models.load_model` gives a model that predicts the same. `export_for_serving` writes
    a SavedModel for CPU serving, the same function as for tf-keras models.
    """),
  code("""
    from tpu_embedding import serving

    keras_file = os.path.join(OUTPUT_DIR, "keras3_ranking.keras")
    model.save(keras_file)
    reloaded = keras.models.load_model(keras_file)
    sample = {"user_id": np.array([1, 2, 3], np.int32), "movie_id": np.array([1, 1, 50], np.int32)}
    np.testing.assert_allclose(reloaded.predict(sample, verbose=0),
                               model.predict(sample, verbose=0), rtol=1e-5)


    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)])
    def serve(user_id, movie_id):
        return {"rating": 1.0 + 4.0 * model({"user_id": user_id, "movie_id": movie_id})}


    export_dir = serving.export_for_serving(
        model, os.path.join(OUTPUT_DIR, "keras3_saved_model"), serve, overwrite=True)
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    print("Predicted ratings:", served(user_id=tf.constant(sample["user_id"]),
                                      movie_id=tf.constant(sample["movie_id"]))["rating"].numpy())
    """),
]

NOTEBOOKS = {
  "tpu_embedding_quickstart.ipynb": QUICKSTART,
  "tpu_embedding_keras3_quickstart.ipynb": KERAS3_QUICKSTART,
  "retrieval_two_tower.ipynb": RETRIEVAL,
  "partial_tpu_embedding_dlrm.ipynb": DLRM,
}


def build(directory: str = HERE) -> list[str]:
  paths = []
  for name, cells in NOTEBOOKS.items():
    notebook = nbformat.v4.new_notebook(cells=cells)
    for number, cell in enumerate(notebook.cells):
      cell.id = f"cell-{number}"  # stable ids: rebuilding changes nothing unless a cell does
    notebook.metadata["kernelspec"] = {
      "name": "python3",
      "display_name": "Python 3",
      "language": "python",
    }
    notebook.metadata["language_info"] = {"name": "python"}
    nbformat.validate(notebook)
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
      nbformat.write(notebook, f)
    paths.append(path)
  return paths


if __name__ == "__main__":
  for written in build():
    print(written)
