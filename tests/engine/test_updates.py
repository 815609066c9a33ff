"""Tests of `tpu_embedding.engine.updates` against the spec's worked examples
(SPEC §2.1-2.9, literal numbers) and against the float64 reference
(`tests/support/reference.py`) on random tables, ids and optimizer settings."""

from __future__ import annotations

import functools
import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from typing import Dict, List, Sequence, Tuple

import hypothesis
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import strategies as st

from tpu_embedding import tf_internals
from tpu_embedding.engine import updates
from tpu_embedding.engine.state import TableState

import reference

E = tf.tpu.experimental.embedding
MODES = ("eager", "function")

W0 = [0.5, -0.5]
G1, G2 = [0.1, -0.2], [-0.1, 0.4]
LR = 0.1


def assert_close(actual, expected, what: str = "") -> None:
  """rtol 1e-5 / atol 1e-6 (SPEC §2.2), atol scaled down for tiny values like Adam's v."""
  expected = np.asarray(expected, np.float64)
  scale = min(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
  np.testing.assert_allclose(
    actual, expected, rtol=1e-5, atol=1e-6 * max(scale, 1e-3), err_msg=what
  )


def make_variables(optimizer, table: np.ndarray) -> Tuple[tf.Variable, Dict[str, tf.Variable]]:
  params = reference.params_from_optimizer(optimizer)
  slots = reference.initial_slots(params, table.shape)
  return (
    tf.Variable(table, dtype=tf.float32),
    {k: tf.Variable(v, dtype=tf.float32) for k, v in slots.items()},
  )


def rule_and_state(optimizer, table, slots) -> Tuple[updates.UpdateRule, TableState]:
  rule = updates.rule_for(optimizer)
  return rule, TableState.of({"parameters": table, **slots}, rule.slot_names)


def updater(optimizer, table, slots, mode: str, lr: float = LR):
  """A (row_ids, grads) -> None step, eager or inside one tf.function."""
  rule, state = rule_and_state(optimizer, table, slots)

  def step(row_ids, grads):
    updates.apply_sparse_update(rule, state, row_ids, grads, tf.constant(lr, tf.float32))

  return step if mode == "eager" else tf.function(step, reduce_retracing=True)


def run_one_row(
  optimizer, grads: Sequence[Sequence[float]], mode: str, lr: float = LR, w0: Sequence[float] = W0
) -> List[Tuple[np.ndarray, Dict[str, np.ndarray]]]:
  """Engine states (W, slots) of the one-row example after each step."""
  table, slots = make_variables(optimizer, np.array([w0], np.float64))
  step = updater(optimizer, table, slots, mode, lr)
  states = []
  for g in grads:
    step(tf.constant([0], tf.int32), tf.constant([g], tf.float32))
    states.append((table.numpy()[0], {k: v.numpy()[0] for k, v in slots.items()}))
  return states


def check_states(states, expected: Sequence[Tuple[Sequence[float], Dict[str, Sequence[float]]]]):
  for step, ((w, slots), (want_w, want_slots)) in enumerate(zip(states, expected), 1):
    assert_close(w, want_w, f"W after step {step}")
    for name, want in want_slots.items():
      assert_close(slots[name], want, f"{name} after step {step}")


def reference_one_row(optimizer, grads, lr: float = LR, w0=W0):
  """The reference's states for the same example, to check the reference too."""
  params = reference.params_from_optimizer(optimizer)
  w = np.array([w0], np.float64)
  slots = reference.initial_slots(params, w.shape)
  states = []
  for g in grads:
    w, slots = reference.apply_step(w, slots, [0], np.array([g]), lr, params)
    states.append((w[0], {k: v[0] for k, v in slots.items()}))
  return states


# ------------------------------------------------------------------ worked examples

# (optimizer factory, steps of (W, slots)) from SPEC §2.3-2.7, inputs of §2.2.
WORKED = {
  "sgd": (lambda: E.SGD(learning_rate=LR), [([0.49, -0.48], {}), ([0.50, -0.52], {})]),
  "adagrad": (
    lambda: E.Adagrad(learning_rate=LR),
    [
      ([0.46984887, -0.44654775], {"accumulators": [0.11, 0.14]}),
      ([0.49871638, -0.51957743], {"accumulators": [0.12, 0.30]}),
    ],
  ),
  "adagrad_momentum_plain": (
    lambda: E.AdagradMomentum(learning_rate=LR, momentum=0.9),
    [
      ([0.4, -0.4], {"accumulators": [0.01, 0.04], "momenta": [1, -1]}),
      (
        [0.38071068, -0.39944272],
        {"accumulators": [0.02, 0.20], "momenta": [0.19289322, -0.00557281]},
      ),
    ],
  ),
  "adagrad_momentum_nesterov": (
    lambda: E.AdagradMomentum(learning_rate=LR, momentum=0.9, use_nesterov=True),
    [
      ([0.31, -0.31], {"accumulators": [0.01, 0.04], "momenta": [1, -1]}),
      (
        [0.36335029, -0.39894117],
        {"accumulators": [0.02, 0.20], "momenta": [0.19289322, -0.00557281]},
      ),
    ],
  ),
  "adagrad_momentum_beta2": (
    lambda: E.AdagradMomentum(learning_rate=LR, momentum=0.9, beta2=0.9),
    [
      (
        [0.18377225, -0.18377224],
        {"accumulators": [0.001, 0.004], "momenta": [3.1622775, -3.1622776]},
      ),
      (
        [0.12858300, -0.18488154],
        {"accumulators": [0.0019, 0.0196], "momenta": [0.55189247, 0.01109299]},
      ),
    ],
  ),
  "adam_sum_inside_sqrt": (
    lambda: E.Adam(learning_rate=LR),
    [
      ([0.18377223, -0.18377223], {"momenta": [0.01, -0.02], "velocities": [1e-5, 4e-5]}),
      (
        [0.20613851, -0.33935128],
        {"momenta": [-0.001, 0.022], "velocities": [1.999e-5, 1.9996e-4]},
      ),
    ],
  ),
  "adam_eps_outside": (
    lambda: E.Adam(learning_rate=LR, sum_inside_sqrt=False),
    [
      ([0.18378223, -0.18377723], {"momenta": [0.01, -0.02], "velocities": [1e-5, 4e-5]}),
      (
        [0.20614801, -0.33935518],
        {"momenta": [-0.001, 0.022], "velocities": [1.999e-5, 1.9996e-4]},
      ),
    ],
  ),
}
_FTRL_W_PLAIN = ([-0.00688243, -0.02397062], [0.02198508, -0.09700030])
_FTRL_W_REG = ([-0.00150605, -0.00891220], [0.00772746, -0.04637512])
for _reg, _multiply, _w, _lin in [
  (False, False, _FTRL_W_PLAIN, ([0.02282643, 0.08968986], [-0.07615857, 0.53129252])),
  (False, True, _FTRL_W_PLAIN, ([0.00228264, 0.00896899], [-0.00761586, 0.05312925])),
  (True, False, _FTRL_W_REG, ([0.02282643, 0.08968986], [-0.07695146, 0.50515760])),
  (True, True, _FTRL_W_REG, ([0.00228264, 0.00896899], [-0.00769515, 0.05051576])),
]:
  WORKED[f"ftrl_reg{int(_reg)}_multiply{int(_multiply)}"] = (
    lambda reg=_reg, multiply=_multiply: E.FTRL(
      learning_rate=LR,
      l1_regularization_strength=0.01 if reg else 0.0,
      l2_regularization_strength=0.1 if reg else 0.0,
      beta=0.5 if reg else 0.0,
      multiply_linear_by_learning_rate=multiply,
    ),
    [
      (_w[0], {"accumulators": [0.11, 0.14], "linears": _lin[0]}),
      (_w[1], {"accumulators": [0.12, 0.30], "linears": _lin[1]}),
    ],
  )


@pytest.mark.usefixtures("engine_path")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(WORKED))
def test_worked_example_two_steps(name, mode):
  make, expected = WORKED[name]
  check_states(run_one_row(make(), [G1, G2], mode), expected)


