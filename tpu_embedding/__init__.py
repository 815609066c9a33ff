"""tpu_embedding: one Keras layer for large embedding tables on CPU, GPU and TPU."""

from tpu_embedding.hardware import Path
from tpu_embedding.layer import TPUEmbedding
from tpu_embedding.optimizers import translate_keras_optimizer
from tpu_embedding.partial import PartialTPUEmbedding

__all__ = ["PartialTPUEmbedding", "Path", "TPUEmbedding", "translate_keras_optimizer"]
