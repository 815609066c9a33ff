"""The `TPUEmbedding` layers for Keras 3 with the TensorFlow backend (`tf.keras` on TF 2.16+).

The same layers as `tpu_embedding.TPUEmbedding` / `PartialTPUEmbedding` (tf-keras), sharing
their configuration, hardware dispatch, TPU backends and CPU engine; importing this package
never imports tf-keras.
"""

import keras

if int(keras.__version__.split(".")[0]) < 3:
  raise ImportError(
    f"tpu_embedding.keras is for Keras 3 (installed with TensorFlow 2.16 and later); this is "
    f"Keras {keras.__version__}. Use tpu_embedding.TPUEmbedding, the tf-keras layer, instead."
  )

from tpu_embedding.keras.layer import TPUEmbedding  # noqa: E402
from tpu_embedding.keras.partial import PartialTPUEmbedding  # noqa: E402

__all__ = ["PartialTPUEmbedding", "TPUEmbedding"]