@pytest.mark.parametrize("name", sorted(WORKED))
def test_reference_reproduces_worked_example(name):
  make, expected = WORKED[name]
  check_states(reference_one_row(make(), [G1, G2]), expected)


@pytest.mark.usefixtures("engine_path")
@pytest.mark.parametrize("mode", MODES)
def test_gradient_clipping_example(mode):
  ((w, _),) = run_one_row(E.SGD(learning_rate=LR, clipvalue=0.15), [G1], mode)
  assert_close(w, [0.49, -0.485])


@pytest.mark.usefixtures("engine_path")
@pytest.mark.parametrize("mode", MODES)
def test_weight_clipping_example(mode):
  opt = E.SGD(learning_rate=1.0, clip_weight_min=-1.0, clip_weight_max=1.0)
  ((w, _),) = run_one_row(opt, [[-1.0, 1.0]], mode, lr=1.0)
  assert_close(w, [1.0, -1.0])


@pytest.mark.usefixtures("engine_path")
@pytest.mark.parametrize("mode", MODES)
def test_weight_decay_example(mode):
  # SPEC §2.9 (provisional): [0.5, -0.5] -> decay [0.495, -0.495] -> SGD [0.485, -0.475].
  opt = E.SGD(
    learning_rate=LR, weight_decay_factor=0.01, multiply_weight_decay_factor_by_learning_rate=False
  )
  ((w, _),) = run_one_row(opt, [G1], mode)
  assert_close(w, [0.485, -0.475])
  opt = E.SGD(
    learning_rate=LR, weight_decay_factor=0.1, multiply_weight_decay_factor_by_learning_rate=True
  )  # lambda = 0.1 * 0.1
  ((w, _),) = run_one_row(opt, [G1], mode)
  assert_close(w, [0.485, -0.475])


