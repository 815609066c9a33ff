"""The `TPUEmbedding` layers for Keras 3 with the TensorFlow backend (`tf.keras` on TF 2.16+).

The same layers as `tpu_embedding.TPUEmbedding` / `PartialTPUEmbedding` (tf-keras), sharing
their configuration, hardware dispatch, TPU backends and CPU engine; importing this package
never imports tf-keras.
"""

from tpu_embedding.keras.layer import TPUEmbedding
from tpu_embedding.keras.partial import PartialTPUEmbedding

__all__ = ["PartialTPUEmbedding", "TPUEmbedding"]
