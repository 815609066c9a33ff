"""Every name under which a table or slot is saved, in one place.

Checkpoints are read by name, so these names are the format: a checkpoint written by one layer
(either side of `PartialTPUEmbedding`, `TPUEmbedding` on any path but SparseCore,
tf-recommenders 0.7.7) restores into another only because all of them use the names below.
"""

from __future__ import annotations

# The checkpoint name of the object holding the tables. tf-recommenders' layer keeps its
# mid-level object at the attribute `_tpu_embedding`, so its checkpoints name every table
# `.../_tpu_embedding/<table>`; the layers here track their tables under the same name, byte for
# byte, so that those checkpoints restore (and theirs restore into tf-recommenders).
TABLES_KEY = "_tpu_embedding"

# tf-recommenders' `PartialTPUEmbedding` keeps each replicated feature's table in a Keras
# `Embedding` layer: `_keras_embedding_layers/<feature path>/embeddings`.
TFRS_KERAS_LAYERS_KEY = "_keras_embedding_layers"
TFRS_KERAS_EMBEDDINGS_KEY = "embeddings"

# On TPU paths `PartialTPUEmbedding` keeps its sharded `TPUEmbedding` layer in the checkpoint
# under this name, so TensorFlow's save/restore callbacks move its tables between TPU memory and
# their host variables.
SHARDED_LAYER_KEY = "_sharded_embedding"

PARAMETERS = "parameters"
"""The key of the table itself in a {"parameters": table, slot name: slot} dict."""


def variable_key(table: str, slot: str = PARAMETERS) -> str:
  """The name of a table (`<table>`) or of one of its slots (`<table>/<slot>`), as TF's
  mid-level classes name them."""
  return table if slot == PARAMETERS else f"{table}/{slot}"


def keras_file_key(table: str, slot: str = PARAMETERS) -> str:
  """The key of a table or slot in a `.keras` file's variable store."""
  return f"table:{table}" if slot == PARAMETERS else f"table:{table}:{slot}"