@pytest.mark.usefixtures("engine_path")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lazy", [True, False])
def test_adam_row_absent_in_second_step(mode, lazy):
  """SPEC §2.6: non-lazy Adam moves an untouched row with g = 0; lazy leaves it."""
  opt = E.Adam(learning_rate=LR, lazy_adam=lazy)
  table, slots = make_variables(opt, np.array([W0, [0.3, 0.7]], np.float64))
  step = updater(opt, table, slots, mode)
  step(tf.constant([0], tf.int64), tf.constant([G1], tf.float32))
  step(tf.constant([1], tf.int64), tf.constant([G2], tf.float32))
  if lazy:
    want = ([0.18377223, -0.18377223], [0.01, -0.02], [1e-5, 4e-5])
  else:
    want = ([-0.10097516, 0.10097516], [0.009, -0.018], [9.99e-6, 3.996e-5])
  assert_close(table.numpy()[0], want[0])
  assert_close(slots["momenta"].numpy()[0], want[1])
  assert_close(slots["velocities"].numpy()[0], want[2])


@pytest.mark.usefixtures("engine_path")
@pytest.mark.parametrize("mode", MODES)
def test_duplicates_example(mode):
  """SPEC §2.1: ids [1, 1] and [1] under `mean` give one update with g = [1, 1]."""
  bags = [([1, 1], None), ([1], None)]
  rows, grads = reference.assemble_gradients(bags, [[1.0, 0.0], [0.0, 1.0]], "mean")
  np.testing.assert_array_equal(rows, [1])
  assert_close(grads, [[1.0, 1.0]])
  for opt, want in [
    (E.SGD(learning_rate=0.1), [1.9, 2.9]),
    (E.Adagrad(learning_rate=0.1), [1.9046537, 2.9046537]),
  ]:
    table, slots = make_variables(opt, np.array([[0, 0], [2, 3]], np.float64))
    updater(opt, table, slots, mode)(tf.constant(rows), tf.constant(grads, tf.float32))
    assert_close(table.numpy()[1], want)
    np.testing.assert_array_equal(table.numpy()[0], [0, 0])


@pytest.mark.parametrize("mode", MODES)
def test_adagrad_momentum_zero_gradient_touch(mode):
  """SPEC §2.5: a touched row with g = 0 keeps A (beta2 = 1), decays M and still moves."""
  opt = E.AdagradMomentum(learning_rate=LR, momentum=0.9)
  states = run_one_row(opt, [G1, [0.0, 0.0]], mode)
  w1, s1 = states[0]
  w2, s2 = states[1]
  assert_close(s2["accumulators"], s1["accumulators"])
  assert_close(s2["momenta"], 0.9 * s1["momenta"])
  assert_close(w2, w1 - LR * 0.9 * s1["momenta"])


@pytest.mark.parametrize("mode", MODES)
def test_ftrl_first_touch_with_zero_gradient_zeroes_row(mode):
  """SPEC §2.7 edge case: W is recomputed from the slots, so the initial value is lost."""
  ((w, slots),) = run_one_row(E.FTRL(learning_rate=LR), [[0.0, 0.0]], mode)
  np.testing.assert_array_equal(w, [0.0, 0.0])
  np.testing.assert_array_equal(slots["linears"], [0.0, 0.0])


