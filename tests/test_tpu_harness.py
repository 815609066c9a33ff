"""Guards tests/support/tpu_harness.py: every TF internal it stubs or imitates still exists in TF.

A TF upgrade that renames or moves one of them fails here, by name, instead of making the
real-class tests pass or fail for the wrong reason.
"""

import inspect
import re

import pytest
import tensorflow as tf
from tensorflow.python.distribute import tpu_strategy
from tensorflow.python.tpu import tpu_embedding_v1, tpu_embedding_v2

from tpu_embedding import hardware, tf_internals

import tpu_harness

emb = tf.tpu.experimental.embedding
MID_LEVEL_MODULES = [tpu_embedding_v1, tpu_embedding_v2]
if tf_internals.HAS_SPARSE_CORE:  # TF 2.16 on
  from tensorflow.python.tpu import tpu_embedding_v3

  MID_LEVEL_MODULES.append(tpu_embedding_v3)


@pytest.mark.parametrize(
  "module,name,_",
  tpu_harness.runtime_stubs(tpu_harness.Recorded()),
  ids=lambda v: v if isinstance(v, str) else "",
)
def test_every_stubbed_name_is_still_where_tf_keeps_it(module, name, _):
  assert callable(getattr(module, name, None)), f"{module.__name__}.{name} moved"


@pytest.mark.parametrize("attribute", tpu_harness.STRATEGY_ATTRIBUTES)
def test_tf_tpu_strategy_still_has_every_attribute_the_stand_in_imitates(attribute):
  extended = tpu_strategy.TPUExtended
  source = inspect.getsource(extended)
  assert hasattr(extended, attribute) or f"self.{attribute} =" in source, attribute


@pytest.mark.parametrize("module", MID_LEVEL_MODULES)
def test_the_mid_level_classes_still_read_only_what_the_stand_in_carries(module):
  """Every `extended.<name>` a mid-level class reads is one the stand-in provides."""
  read = set(re.findall(r"\.extended\.(\w+)", inspect.getsource(module)))
  assert read <= set(tpu_harness.STRATEGY_ATTRIBUTES), read - set(tpu_harness.STRATEGY_ATTRIBUTES)


def test_the_stand_in_is_a_real_tpu_strategy_for_tf_and_for_us(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1, replicas=2)
  assert isinstance(strategy, tpu_harness.TPU_STRATEGY_CLASSES)
  assert hardware.is_tpu_strategy(strategy)
  assert strategy.num_replicas_in_sync == 2
  with strategy.scope():
    assert tf.distribute.get_strategy() is strategy
