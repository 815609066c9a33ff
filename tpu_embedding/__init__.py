"""tpu_embedding: one Keras layer for large embedding tables on CPU, GPU and TPU."""