# ------------------------------------------------------------------ reference: combiners


@pytest.mark.parametrize(
  "combiner,a0,grad1,grad3",
  [
    ("sum", [7.0, 9.5], [2.5, -1.5], [0.5, -0.5]),
    ("mean", [2.8, 3.8], [1.3, -0.3], [0.2, -0.2]),
    ("sqrtn", [3.3954988, 4.6081772], [1.4701426, -0.4701425], [0.2425356, -0.2425356]),
  ],
)
def test_reference_combiner_example(combiner, a0, grad1, grad3):
  """SPEC §3.2 worked example."""
  table = np.zeros([5, 2])
  table[1], table[3], table[4] = [2, 3], [6, 7], [8, 9]
  bags = [([1, 3], [2.0, 0.5]), ([1], [1.0])]
  assert_close(reference.combine_bag(table, *bags[0], combiner), a0)
  assert_close(reference.combine_bag(table, *bags[1], combiner), [2, 3])
  rows, grads = reference.assemble_gradients(bags, [[1, -1], [0.5, 0.5]], combiner)
  np.testing.assert_array_equal(rows, [1, 3])
  assert_close(grads[0], grad1)
  assert_close(grads[1], grad3)


def test_reference_empty_bag_and_zero_weight_sum():
  """SPEC §3.3: empty bag -> 0, no gradient; zero weight sum -> 0, touched with g = 0."""
  table = np.arange(8.0).reshape(4, 2)
  assert_close(reference.combine_bag(table, [], None, "mean"), [0, 0])
  assert_close(reference.combine_bag(table, [1, 2], [1.0, -1.0], "mean"), [0, 0])
  assert_close(reference.combine_bag(table, [1], [0.0], "sqrtn"), [0, 0])
  rows, grads = reference.assemble_gradients(
    [([], None), ([1, 2], [1.0, -1.0])], [[5, 5], [1, 1]], "mean"
  )
  np.testing.assert_array_equal(rows, [1, 2])
  np.testing.assert_array_equal(grads, np.zeros([2, 2]))


# ------------------------------------------------------------------ engine structure


def test_unknown_optimizer_is_rejected_and_subclasses_are_found():
  with pytest.raises(TypeError, match="No CPU update rule"):
    updates.rule_for(object())

  class MySGD(E.SGD):
    pass

  assert isinstance(updates.rule_for(MySGD(learning_rate=0.1)), updates.SGDRule)


@pytest.mark.parametrize(
  "make",
  [
    lambda: E.SGD(learning_rate=0.1, clipvalue=1.0, weight_decay_factor=0.1),
    lambda: E.Adagrad(learning_rate=0.1, clip_weight_min=-1.0),
    lambda: E.AdagradMomentum(learning_rate=0.1, momentum=0.5),
    lambda: E.Adam(learning_rate=0.1),
    lambda: E.FTRL(learning_rate=0.1, beta=0.1),
  ],
  ids=["sgd", "adagrad", "adagrad_momentum", "adam", "ftrl"],
)
def test_lazy_update_builds_no_table_sized_tensor(make):
  """The cost must follow the touched rows: no op may output a [V, ...] tensor."""
  vocab, dim = 9973, 3
  opt = make()
  rule, state = rule_and_state(opt, *make_variables(opt, np.zeros([vocab, dim])))
  fn = tf.function(
    lambda ids, g: updates.apply_sparse_update(rule, state, ids, g, tf.constant(0.1))
  )
  graph = fn.get_concrete_function(
    tf.TensorSpec([None], tf.int32), tf.TensorSpec([None, dim], tf.float32)
  ).graph
  for op in graph.get_operations():
    for out in op.outputs:
      if out.dtype != tf.resource and out.shape.rank:
        assert out.shape[0] != vocab, f"{op.type} {op.name} outputs {out.shape}"


# ------------------------------------------------------------------ custom optimizer


def _custom_momentum(grads, rows, slot_rows, learning_rate, hyperparameters):
  """Momentum SGD scaled by 1/sqrt(touch count); `counts` is a 1-D slot."""
  momenta, counts = slot_rows
  momenta = hyperparameters[0] * momenta + grads
  counts = counts + 1.0
  rows = rows - learning_rate * momenta / tf.expand_dims(tf.sqrt(counts), -1)
  return rows, momenta, counts


