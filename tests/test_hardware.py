"""Tests for tpu_embedding.hardware: which execution path a strategy and an override lead to.

No TPU is available here: a TPU is `tpu_harness.StandInTPUStrategy`, a real
`tf.distribute.TPUStrategy` instance reporting a chosen embedding feature. These tests check the
decision, not TPU execution.
"""

import itertools

import pytest
import tensorflow as tf

from tpu_embedding import hardware
from tpu_embedding.hardware import EmbeddingFeature, ExecutionPath

import tpu_harness

FEATURES = [EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V1, EmbeddingFeature.V2]
OVERRIDES = [None] + FEATURES
PATH_OF = {
  EmbeddingFeature.UNSUPPORTED: ExecutionPath.TPU_V0,
  EmbeddingFeature.V1: ExecutionPath.TPU_V1,
  EmbeddingFeature.V2: ExecutionPath.TPU_V2,
}

NON_TPU_STRATEGIES = {
  "default": lambda: tf.distribute.get_strategy(),
  "one_device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
  "mirrored": lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
}


@pytest.mark.parametrize("kind,override", list(itertools.product(NON_TPU_STRATEGIES, OVERRIDES)))
def test_non_tpu_strategies_take_the_cpu_path_whatever_the_override(kind, override):
  strategy = NON_TPU_STRATEGIES[kind]()
  assert hardware.detect_embedding_feature(strategy) is None
  assert hardware.choose_path(strategy, override) is ExecutionPath.CPU


def test_the_strategy_in_scope_is_what_is_examined():
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    assert hardware.choose_path(tf.distribute.get_strategy()) is ExecutionPath.CPU


@pytest.fixture
def fake_tpu():
  """A TPU strategy whose runtime reports the given feature."""
  return tpu_harness.StandInTPUStrategy


@pytest.mark.parametrize("detected", FEATURES)
def test_no_override_follows_the_hardware(fake_tpu, detected):
  strategy = fake_tpu(detected)
  assert hardware.choose_path(strategy) is PATH_OF[detected]
  assert hardware.choose_path(strategy, None) is PATH_OF[detected]


@pytest.mark.parametrize("detected", FEATURES)
def test_overriding_with_the_detected_feature_changes_nothing(fake_tpu, detected):
  assert hardware.choose_path(fake_tpu(detected), detected) is PATH_OF[detected]


@pytest.mark.parametrize("detected", FEATURES)
def test_forcing_unsupported_is_always_allowed(fake_tpu, detected):
  strategy = fake_tpu(detected)
  assert hardware.choose_path(strategy, EmbeddingFeature.UNSUPPORTED) is ExecutionPath.TPU_V0


@pytest.mark.parametrize(
  "detected,override",
  [
    (EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V1),
    (EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V2),
    (EmbeddingFeature.V1, EmbeddingFeature.V2),
    (EmbeddingFeature.V2, EmbeddingFeature.V1),
  ],
)
def test_forcing_a_feature_the_hardware_lacks_is_an_error(fake_tpu, detected, override):
  strategy = fake_tpu(detected)
  with pytest.raises(ValueError) as error:
    hardware.choose_path(strategy, override)
  message = str(error.value)
  assert str(override) in message  # what was asked for
  assert str(detected) in message  # what the hardware has
  assert "UNSUPPORTED" in message  # the override that is always possible


def test_every_case_of_the_matrix_is_decided():
  """The whole (detected x override) table, written out once."""
  expected = {}
  for detected, override in itertools.product(FEATURES, OVERRIDES):
    if override is None or override == detected:
      expected[detected, override] = PATH_OF[detected]
    elif override == EmbeddingFeature.UNSUPPORTED:
      expected[detected, override] = ExecutionPath.TPU_V0
    else:
      expected[detected, override] = ValueError
  assert list(expected.values()).count(ValueError) == 4
  for (detected, override), want in expected.items():
    strategy = tpu_harness.StandInTPUStrategy(detected)
    if want is ValueError:
      with pytest.raises(ValueError):
        hardware.choose_path(strategy, override)
    else:
      assert hardware.choose_path(strategy, override) is want, (detected, override)


# --- detect_embedding_feature itself ------------------------------------------------------


@pytest.mark.parametrize("feature", FEATURES)
def test_detection_reads_the_runtime_feature_of_a_tpu_strategy(feature):
  strategy = tpu_harness.StandInTPUStrategy(feature)
  assert hardware.is_tpu_strategy(strategy)
  assert hardware.detect_embedding_feature(strategy) == feature
  assert hardware.choose_path(strategy) is PATH_OF[feature]


def test_a_subclass_of_a_tpu_strategy_is_still_a_tpu_strategy():
  # Users and frameworks subclass TPUStrategy; the CPU path must never be taken under one.
  subclass = type("MyCompanyStrategy", (tpu_harness.StandInTPUStrategy,), {})
  assert hardware.choose_path(subclass(EmbeddingFeature.V1)) is ExecutionPath.TPU_V1


def test_a_class_merely_named_like_a_tpu_strategy_is_not_one():
  named = type("TPUStrategyLookalike", (tf.distribute.OneDeviceStrategy,), {})
  strategy = named("/cpu:0")
  assert not hardware.is_tpu_strategy(strategy)
  assert hardware.choose_path(strategy) is ExecutionPath.CPU


def test_real_tpu_strategy_classes_are_recognised_by_type():
  for cls in (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy):
    strategy = cls.__new__(cls)  # never initialised: there is no TPU to connect to
    assert hardware.is_tpu_strategy(strategy), cls


def test_the_tf1_tpu_strategy_is_refused_by_name():
  """Failure 6: TF's embedding classes refuse TPUStrategyV1 (V1 silently treats it as CPU)."""
  cls = tf.compat.v1.distribute.experimental.TPUStrategy
  strategy = cls.__new__(cls)
  with pytest.raises(
    TypeError,
    match=r"tf\.compat\.v1\.distribute\.experimental\.TPUStrategy"
    r".*tf\.distribute\.TPUStrategy",
  ):
    hardware.choose_path(strategy)


@pytest.mark.parametrize("override", [None, EmbeddingFeature.V1])
def test_an_unknown_embedding_feature_is_refused_not_replicated(override):
  """Failure 7: a feature this package does not know used to fall to V0 in silence."""
  unknown = "EmbeddingFeature.V3"
  with pytest.raises(ValueError, match="EmbeddingFeature.V3.*UNSUPPORTED"):
    hardware.choose_path(tpu_harness.StandInTPUStrategy(unknown), override)
  assert (
    hardware.choose_path(tpu_harness.StandInTPUStrategy(unknown), EmbeddingFeature.UNSUPPORTED)
    is ExecutionPath.TPU_V0
  )


def test_detection_never_touches_the_runtime_off_tpu():
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  assert not hardware.is_tpu_strategy(strategy)
  assert hardware.detect_embedding_feature(strategy) is None
