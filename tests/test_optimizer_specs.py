"""The one description per mid-level optimizer class: slots, names, settings, `.keras` form."""

import pytest
import tensorflow as tf

from tpu_embedding import optimizer_specs as specs
from tpu_embedding.engine import updates

E = tf.tpu.experimental.embedding


def _instance(cls):
  if cls is E.CustomOptimizer:
    return cls(lambda g, t, s, lr, h: t, learning_rate=0.1)
  return cls(learning_rate=0.1)


def test_every_mid_level_class_has_one_spec_and_one_update_rule():
  classes = [spec.mid_level for spec in specs.SPECS]
  assert len(set(classes)) == len(classes)
  assert set(classes) == {E.SGD, E.Adagrad, E.AdagradMomentum, E.Adam, E.FTRL, E.CustomOptimizer}
  for cls in classes:
    optimizer = _instance(cls)
    assert specs.spec_of(optimizer).mid_level is cls
    assert updates.rule_for(optimizer).optimizer_class is cls


def test_names_select_their_class():
  assert {name: spec.mid_level for name, spec in specs.BY_NAME.items()} == {
    "sgd": E.SGD,
    "adagrad": E.Adagrad,
    "adam": E.Adam,
    "ftrl": E.FTRL,
  }


@pytest.mark.parametrize(
  "optimizer,shapes",
  [
    (E.SGD(0.1), []),
    (E.Adagrad(0.1), [("accumulators", [7, 3])]),
    (E.Adam(0.1), [("momenta", [7, 3]), ("velocities", [7, 3])]),
    (E.FTRL(0.1), [("accumulators", [7, 3]), ("linears", [7, 3])]),
    (None, []),
  ],
)
def test_slot_shapes(optimizer, shapes):
  assert specs.slot_shapes(optimizer, 7, 3) == shapes


def test_custom_optimizer_slot_of_rank_one_is_a_vector():
  optimizer = E.CustomOptimizer(
    lambda g, t, s, lr, h: t,
    learning_rate=0.1,
    slot_names=["a", "b"],
    slot_initializers=[tf.zeros_initializer(), tf.ones_initializer()],
    slot_dims=[2, 1],
  )
  assert specs.slot_shapes(optimizer, 7, 3) == [("a", [7, 3]), ("b", [7])]


def test_slot_initial_values_follow_the_optimizer():
  (accumulators,) = specs.slot_initializers(E.Adagrad(0.1, initial_accumulator_value=0.25))
  assert float(accumulators(shape=[1], dtype=tf.float32)[0]) == 0.25


def test_tf_recommenders_slot_names():
  assert specs.keras_slot_name(E.Adagrad(0.1), "accumulators") == "accumulator"
  assert specs.keras_slot_name(E.Adam(0.1), "velocities") == "v"
  assert specs.keras_slot_name(E.FTRL(0.1), "linears") == "linear"
  assert specs.keras_slot_name(E.AdagradMomentum(0.1), "momenta") is None


def test_settings_readers():
  optimizer = E.SGD(0.1, clipvalue=(-2.0, 3.0), clip_weight_max=5.0, weight_decay_factor=0.0)
  assert specs.gradient_limits(optimizer) == (-2.0, 3.0)
  assert specs.weight_limits(optimizer) == (None, 5.0)
  assert not specs.has_weight_decay(optimizer)  # a zero factor is no decay
  assert specs.has_weight_decay(E.SGD(0.1, weight_decay_factor=0.5))


def test_keras_file_form_round_trips_and_reads_a_callable_rate_now():
  optimizer = E.Adam(lambda: 0.25, beta_1=0.8, clipvalue=1.5, lazy_adam=False)
  serialized = specs.serialize(optimizer, "t")
  assert serialized["class"] == "Adam"
  assert serialized["config"]["learning_rate"] == 0.25
  assert serialized["config"]["clipvalue"] == [-1.5, 1.5]
  again = specs.deserialize(serialized)
  assert type(again) is E.Adam
  assert (again.learning_rate, again.beta_1, again.lazy_adam) == (0.25, 0.8, False)
  assert specs.gradient_limits(again) == (-1.5, 1.5)


def test_keras_file_form_refuses_custom_optimizers_by_table():
  custom = E.CustomOptimizer(lambda g, t, s, lr, h: t, learning_rate=0.1)
  with pytest.raises(ValueError, match=r"Table 'video'.*SGD, Adagrad, AdagradMomentum, Adam, FTRL"):
    specs.serialize(custom, "video")
  with pytest.raises(ValueError, match="Unknown embedding optimizer 'CustomOptimizer'"):
    specs.deserialize({"class": "CustomOptimizer", "config": {}})