# TF 2.17 has no mid-level CustomOptimizer, and 2.18's has no `slot_dims` (every slot is shaped as
# the table), which the rank-1 `counts` slot below needs.
CUSTOM = (
  ["custom"]
  if tf_internals.CUSTOM_OPTIMIZER is not None
  and "slot_dims" in inspect.signature(tf_internals.CUSTOM_OPTIMIZER).parameters
  else []
)
needs_custom_optimizer = pytest.mark.skipif(
  not CUSTOM, reason="this TF has no CustomOptimizer with slot_dims"
)


def _custom_optimizer(lr: float, mu: float):
  return E.CustomOptimizer(
    _custom_momentum,
    learning_rate=lr,
    slot_names=["momenta", "counts"],
    slot_initializers=[tf.zeros_initializer(), tf.zeros_initializer()],
    hyperparameters=[lambda: mu],
    slot_dims=[2, 1],
  )


def _custom_variables(table: np.ndarray):
  vocab, dim = table.shape
  return (
    tf.Variable(table, dtype=tf.float32),
    {"momenta": tf.Variable(tf.zeros([vocab, dim])), "counts": tf.Variable(tf.zeros([vocab]))},
  )


@needs_custom_optimizer
@pytest.mark.parametrize("mode", MODES)
def test_custom_optimizer_single_table_row_result(mode):
  opt = E.CustomOptimizer(
    lambda g, w, s, lr, h: w - lr * h[0] * g, learning_rate=0.5, hyperparameters=[2.0]
  )
  table = tf.Variable([[1.0, 1.0], [2.0, 2.0]])
  step = updater(opt, table, {}, mode, lr=0.5)
  step(tf.constant([1]), tf.constant([[1.0, -1.0]]))
  np.testing.assert_allclose(table.numpy(), [[1, 1], [1, 3]])


# ------------------------------------------------------------------ property test vs reference

_LR = st.sampled_from([0.01, 0.05, 0.1, 0.5, 1.0])
_POSITIVE = st.floats(0.01, 1.0)


@st.composite
def _common(draw) -> Dict:
  clip = draw(
    st.one_of(
      st.none(),
      _POSITIVE,
      st.tuples(
        st.one_of(st.none(), st.floats(-1.0, 0.0)), st.one_of(st.none(), st.floats(0.0, 1.0))
      ),
    )
  )
  decay = draw(st.one_of(st.none(), st.just(0.0), st.floats(0.001, 0.3)))
  return dict(
    learning_rate=draw(_LR),
    clipvalue=clip,
    clip_weight_min=draw(st.one_of(st.none(), st.floats(-2.0, -0.05))),
    clip_weight_max=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
    weight_decay_factor=decay,
    multiply_weight_decay_factor_by_learning_rate=draw(st.booleans()) if decay else None,
  )


@st.composite
def optimizers(draw):
  kind = draw(st.sampled_from(["sgd", "adagrad", "adagrad_momentum", "adam", "ftrl"] + CUSTOM))
  if kind == "custom":
    return _custom_optimizer(draw(_LR), draw(st.floats(0.0, 0.95)))
  kwargs = draw(_common())
  if kind == "sgd":
    return E.SGD(**kwargs)
  if kind == "adagrad":
    return E.Adagrad(initial_accumulator_value=draw(_POSITIVE), **kwargs)
  if kind == "adagrad_momentum":
    return E.AdagradMomentum(
      momentum=draw(st.floats(0.0, 0.95)),
      use_nesterov=draw(st.booleans()),
      exponent=draw(st.sampled_from([2, 1.5, 3.0, 4])),
      beta2=draw(st.sampled_from([1, 0.99, 0.9, 0.5])),
      epsilon=draw(st.sampled_from([1e-10, 1e-6, 1e-3])),
      **kwargs,
    )
  if kind == "adam":
    return E.Adam(
      beta_1=draw(st.floats(0.0, 0.95)),
      beta_2=draw(st.sampled_from([0.0, 0.5, 0.9, 0.999])),
      epsilon=draw(st.sampled_from([1e-7, 1e-4, 1e-2])),
      lazy_adam=draw(st.booleans()),
      sum_inside_sqrt=draw(st.booleans()),
      **kwargs,
    )
  return E.FTRL(
    learning_rate_power=draw(st.sampled_from([-0.5, -0.25, -1.0, 0.0])),
    l1_regularization_strength=draw(st.sampled_from([0.0, 0.01, 0.3])),
    l2_regularization_strength=draw(st.sampled_from([0.0, 0.1, 1.0])),
    beta=draw(st.sampled_from([0.0, 0.5, 1.0])),
    initial_accumulator_value=draw(_POSITIVE),
    multiply_linear_by_learning_rate=draw(st.booleans()),
    **kwargs,
  )


