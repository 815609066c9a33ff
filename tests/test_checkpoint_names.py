"""Tests of `tpu_embedding.checkpoint_names`: the names tables and slots are saved under, which
are the checkpoint format (written out here, not derived from the module)."""

from tpu_embedding import checkpoint_names


def test_a_table_is_named_by_itself_and_a_slot_after_its_table():
  assert checkpoint_names.variable_key("user") == "user"
  assert checkpoint_names.variable_key("user", "parameters") == "user"
  assert checkpoint_names.variable_key("user", "accumulators") == "user/accumulators"


def test_a_keras_file_prefixes_tables_and_joins_slots_with_a_colon():
  assert checkpoint_names.keras_file_key("user") == "table:user"
  assert checkpoint_names.keras_file_key("user", "momenta") == "table:user:momenta"


def test_the_object_names_are_tf_recommenders_attributes_byte_for_byte():
  assert checkpoint_names.TABLES_KEY == "_tpu_embedding"
  assert checkpoint_names.TFRS_KERAS_LAYERS_KEY == "_keras_embedding_layers"
  assert checkpoint_names.TFRS_KERAS_EMBEDDINGS_KEY == "embeddings"
