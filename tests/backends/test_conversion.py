"""tpu_embedding.backends.conversion: per-path refusals, and conversions that return new configs."""

import pytest
import tensorflow as tf
import tf_keras
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2

from tpu_embedding.backends import conversion
from tpu_embedding.config import prepare
from tpu_embedding.hardware import ExecutionPath

emb = tf.tpu.experimental.embedding
PACKING = optimization_parameters_pb2.LowDimensionalPackingStatus.Status


def _config(optimizer):
  shared = emb.Adagrad(learning_rate=0.1)
  video = emb.TableConfig(8, 4, name="video", optimizer=shared)
  user = emb.TableConfig(6, 2, name="user", optimizer=shared)
  return prepare(
    {"watched": emb.FeatureConfig(video), "friends": emb.FeatureConfig(user)}, optimizer
  )


@pytest.mark.parametrize("path", list(ExecutionPath))
def test_a_misspelt_table_updates_is_refused_on_every_path(path):
  with pytest.raises(
    ValueError, match=r"table_updates='Keras'; expected one of \('engine', 'keras'\)"
  ):
    conversion.check_layer_options(path, "Keras", False)


@pytest.mark.parametrize("path", [ExecutionPath.TPU_V0, ExecutionPath.TPU_V1, ExecutionPath.TPU_V2])
def test_check_finite_is_refused_on_tpu(path):
  conversion.check_layer_options(path, "engine", False)
  with pytest.raises(ValueError, match=f"check_finite=True .* on {path.name}"):
    conversion.check_layer_options(path, "engine", True)


def test_v1_gets_enum_packing_on_copies_shared_as_the_originals_were():
  config = _config(None)
  converted = conversion.for_tpu_v1(config)
  user, video = converted.tables  # order of first use: "friends" flattens first
  assert [t.name for t in converted.tables] == ["user", "video"]
  assert video.optimizer is user.optimizer  # one shared optimizer stays one
  assert video.optimizer is not config.tables[1].optimizer
  assert video.optimizer.low_dimensional_packing_status == PACKING.UNSPECIFIED
  assert config.tables[1].optimizer.low_dimensional_packing_status is False  # untouched
  assert converted.features[0].config.table is user  # features point at the new tables
  assert converted.user_tables[video] is config.user_tables[config.tables[1]]


def test_v0_drops_optimizers_from_a_copy_and_refuses_mid_level_ones():
  config = prepare(
    {"watched": emb.FeatureConfig(emb.TableConfig(8, 4, name="video"))},
    tf_keras.optimizers.legacy.SGD(0.1),
  )
  converted = conversion.for_tpu_v0(config, "sgd")
  assert [t.optimizer for t in converted.tables] == [None]
  assert type(config.tables[0].optimizer) is emb.SGD
  with pytest.raises(ValueError, match="TableConfig 'user'.optimizer is a .*Adagrad.*TPU_V0"):
    conversion.for_tpu_v0(_config(None), None)


def test_v1_and_v2_refuse_tables_without_optimizer_by_name():
  config = prepare({"x": emb.FeatureConfig(emb.TableConfig(8, 4, name="video"))})
  for convert, path in ((conversion.for_tpu_v1, "TPU_V1"), (conversion.for_tpu_v2, "TPU_V2")):
    with pytest.raises(ValueError, match=rf"Tables \['video'\] have no optimizer.*{path}"):
      convert(config)


def test_v2_refuses_clipping_by_table_and_setting():
  table = emb.TableConfig(8, 4, name="video", optimizer=emb.SGD(0.1, clipvalue=1.0))
  config = prepare({"x": emb.FeatureConfig(table, output_shape=[4])})
  with pytest.raises(ValueError, match="Table 'video': its optimizer sets clipvalue"):
    conversion.for_tpu_v2(config)