@st.composite
def problems(draw):
  vocab = draw(st.integers(1, 12))
  dim = draw(st.integers(1, 4))
  table = (
    np.array(
      draw(st.lists(st.integers(-16, 16), min_size=vocab * dim, max_size=vocab * dim)), np.float64
    ).reshape(vocab, dim)
    / 16
  )
  steps = []
  for _ in range(draw(st.integers(2, 3))):
    ids = draw(st.lists(st.integers(0, vocab - 1), unique=True, max_size=vocab))
    grads = (
      np.array(
        draw(st.lists(st.integers(-40, 40), min_size=len(ids) * dim, max_size=len(ids) * dim)),
        np.float64,
      )
      / 16
    )
    steps.append((np.array(ids, np.int64), grads.reshape(len(ids), dim)))
  return table, steps


@pytest.mark.usefixtures("engine_path")  # the same for every example: only sets the path
@hypothesis.settings(
  max_examples=60,
  deadline=None,
  suppress_health_check=[
    hypothesis.HealthCheck.too_slow,
    hypothesis.HealthCheck.function_scoped_fixture,
  ],
)
@hypothesis.given(
  optimizer=optimizers(),
  problem=problems(),
  mode=st.sampled_from(MODES),
  id_dtype=st.sampled_from([tf.int32, tf.int64]),
)
def test_matches_reference(optimizer, problem, mode, id_dtype):
  table0, steps = problem
  params = reference.params_from_optimizer(optimizer)
  lr = params["learning_rate"]
  if params["kind"] == "custom":
    table, slots = _custom_variables(table0)
  else:
    table, slots = make_variables(optimizer, table0)
  ref_table = table0
  ref_slots = {k: v.numpy().astype(np.float64) for k, v in slots.items()}
  every_row = params["kind"] == "adam" and not params["lazy_adam"]
  step = updater(optimizer, table, slots, mode, lr)
  for ids, grads in steps:
    before = [table.numpy()] + [v.numpy() for v in slots.values()]
    step(tf.constant(ids, id_dtype), tf.constant(grads, tf.float32))
    ref_table, ref_slots = reference.apply_step(ref_table, ref_slots, ids, grads, lr, params)
    np.testing.assert_allclose(table.numpy(), ref_table, rtol=1e-4, atol=1e-5)
    for name, var in slots.items():
      np.testing.assert_allclose(var.numpy(), ref_slots[name], rtol=1e-4, atol=1e-5, err_msg=name)
    if not every_row:
      untouched = np.setdiff1d(np.arange(table0.shape[0]), ids)
      after = [table.numpy()] + [v.numpy() for v in slots.values()]
      for old, new in zip(before, after):
        np.testing.assert_array_equal(new[untouched], old[untouched])
    # Keep float32 drift out of the next step's comparison: continue from the engine's state.
    ref_table = table.numpy().astype(np.float64)
    ref_slots = {k: v.numpy().astype(np.float64) for k, v in slots.items()}


