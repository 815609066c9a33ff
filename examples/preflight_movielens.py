"""MovieLens 100K for `python -m tpu_embedding.preflight`: the ranking example's feature config
(`feature_config`, Adagrad) and its rating batches (`batches`).

  python -m tpu_embedding.preflight --config examples.preflight_movielens \\
    --data examples.preflight_movielens:batches --topology v6e-8 --batch-size 1024

The ratings come from `examples.data.movielens` (its synthetic stand-in unless
MOVIELENS_DIR names an ml-100k directory).
"""

from __future__ import annotations

import os

import tensorflow as tf

from examples import movielens_ranking
from examples.data import movielens

BATCH_SIZE = 1024
optimizer = tf.tpu.experimental.embedding.Adagrad(0.1)


def _data() -> movielens.MovieLens:
  return movielens.load_movielens(data_dir=os.environ.get("MOVIELENS_DIR"))


def feature_config() -> dict:
  data = _data()
  return movielens_ranking.make_feature_config(data.num_users, data.num_movies)


def batches() -> tf.data.Dataset:
  """The ratings' ids in global batches of BATCH_SIZE (the last one dropped: TPU steps need
  equal batches), features only."""
  dataset = movielens.to_dataset(_data(), BATCH_SIZE, drop_remainder=True)
  return dataset.map(lambda features, label: features)
