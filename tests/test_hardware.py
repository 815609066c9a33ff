"""Tests for tpu_embedding.hardware: which execution path a strategy and an override lead to.

No TPU is available here: TPU strategies are represented either by patching
`hardware.detect_embedding_feature` (the one function that asks the runtime) or by a stand-in
strategy object shaped like a TPU strategy. These tests check the decision, not TPU execution.
"""

import itertools
import types

import pytest
import tensorflow as tf

from tpu_embedding import hardware
from tpu_embedding.hardware import EmbeddingFeature, Path

FEATURES = [EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V1, EmbeddingFeature.V2]
OVERRIDES = [None] + FEATURES
PATH_OF = {
    EmbeddingFeature.UNSUPPORTED: Path.TPU_V0,
    EmbeddingFeature.V1: Path.TPU_V1,
    EmbeddingFeature.V2: Path.TPU_V2,
}

NON_TPU_STRATEGIES = {
    "default": lambda: tf.distribute.get_strategy(),
    "one_device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    "mirrored": lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
}


@pytest.mark.parametrize("kind,override",
                         list(itertools.product(NON_TPU_STRATEGIES, OVERRIDES)))
def test_non_tpu_strategies_take_the_cpu_path_whatever_the_override(kind, override):
  strategy = NON_TPU_STRATEGIES[kind]()
  assert hardware.detect_embedding_feature(strategy) is None
  assert hardware.choose_path(strategy, override) is Path.CPU


def test_the_strategy_in_scope_is_what_is_examined():
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    assert hardware.choose_path(tf.distribute.get_strategy()) is Path.CPU


@pytest.fixture
def fake_tpu(monkeypatch):
  """Makes every strategy look like a TPU whose runtime reports the given feature."""

  def install(feature):
    monkeypatch.setattr(hardware, "detect_embedding_feature", lambda strategy: feature)
    return tf.distribute.get_strategy()

  return install


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
  assert hardware.choose_path(strategy, EmbeddingFeature.UNSUPPORTED) is Path.TPU_V0


@pytest.mark.parametrize("detected,override", [
    (EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V1),
    (EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V2),
    (EmbeddingFeature.V1, EmbeddingFeature.V2),
    (EmbeddingFeature.V2, EmbeddingFeature.V1),
])
def test_forcing_a_feature_the_hardware_lacks_is_an_error(fake_tpu, detected, override):
  strategy = fake_tpu(detected)
  with pytest.raises(ValueError) as error:
    hardware.choose_path(strategy, override)
  message = str(error.value)
  assert str(override) in message  # what was asked for
  assert str(detected) in message  # what the hardware has
  assert "UNSUPPORTED" in message  # the override that is always possible


def test_every_case_of_the_matrix_is_decided(monkeypatch):
  """The whole (detected x override) table, written out once."""
  expected = {}
  for detected, override in itertools.product(FEATURES, OVERRIDES):
    if override is None or override == detected:
      expected[detected, override] = PATH_OF[detected]
    elif override == EmbeddingFeature.UNSUPPORTED:
      expected[detected, override] = Path.TPU_V0
    else:
      expected[detected, override] = ValueError
  assert list(expected.values()).count(ValueError) == 4
  for (detected, override), want in expected.items():
    monkeypatch.setattr(hardware, "detect_embedding_feature", lambda s, d=detected: d)
    if want is ValueError:
      with pytest.raises(ValueError):
        hardware.choose_path(object(), override)
    else:
      assert hardware.choose_path(object(), override) is want, (detected, override)


# --- detect_embedding_feature itself, on stand-in strategy objects -------------------------


def _tpu_like(cls_name, feature, base=object):
  """An object of a class named `cls_name` whose runtime reports `feature`."""
  cls = type(cls_name, (base,), {})
  strategy = cls.__new__(cls)
  strategy.extended = types.SimpleNamespace(
      tpu_hardware_feature=types.SimpleNamespace(embedding_feature=feature))
  return strategy


@pytest.mark.parametrize("cls_name", ["TPUStrategy", "TPUStrategyV2", "TPUStrategyV1"])
@pytest.mark.parametrize("feature", FEATURES)
def test_detection_reads_the_runtime_feature_of_a_tpu_strategy(cls_name, feature):
  strategy = _tpu_like(cls_name, feature)
  assert hardware.is_tpu_strategy(strategy)
  assert hardware.detect_embedding_feature(strategy) == feature
  assert hardware.choose_path(strategy) is PATH_OF[feature]


def test_a_subclass_of_a_tpu_strategy_is_still_a_tpu_strategy():
  # Users and frameworks subclass TPUStrategy; the CPU path must never be taken under one.
  base = type("TPUStrategy", (), {})
  strategy = _tpu_like("MyCompanyStrategy", EmbeddingFeature.V1, base=base)
  assert hardware.is_tpu_strategy(strategy)
  assert hardware.choose_path(strategy) is Path.TPU_V1


def test_real_tpu_strategy_classes_are_recognised_by_type():
  for cls in (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy):
    strategy = cls.__new__(cls)  # never initialised: there is no TPU to connect to
    assert hardware.is_tpu_strategy(strategy), cls


def test_detection_never_touches_the_runtime_off_tpu():
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  assert not hardware.is_tpu_strategy(strategy)
  assert hardware.detect_embedding_feature(strategy) is None