@pytest.mark.parametrize(
  "make_optimizer,locked_op",
  [
    (lambda: E.SGD(learning_rate=0.25), "ResourceScatterSub"),
    (lambda: E.Adagrad(learning_rate=0.25), "ResourceSparseApplyAdagradV2"),
    (lambda: E.Adagrad(learning_rate=0.25, clipvalue=0.5), None),  # no locked kernel clips
  ],
)
def test_atomic_updates_use_tfs_locked_kernels_with_the_same_result(
  make_optimizer, locked_op, monkeypatch
):
  """What parameter-server workers get when the compiled kernel may not run on the ps."""
  monkeypatch.setenv("TPU_EMBEDDING_NATIVE_KERNELS", "0")
  optimizer = make_optimizer()
  table0 = np.arange(12, dtype=np.float64).reshape(6, 2) / 8
  ids, grads = tf.constant([4, 1, 3]), tf.constant([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]])
  results = []
  for atomic in (True, False):
    table, slots = make_variables(optimizer, table0)

    rule, state = rule_and_state(optimizer, table, slots)
    step = tf.function(
      functools.partial(
        updates.apply_sparse_update, rule, state, ids, grads, tf.constant(0.25), atomic=atomic
      )
    )

    step()
    results.append([table.numpy()] + [v.numpy() for v in slots.values()])
    if atomic:
      op_types = {op.type for op in step.get_concrete_function().graph.get_operations()}
      assert (locked_op in op_types) if locked_op else "ResourceScatterUpdate" in op_types
  for locked, unlocked in zip(*results):
    np.testing.assert_allclose(locked, unlocked, rtol=1e-6)
  params = reference.params_from_optimizer(optimizer)
  want, _ = reference.apply_step(
    table0,
    reference.initial_slots(params, table0.shape),
    ids.numpy(),
    grads.numpy().astype(np.float64),
    0.25,
    params,
  )
  np.testing.assert_allclose(results[0][0], want, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ each rule's forms


@pytest.mark.parametrize(
  "make_optimizer",
  [lambda: E.SGD(learning_rate=0.25), lambda: E.Adagrad(learning_rate=0.25)],
  ids=["sgd", "adagrad"],
)
def test_locked_form_computes_the_reference_step(make_optimizer):
  optimizer = make_optimizer()
  table0 = np.arange(12, dtype=np.float64).reshape(6, 2) / 8
  ids, grads = np.array([4, 1, 3]), np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]])
  rule, state = rule_and_state(optimizer, *make_variables(optimizer, table0))
  rule.locked_form()(state, tf.constant(ids), tf.constant(grads, tf.float32), tf.constant(0.25))
  params = reference.params_from_optimizer(optimizer)
  want_table, want_slots = reference.apply_step(
    table0, reference.initial_slots(params, table0.shape), ids, grads, 0.25, params
  )
  np.testing.assert_allclose(state.parameters.numpy(), want_table, rtol=1e-6, atol=1e-7)
  for name, slot in zip(rule.slot_names, state.slots):
    np.testing.assert_allclose(slot.numpy(), want_slots[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize(
  "optimizer",
  [
    E.SGD(learning_rate=0.1, clipvalue=1.0),
    E.SGD(learning_rate=0.1, weight_decay_factor=0.1),
    E.Adagrad(learning_rate=0.1, clip_weight_max=1.0),
    E.AdagradMomentum(learning_rate=0.1, momentum=0.5),
    E.Adam(learning_rate=0.1),
    E.FTRL(learning_rate=0.1),
  ],
  ids=["sgd_clipped", "sgd_decayed", "adagrad_weights_clipped", "adagrad_momentum", "adam", "ftrl"],
)
def test_no_locked_form_where_tfs_kernels_do_not_compute_the_spec(optimizer):
  assert updates.rule_for(optimizer).locked_form() is None


@pytest.mark.parametrize(
  "optimizer,alone,summed",
  [
    (E.SGD(learning_rate=0.1), "UNIQUE_ROWS", "WHOLE_TABLE"),
    (E.Adagrad(learning_rate=0.1), "UNIQUE_ROWS", "WHOLE_TABLE"),
    (E.Adam(learning_rate=0.1, lazy_adam=True), "UNIQUE_ROWS", "WHOLE_TABLE"),
    (E.Adam(learning_rate=0.1, lazy_adam=False), "WHOLE_TABLE", "WHOLE_TABLE"),
    (E.FTRL(learning_rate=0.1), "UNIQUE_ROWS", "WHOLE_TABLE"),
  ],
  ids=["sgd", "adagrad", "lazy_adam", "adam", "ftrl"],
)
def test_xla_form_is_the_whole_table_where_replicas_sum_or_every_row_changes(
  optimizer, alone, summed
):
  rule = updates.rule_for(optimizer)
  assert rule.xla_form(summed=False) is updates.XlaForm[alone]
  assert rule.xla_form(summed=True) is updates.XlaForm[summed]


def test_rules_of_equal_optimizers_are_equal_so_their_traces_are_shared():
  rule = updates.rule_for(E.Adam(learning_rate=0.1, lazy_adam=False))
  assert rule == updates.rule_for(E.Adam(learning_rate=0.1, lazy_adam=False))
  assert hash(rule) == hash(updates.rule_for(E.Adam(learning_rate=0.1, lazy_adam=False)))
  assert rule != updates.rule_for(E.Adam(learning_rate=0.2, lazy_adam=False))
  assert updates.rule_for(E.SGD(learning_rate=0.1)) != updates.rule_for(E.Adagrad(0.1))
