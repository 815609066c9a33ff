"""The two-table feature config the pre-flight tests share: "user" (100 x 8), "movie" (50 x 4)."""

import tensorflow as tf

emb = tf.tpu.experimental.embedding


def feature_config():
  return {
    "user": emb.FeatureConfig(emb.TableConfig(100, 8, name="user")),
    "movie": emb.FeatureConfig(emb.TableConfig(50, 4, name="movie")),
  }
