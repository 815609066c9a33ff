"""Tests for tpu_embedding.optimizers: Keras -> mid-level translation and dynamic learning rates.

Expected numbers are worked out by hand in the comments, never read back from the code.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import optimizers

emb = tf.tpu.experimental.embedding

FAMILIES = {
  "legacy": (tf_keras.optimizers.legacy, tf_keras.optimizers.schedules),
  "current": (tf_keras.optimizers, tf_keras.optimizers.schedules),
  "keras3": (keras.optimizers, keras.optimizers.schedules),
}
ALL = list(FAMILIES)


def keras_optimizer(family, name, **kwargs):
  return getattr(FAMILIES[family][0], name)(**kwargs)


def schedules(family):
  return FAMILIES[family][1]


def f32(x):
  return np.float32(x)


def lr_value(mid):
  return float(optimizers.learning_rate_tensor(mid).numpy())


# --- hyperparameters carried over -------------------------------------------------------------


@pytest.mark.parametrize("family", ALL)
def test_sgd(family):
  k = keras_optimizer(family, "SGD", learning_rate=0.05)
  mid = optimizers.translate_keras_optimizer(k)
  assert type(mid) is emb.SGD
  assert lr_value(mid) == f32(0.05)
  assert (mid.clip_gradient_min, mid.clip_gradient_max) == (None, None)
  assert mid.weight_decay_factor is None


@pytest.mark.parametrize("family", ALL)
def test_adagrad(family):
  k = keras_optimizer(family, "Adagrad", learning_rate=0.02, initial_accumulator_value=0.25)
  mid = optimizers.translate_keras_optimizer(k)
  assert type(mid) is emb.Adagrad
  assert lr_value(mid) == f32(0.02)
  assert f32(mid.initial_accumulator_value) == f32(0.25)


@pytest.mark.parametrize("family", ALL)
def test_adam(family):
  k = keras_optimizer(family, "Adam", learning_rate=0.003, beta_1=0.8, beta_2=0.95, epsilon=1e-5)
  mid = optimizers.translate_keras_optimizer(k)
  assert type(mid) is emb.Adam
  # No bias correction folded in: Keras's first step would use 0.003*sqrt(0.05)/0.2 = 0.00335.
  assert lr_value(mid) == f32(0.003)
  assert (f32(mid.beta_1), f32(mid.beta_2), f32(mid.epsilon)) == (
    f32(0.8),
    f32(0.95),
    f32(1e-5),
  )
  assert mid.sum_inside_sqrt is False  # Keras: m / (sqrt(v) + epsilon)
  assert mid.lazy_adam is True


@pytest.mark.parametrize("family", ALL)
def test_ftrl(family):
  k = keras_optimizer(
    family,
    "Ftrl",
    learning_rate=0.07,
    learning_rate_power=-0.6,
    initial_accumulator_value=0.3,
    l1_regularization_strength=0.01,
    l2_regularization_strength=0.02,
    beta=0.5,
  )
  mid = optimizers.translate_keras_optimizer(k)
  assert type(mid) is emb.FTRL
  assert lr_value(mid) == f32(0.07)
  got = (
    mid.learning_rate_power,
    mid.initial_accumulator_value,
    mid.l1_regularization_strength,
    mid.l2_regularization_strength,
    mid.beta,
  )
  assert [f32(v) for v in got] == [f32(-0.6), f32(0.3), f32(0.01), f32(0.02), f32(0.5)]


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam", "Ftrl"])
def test_clipvalue_maps_to_symmetric_gradient_clipping(family, name):
  mid = optimizers.translate_keras_optimizer(keras_optimizer(family, name, clipvalue=0.15))
  assert (f32(mid.clip_gradient_min), f32(mid.clip_gradient_max)) == (f32(-0.15), f32(0.15))


@pytest.mark.parametrize("family", ALL)
def test_learning_rate_callable_points_back_to_keras_optimizer(family):
  k = keras_optimizer(family, "SGD", learning_rate=0.05)
  mid = optimizers.translate_keras_optimizer(k)
  assert isinstance(mid.learning_rate, optimizers.KerasLearningRate)
  assert mid.learning_rate.keras_optimizer is k
  # Translating the same Keras optimizer twice gives equal optimizers; another one does not.
  assert mid == optimizers.translate_keras_optimizer(k)
  assert hash(mid) == hash(optimizers.translate_keras_optimizer(k))
  other = keras_optimizer(family, "SGD", learning_rate=0.05)
  assert mid != optimizers.translate_keras_optimizer(other)


# --- refused parameters -----------------------------------------------------------------------

REFUSED = [
  # (families, class, constructor kwargs, refused parameter, its value)
  (ALL, "SGD", {"momentum": 0.9}, "momentum", 0.9),
  (ALL, "SGD", {"nesterov": True}, "nesterov", True),
  (ALL, "SGD", {"clipnorm": 1.5}, "clipnorm", 1.5),
  (ALL, "Adam", {"global_clipnorm": 2.5}, "global_clipnorm", 2.5),
  (ALL, "Adam", {"amsgrad": True}, "amsgrad", True),
  (["current"], "Adam", {"adaptive_epsilon": True}, "adaptive_epsilon", True),
  (ALL, "Adagrad", {"epsilon": 1e-3}, "epsilon", 1e-3),
  (
    ALL,
    "Ftrl",
    {"l2_shrinkage_regularization_strength": 0.1},
    "l2_shrinkage_regularization_strength",
    0.1,
  ),
  (["current", "keras3"], "Adagrad", {"weight_decay": 0.004}, "weight_decay", 0.004),
  (["current", "keras3"], "SGD", {"use_ema": True}, "use_ema", True),
  (["legacy"], "SGD", {"decay": 0.01}, "decay", 0.01),
  (["keras3"], "SGD", {"loss_scale_factor": 128.0}, "loss_scale_factor", 128.0),
  (["keras3"], "Adam", {"gradient_accumulation_steps": 4}, "gradient_accumulation_steps", 4),
]


def _refused_cases():
  for families, name, kwargs, param, value in REFUSED:
    for family in families:
      yield pytest.param(family, name, kwargs, param, value, id=f"{family}-{name}-{param}")


@pytest.mark.parametrize("family,name,kwargs,param,value", list(_refused_cases()))
def test_refused_parameter(family, name, kwargs, param, value):
  k = keras_optimizer(family, name, **kwargs)
  with pytest.raises(ValueError) as info:
    optimizers.translate_keras_optimizer(k, where="TableConfig 'video'.optimizer")
  message = str(info.value)
  assert message.startswith("TableConfig 'video'.optimizer: ")
  assert name in message
  assert f"{param}={value!r}" in message


@pytest.mark.parametrize("family", ["legacy"])
def test_refused_gradient_transformers(family):
  def halve(grads_and_vars):
    return [(g / 2, v) for g, v in grads_and_vars]

  k = keras_optimizer(family, "SGD", gradient_transformers=[halve])
  with pytest.raises(ValueError, match=r"SGD has gradient_transformers=\[<function .*halve"):
    optimizers.translate_keras_optimizer(k)


@pytest.mark.parametrize("family", ALL)
def test_refusal_says_what_to_use_instead(family):
  with pytest.raises(ValueError, match="AdagradMomentum"):
    optimizers.translate_keras_optimizer(keras_optimizer(family, "SGD", momentum=0.5))
  with pytest.raises(ValueError, match="clipvalue"):
    optimizers.translate_keras_optimizer(keras_optimizer(family, "SGD", clipnorm=1.0))


@pytest.mark.parametrize("family", ["current", "keras3"])
def test_weight_decay_refusal_points_to_weight_decay_factor(family):
  with pytest.raises(ValueError, match="weight_decay_factor"):
    optimizers.translate_keras_optimizer(keras_optimizer(family, "SGD", weight_decay=0.1))


UNSUPPORTED = {
  "legacy": ["RMSprop", "Adamax", "Nadam", "Adadelta"],
  "current": ["RMSprop", "Adamax", "Nadam", "Adadelta", "AdamW", "Lion"],
  "keras3": ["RMSprop", "Adamax", "Nadam", "Adadelta", "AdamW", "Lion", "Lamb"],
}


@pytest.mark.parametrize("family,name", [(f, n) for f, names in UNSUPPORTED.items() for n in names])
def test_unsupported_keras_class(family, name):
  with pytest.raises(ValueError) as info:
    optimizers.normalize_optimizer(keras_optimizer(family, name))
  message = str(info.value)
  assert name in message
  assert "tf.tpu.experimental.embedding" in message


@pytest.mark.parametrize("family", ALL)
def test_subclass_of_supported_class_is_refused(family):
  class MySGD(FAMILIES[family][0].SGD):
    pass

  with pytest.raises(ValueError, match="MySGD"):
    optimizers.translate_keras_optimizer(MySGD(learning_rate=0.1))


def test_works_without_keras3(monkeypatch):
  monkeypatch.setitem(sys.modules, "keras", None)
  schedule, at_0, _ = exponential("current")
  mid = optimizers.normalize_optimizer(tf_keras.optimizers.Adam(learning_rate=schedule))
  assert type(mid) is emb.Adam
  assert lr_value(mid) == pytest.approx(at_0, rel=1e-6)


def test_non_optimizer_is_a_type_error():
  with pytest.raises(TypeError, match="TableConfig 'a'.optimizer"):
    optimizers.normalize_optimizer(3.0, where="TableConfig 'a'.optimizer")


@pytest.mark.parametrize("caught", [TypeError, ValueError])
def test_non_optimizer_is_caught_as_tfrs_users_catch_it(caught):
  """tf-recommenders raised ValueError here; code written for it catches that."""
  with pytest.raises(caught) as error:
    optimizers.translate_keras_optimizer(object())
  assert str(error.value).startswith("optimizer: expected a Keras optimizer, got object: ")


# --- Adagrad epsilon rule: epsilon <= 1e-6 * min(sqrt(a0), 2 * a0) --------------------------


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize(
  "a0,epsilon,accepted",
  [
    # a0 = 0.1: 1e-6 * min(0.316, 0.2) = 2e-7.
    (0.1, 1e-7, True),  # Keras's default
    (0.1, 3e-7, False),
    # a0 = 1: 1e-6 * min(1, 2) = 1e-6.
    (1.0, 1e-6, True),
    (1.0, 2e-6, False),
    # a0 = 4: 1e-6 * min(2, 8) = 2e-6.
    (4.0, 1.9e-6, True),
  ],
)
def test_adagrad_epsilon_rule(family, a0, epsilon, accepted):
  k = keras_optimizer(family, "Adagrad", initial_accumulator_value=a0, epsilon=epsilon)
  if accepted:
    assert type(optimizers.translate_keras_optimizer(k)) is emb.Adagrad
  else:
    with pytest.raises(ValueError, match=f"epsilon={epsilon!r}"):
      optimizers.translate_keras_optimizer(k)


def test_adagrad_epsilon_refusal_states_the_limit():
  k = tf_keras.optimizers.Adagrad(initial_accumulator_value=0.1, epsilon=3e-7)
  with pytest.raises(ValueError, match=r"epsilon <= 2e-07"):
    optimizers.translate_keras_optimizer(k)


@pytest.mark.parametrize("family", ALL)
def test_invalid_value_for_the_twin_names_the_keras_optimizer(family):
  # Keras accepts a zero initial accumulator; the TPU's Adagrad does not.
  k = keras_optimizer(family, "Adagrad", initial_accumulator_value=0.0)
  with pytest.raises(ValueError, match=r"Adagrad.*initial_accumulator_value"):
    optimizers.normalize_optimizer(k)


# --- strings, None, pass-through -------------------------------------------------------------


@pytest.mark.parametrize(
  "name,cls,default_lr",
  [
    ("sgd", emb.SGD, 0.01),
    ("SGD", emb.SGD, 0.01),
    ("Adagrad", emb.Adagrad, 0.001),
    ("ADAM", emb.Adam, 0.001),
    ("fTrL", emb.FTRL, 0.001),
  ],
)
def test_string(name, cls, default_lr):
  mid = optimizers.normalize_optimizer(name)
  assert type(mid) is cls
  assert mid.learning_rate == default_lr


def test_unknown_string_lists_accepted_names():
  with pytest.raises(ValueError) as info:
    optimizers.normalize_optimizer("rmsprop", where="TableConfig 'video'.optimizer")
  message = str(info.value)
  assert "TableConfig 'video'.optimizer" in message and "'rmsprop'" in message
  for accepted in ("'sgd'", "'adagrad'", "'adam'", "'ftrl'"):
    assert accepted in message


def test_none():
  assert optimizers.normalize_optimizer(None) is None


@pytest.mark.parametrize(
  "make",
  [
    lambda: emb.SGD(learning_rate=0.3),
    lambda: emb.Adagrad(learning_rate=lambda: 0.2),
    lambda: emb.AdagradMomentum(momentum=0.9),
    lambda: emb.Adam(lazy_adam=False),
    lambda: emb.FTRL(beta=0.1),
  ]
  + (  # TF 2.17 has no CustomOptimizer
    [lambda: emb.CustomOptimizer(lambda g, t, slots, lr, hp: t - lr * g)]
    if hasattr(emb, "CustomOptimizer")
    else []
  ),
)
def test_mid_level_passes_through(make):
  mid = make()
  assert optimizers.normalize_optimizer(mid) is mid


def test_mid_level_variable_learning_rate_is_refused():
  mid = emb.SGD(learning_rate=tf.Variable(0.1))
  with pytest.raises(ValueError, match="lambda: var"):
    optimizers.normalize_optimizer(mid)


@pytest.mark.parametrize(
  "make,what",
  [
    (lambda: emb.SGD(learning_rate=0.1, clipvalue=(0.5, -0.5)), "clipvalue"),
    (lambda: emb.Adagrad(learning_rate=0.1, clipvalue=-1.0), "clipvalue"),
    (lambda: tf_keras.optimizers.SGD(0.1, clipvalue=-1.0), "clipvalue"),
    (
      lambda: emb.SGD(learning_rate=0.1, clip_weight_min=1.0, clip_weight_max=0.0),
      "clip_weight_min/clip_weight_max",
    ),
  ],
)
def test_clipping_limits_with_min_above_max_are_refused(make, what):
  with pytest.raises(
    ValueError, match=f"TableConfig 't'.optimizer: {what} has minimum .* above maximum"
  ):
    optimizers.normalize_optimizer(make(), where="TableConfig 't'.optimizer")


# --- learning rates ---------------------------------------------------------------------------


def test_learning_rate_tensor_of_constant():
  lr = optimizers.learning_rate_tensor(emb.SGD(learning_rate=0.25))
  assert lr.dtype == tf.float32 and lr.shape == () and float(lr) == 0.25


@pytest.mark.parametrize(
  "rate",
  [
    lambda: "0.1",
    lambda: None,
    lambda: [0.1, 0.2],
    lambda: tf.constant([0.1]),
    lambda: tf.constant(True),
  ],
)
def test_learning_rate_callable_must_return_a_scalar_float(rate):
  with pytest.raises(
    TypeError, match="Table 't': its learning_rate callable returned .*; expected a scalar float"
  ):
    optimizers.learning_rate_tensor(emb.SGD(learning_rate=rate), where="Table 't'")


def test_learning_rate_tensor_calls_mid_level_callable_each_step():
  counter = tf.Variable(0.0)
  mid = optimizers.normalize_optimizer(emb.Adagrad(learning_rate=lambda: 1.0 / (1.0 + counter)))
  step = tf.function(lambda: optimizers.learning_rate_tensor(mid))
  first = float(step())
  counter.assign_add(1.0)
  assert (first, float(step())) == (1.0, 0.5)
  assert step.experimental_get_tracing_count() == 1


def exponential(family):
  # 0.1 * 0.5 ** (step / 2): step 0 -> 0.1, step 1 -> 0.1 / sqrt(2) = 0.0707106781.
  return schedules(family).ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5), 0.1, 0.0707106781


def piecewise(family):
  # step <= 0 -> 0.5, afterwards 0.25.
  return schedules(family).PiecewiseConstantDecay([0], [0.5, 0.25]), 0.5, 0.25


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("make_schedule", [exponential, piecewise])
def test_schedule_is_evaluated_at_current_iteration(family, make_schedule):
  schedule, at_0, at_1 = make_schedule(family)
  k = keras_optimizer(family, "Adam", learning_rate=schedule)
  mid = optimizers.translate_keras_optimizer(k)
  assert lr_value(mid) == pytest.approx(at_0, rel=1e-6)
  k.iterations.assign_add(1)
  assert lr_value(mid) == pytest.approx(at_1, rel=1e-6)


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("make_schedule", [exponential, piecewise])
def test_schedule_is_not_frozen_at_trace_time(family, make_schedule):
  schedule, at_0, at_1 = make_schedule(family)
  k = keras_optimizer(family, "SGD", learning_rate=schedule)
  mid = optimizers.translate_keras_optimizer(k)
  step = tf.function(lambda: optimizers.learning_rate_tensor(mid))
  first = float(step())
  traces = step.experimental_get_tracing_count()  # legacy creates its variables while tracing
  k.iterations.assign_add(1)
  second = float(step())
  assert step.experimental_get_tracing_count() == traces
  assert (first, second) == (pytest.approx(at_0, rel=1e-6), pytest.approx(at_1, rel=1e-6))


@pytest.mark.parametrize("family", ALL)
def test_assigned_float_learning_rate_is_seen(family):
  k = keras_optimizer(family, "Ftrl", learning_rate=0.2)
  mid = optimizers.translate_keras_optimizer(k)
  step = tf.function(lambda: optimizers.learning_rate_tensor(mid))
  assert float(step()) == f32(0.2)
  traces = step.experimental_get_tracing_count()
  k.learning_rate = 0.125
  assert float(step()) == 0.125
  assert step.experimental_get_tracing_count() == traces
  assert lr_value(mid) == 0.125


@pytest.mark.parametrize("family", ["legacy", "keras3"])
@pytest.mark.filterwarnings("error::UserWarning")
def test_keras_callable_learning_rate_is_called_every_step(family):
  # tf-keras (current) evaluates a callable once into a variable itself, so it is not here.
  counter = tf.Variable(1.0)
  k = keras_optimizer(family, "SGD", learning_rate=lambda: 0.5 / counter)
  mid = optimizers.translate_keras_optimizer(k)
  step = tf.function(lambda: optimizers.learning_rate_tensor(mid))
  first = float(step())
  traces = step.experimental_get_tracing_count()
  counter.assign(4.0)
  assert (first, float(step())) == (0.5, 0.125)
  assert step.experimental_get_tracing_count() == traces


@pytest.mark.parametrize("family", ALL)
def test_keras_apply_gradients_advances_the_schedule(family):
  # The user's own Keras optimizer step is what moves the embedding's schedule.
  schedule, at_0, at_1 = exponential(family)
  k = keras_optimizer(family, "SGD", learning_rate=schedule)
  mid = optimizers.translate_keras_optimizer(k)
  dense = tf.Variable([1.0]) if family != "keras3" else keras.Variable([1.0])
  assert lr_value(mid) == pytest.approx(at_0, rel=1e-6)
  k.apply_gradients([(tf.constant([1.0]), dense)])
  assert lr_value(mid) == pytest.approx(at_1, rel=1e-6)


@pytest.mark.parametrize("kind", [emb.Adagrad, emb.FTRL])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_an_accumulator_starting_at_or_below_zero_is_refused_naming_the_table(kind, value):
  # TF's constructor refuses it; an attribute set afterwards must be refused too: with no
  # epsilon, a touched row whose gradient is 0 would become 0 / sqrt(0) = NaN.
  optimizer = kind(0.1)
  optimizer.initial_accumulator_value = value
  with pytest.raises(
    ValueError,
    match=f"TableConfig 'videos'.optimizer: initial_accumulator_value={value!r} of "
    f"{kind.__name__}; expected a float > 0",
  ):
    optimizers.normalize_optimizer(optimizer, where="TableConfig 'videos'.optimizer")
