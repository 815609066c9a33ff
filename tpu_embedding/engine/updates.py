"""The CPU engine's optimizer step on the rows of one table touched in a step.

`apply_sparse_update` reproduces what the TPU embedding engine does to a table
once the step's gradient has been assembled per unique row (SPEC §2.1), in the
order of SPEC §2.2:

    clip gradient -> weight decay (provisional) -> optimizer rule -> clip weights

The shared steps are written once here; the maths of each optimizer lives in
one `UpdateRule` subclass that names the mid-level optimizer class it serves
and the forms that compute it (compiled kernel, locked TF kernel, XLA
formulation). Adding an optimizer means adding one class.

How rows move (chosen from `benchmarks/update_kernels.py`, see its table):
on a CPU of this process, SGD, Adagrad and lazy Adam run as one compiled
kernel per table (`native.apply_rows`, cc/apply_rows.cc) that reads and
writes each touched row of the table and slots once, in place. Elsewhere
(GPU, parameter servers, the other optimizers, no compiler at install),
touched rows of the table and its slots are gathered (the table's rows are
taken from the lookup when it has just read them), the rule runs on those
`[U, D]` tensors and the results are written back with `ResourceScatterUpdate`.
Both paths compute the same float32 operations in the same order. No dense
`[V, D]` tensor is built, so the cost follows the number of touched rows, not
the vocabulary. TF's fused `ResourceSparseApply*` kernels were measured slower
on CPU and are not used. The one exception to the sparse path is non-lazy
Adam, which by definition updates every row every step (SPEC §2.6); its dense
pass is XLA-compiled so it streams each variable once.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Callable, ClassVar, Dict, Optional, Sequence, Tuple, Type

import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.engine import native
from tpu_embedding.engine.state import TableState
from tpu_embedding.optimizer_specs import (
  gradient_limits,
  has_weight_decay,
  slot_names,
  weight_limits,
)

Rows = Tuple[tf.Tensor, Tuple[tf.Tensor, ...]]
"""A table block and the matching blocks of its slots, in `slot_names` order."""

_embedding = tf.tpu.experimental.embedding


# --------------------------------------------------------------------------
# Shared steps (SPEC §2.2, §2.9): written once for every optimizer.
# --------------------------------------------------------------------------


def _clip(x: tf.Tensor, low: Optional[float], high: Optional[float]) -> tf.Tensor:
  """Elementwise clip where `None` means no limit on that side.

  Applied as `min(max(x, low), high)` (NumPy's `clip`), so an inverted pair
  yields `high` everywhere.
  """
  if low is not None:
    x = tf.maximum(x, tf.cast(low, x.dtype))
  if high is not None:
    x = tf.minimum(x, tf.cast(high, x.dtype))
  return x


def clip_gradient(optimizer, grads: tf.Tensor) -> tf.Tensor:
  """SPEC §2.2 step 1: clip the accumulated per-row gradient (`clipvalue`)."""
  return _clip(grads, *gradient_limits(optimizer))


def clip_weights(optimizer, rows: tf.Tensor) -> tf.Tensor:
  """SPEC §2.2 last step: clamp the stored table rows; slots are never clipped."""
  return _clip(rows, *weight_limits(optimizer))


def _without_extras(optimizer) -> bool:
  """No gradient clipping, weight decay or weight clipping: what TF's locked kernels lack."""
  limits = gradient_limits(optimizer) + weight_limits(optimizer)
  return not has_weight_decay(optimizer) and all(limit is None for limit in limits)


def decay_weights(optimizer, rows: tf.Tensor, learning_rate: tf.Tensor) -> tf.Tensor:
  """SPEC §2.9 weight decay -- PROVISIONAL.

  The hardware's weight decay is not established (SPEC §2.9 [U]). This applies
  the spec's recommended rule: a decoupled `W <- W - lambda * W` on the touched
  rows only, just before the optimizer rule, with `lambda = factor * lr` when
  `multiply_weight_decay_factor_by_learning_rate` is set, else `factor`.
  Revisit when the TPU behaviour is known.
  """
  if not has_weight_decay(optimizer):
    return rows
  factor = tf.cast(optimizer.weight_decay_factor, rows.dtype)
  if getattr(optimizer, "multiply_weight_decay_factor_by_learning_rate", None):
    factor = factor * learning_rate
  return rows - factor * rows


def _const(value: float, dtype: tf.DType) -> tf.Tensor:
  """A hyperparameter (or 1 - it, computed in float64 first) as a `dtype` scalar.

  Rounding `1 - beta` once from float64 keeps e.g. `1 - 0.999` at 1e-3 instead of
  the 1.3e-5-relative error of subtracting two float32 values.
  """
  return tf.constant(value, dtype)


def _gather(variable: tf.Variable, row_ids: tf.Tensor) -> tf.Tensor:
  return variable.sparse_read(row_ids)


def _scatter(variable: tf.Variable, row_ids: tf.Tensor, rows: tf.Tensor) -> None:
  # Plain overwrite: row ids are unique, and ResourceScatterUpdate runs at
  # gather speed where ResourceScatterAdd/Sub are several times slower here.
  tf.raw_ops.ResourceScatterUpdate(resource=variable.handle, indices=row_ids, updates=rows)


# --------------------------------------------------------------------------
# Optimizer rules: one class per mid-level optimizer.
# --------------------------------------------------------------------------


LockedForm = Callable[[TableState, tf.Tensor, tf.Tensor, tf.Tensor], None]
"""`form(state, row_ids, grads, learning_rate)`: one locked TF kernel applying a rule."""


class XlaForm(enum.Enum):
  """How the static-shape path (`static_path`) formulates a table's update for XLA."""

  WHOLE_TABLE = "whole table"
  UNIQUE_ROWS = "unique rows"


@dataclasses.dataclass(frozen=True)
class UpdateRule(abc.ABC):
  """The maths of one optimizer applied to gathered rows, and which forms can compute it.

  Subclasses set `optimizer_class` (the `tf.tpu.experimental.embedding` class
  they implement) and `compute`; gathering, scattering, clipping and decay
  are shared and live outside the rules. Rules of equal optimizers are equal,
  so functions traced for one serve the other.
  """

  optimizer: Any
  optimizer_class: ClassVar[type]
  _registry: ClassVar[Dict[type, Type["UpdateRule"]]] = {}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.__dict__.get("optimizer_class") is not None:  # None: not in this TF
      UpdateRule._registry[cls.optimizer_class] = cls

  @property
  def slot_names(self) -> Tuple[str, ...]:
    """The optimizer's slots, in the order `compute` and every form take them."""
    return slot_names(self.optimizer)

  @property
  def updates_every_row(self) -> bool:
    """True when untouched rows also change every step (non-lazy Adam)."""
    return False

  def native_form(self) -> Optional[Tuple[str, Tuple[float, ...]]]:
    """(rule, hyperparameters) of the compiled kernel that computes `compute`, if one does."""
    return None

  def locked_form(self) -> Optional[LockedForm]:
    """One TF kernel that holds the variables' locks for the whole update and computes the
    spec's maths exactly, if one does (none clips or decays)."""
    return None

  def xla_form(self, summed: bool) -> XlaForm:
    """The formulation of the update under XLA (see `static_path`): the whole table when
    replicas sum their contributions (`summed`, which needs a fixed shape) or the rule rewrites
    every row; else unique rows, whose cost does not grow with the table (`static_path.update_for`
    still takes the whole table where it is small)."""
    if summed or self.updates_every_row:
      return XlaForm.WHOLE_TABLE
    return XlaForm.UNIQUE_ROWS

  @abc.abstractmethod
  def compute(
    self,
    table_rows: tf.Tensor,
    slot_rows: Tuple[tf.Tensor, ...],
    grads: tf.Tensor,
    learning_rate: tf.Tensor,
  ) -> Rows:
    """New (table rows, slot rows) from the old ones and the (clipped) gradient.

    Pure elementwise maths: `grads` may be a scalar 0 broadcast over all rows.
    """


def rule_for(optimizer) -> UpdateRule:
  """The update rule for a mid-level optimizer object (subclasses included)."""
  for klass in type(optimizer).__mro__:
    rule = UpdateRule._registry.get(klass)
    if rule is not None:
      return rule(optimizer)
  raise TypeError(
    f"No CPU update rule for optimizer {type(optimizer).__name__}; expected "
    "one of " + ", ".join(k.__name__ for k in UpdateRule._registry)
  )


class SGDRule(UpdateRule):
  """SPEC §2.3: `W <- W - lr * g`; no slots."""

  optimizer_class = _embedding.SGD

  def native_form(self):
    return "sgd", ()

  def locked_form(self):
    return self._scatter_sub if _without_extras(self.optimizer) else None

  @staticmethod
  def _scatter_sub(state, row_ids, grads, learning_rate):
    tf.raw_ops.ResourceScatterSub(
      resource=state.parameters.handle, indices=row_ids, updates=learning_rate * grads
    )

  def compute(self, table_rows, slot_rows, grads, learning_rate):
    return table_rows - learning_rate * grads, ()


class AdagradRule(UpdateRule):
  """SPEC §2.4: `A <- A + g^2; W <- W - lr * g / sqrt(A)` with no epsilon."""

  optimizer_class = _embedding.Adagrad

  def native_form(self):
    return "adagrad", ()

  def locked_form(self):
    return self._sparse_apply_adagrad if _without_extras(self.optimizer) else None

  @staticmethod
  def _sparse_apply_adagrad(state, row_ids, grads, learning_rate):
    # A += g^2; W -= lr * g / (sqrt(A) + 0): the spec's Adagrad, which has no epsilon.
    (accumulators,) = state.slots
    tf.raw_ops.ResourceSparseApplyAdagradV2(
      var=state.parameters.handle,
      accum=accumulators.handle,
      lr=learning_rate,
      epsilon=tf.zeros([], state.parameters.dtype),
      grad=grads,
      indices=row_ids,
      use_locking=True,
    )

  def compute(self, table_rows, slot_rows, grads, learning_rate):
    (accumulators,) = slot_rows
    accumulators = accumulators + grads * grads
    return table_rows - learning_rate * grads / tf.sqrt(accumulators), (accumulators,)


class AdagradMomentumRule(UpdateRule):
  """SPEC §2.5, the SparseCore form with the gradient inside the momentum.

  `A` accumulates g^2 (or its beta2 moving average), `g_hat = (A+eps)^(-1/exponent) g`,
  `M <- mu M + g_hat`, and W moves by `lr * M` (or `lr * (mu M + g_hat)` with Nesterov).
  """

  optimizer_class = _embedding.AdagradMomentum

  def compute(self, table_rows, slot_rows, grads, learning_rate):
    opt = self.optimizer
    accumulators, momenta = slot_rows
    dtype = table_rows.dtype
    if opt.beta2 == 1:
      accumulators = accumulators + grads * grads
    else:
      accumulators = _const(opt.beta2, dtype) * accumulators + _const(1 - opt.beta2, dtype) * (
        grads * grads
      )
    shifted = accumulators + tf.constant(opt.epsilon, dtype)
    if opt.exponent == 2:
      scaled = grads * tf.math.rsqrt(shifted)
    else:
      scaled = grads * tf.pow(shifted, tf.constant(-1.0 / opt.exponent, dtype))
    momentum = tf.constant(opt.momentum, dtype)
    momenta = momentum * momenta + scaled
    step = momentum * momenta + scaled if opt.use_nesterov else momenta
    return table_rows - learning_rate * step, (accumulators, momenta)


class AdamRule(UpdateRule):
  """SPEC §2.6: Adam without bias correction; epsilon inside or outside the sqrt.

  `lazy_adam=False` updates every row each step, untouched ones with g = 0.
  """

  optimizer_class = _embedding.Adam

  @property
  def updates_every_row(self) -> bool:
    return not self.optimizer.lazy_adam

  def native_form(self):
    if self.updates_every_row:
      return None
    opt = self.optimizer
    return "adam", (
      opt.beta_1,
      1 - opt.beta_1,
      opt.beta_2,
      1 - opt.beta_2,
      self._epsilon_term,
      float(opt.sum_inside_sqrt),
    )

  @property
  def _epsilon_term(self) -> float:
    """What is added to the velocity inside the sqrt, or to its sqrt outside."""
    opt = self.optimizer
    return opt.epsilon**2 if opt.sum_inside_sqrt else opt.epsilon

  def compute(self, table_rows, slot_rows, grads, learning_rate):
    opt = self.optimizer
    momenta, velocities = slot_rows
    dtype = table_rows.dtype
    momenta = _const(opt.beta_1, dtype) * momenta + _const(1 - opt.beta_1, dtype) * grads
    velocities = _const(opt.beta_2, dtype) * velocities + _const(1 - opt.beta_2, dtype) * (
      grads * grads
    )
    epsilon = tf.constant(self._epsilon_term, dtype)
    if opt.sum_inside_sqrt:
      denominator = tf.sqrt(velocities + epsilon)
    else:
      denominator = tf.sqrt(velocities) + epsilon
    return (table_rows - learning_rate * momenta / denominator, (momenta, velocities))


class FTRLRule(UpdateRule):
  """SPEC §2.7: FTRL-proximal with beta; W is recomputed from the slots on every touch.

  With `multiply_linear_by_learning_rate` the `linears` slot stores lr * L.
  """

  optimizer_class = _embedding.FTRL

  def _power(self, accumulators: tf.Tensor) -> tf.Tensor:
    """A^(-learning_rate_power), i.e. sqrt(A) for the default -0.5."""
    power = self.optimizer.learning_rate_power
    if power == -0.5:
      return tf.sqrt(accumulators)
    return tf.pow(accumulators, tf.constant(-power, accumulators.dtype))

  def compute(self, table_rows, slot_rows, grads, learning_rate):
    opt = self.optimizer
    accumulators, linears = slot_rows
    dtype = table_rows.dtype
    l1 = tf.constant(opt.l1_regularization_strength, dtype)
    l2 = tf.constant(opt.l2_regularization_strength, dtype)
    beta = tf.constant(opt.beta, dtype)
    new_accumulators = accumulators + grads * grads
    new_power = self._power(new_accumulators)
    delta = new_power - self._power(accumulators)
    if opt.multiply_linear_by_learning_rate:
      linears = linears + learning_rate * grads - delta * table_rows
      limit = learning_rate * l1
      quadratic = new_power + 2 * learning_rate * l2 + beta
    else:
      linears = linears + grads - delta / learning_rate * table_rows
      limit = l1
      quadratic = (new_power + beta) / learning_rate + 2 * l2
    table_rows = (tf.clip_by_value(linears, -limit, limit) - linears) / quadratic
    return table_rows, (new_accumulators, linears)


class CustomOptimizerRule(UpdateRule):
  """SPEC §2.8: the user's per-row computation, vectorised over touched rows.

  Called as `custom_computation(grads [U, D], table rows [U, D], [slot rows],
  learning_rate, [hyperparameters])`; slot rows are `[U, D]` or `[U]`
  (slot_dims 1). It returns the new table rows or `(table rows, *slot rows)`.
  """

  optimizer_class = tf_internals.CUSTOM_OPTIMIZER  # None on TF 2.17

  def compute(self, table_rows, slot_rows, grads, learning_rate):
    opt = self.optimizer
    hyperparameters = [
      tf.cast(h() if callable(h) else h, table_rows.dtype) for h in opt.hyperparameters
    ]
    result = opt.custom_computation(
      grads, table_rows, list(slot_rows), learning_rate, hyperparameters
    )
    if not isinstance(result, (tuple, list)):
      return result, slot_rows
    new_table_rows, *new_slot_rows = result
    if new_slot_rows and len(new_slot_rows) != len(slot_rows):
      raise ValueError(
        f"custom_computation returned {len(new_slot_rows)} slot values for "
        f"{len(slot_rows)} slots {slot_names(opt)}."
      )
    return new_table_rows, tuple(new_slot_rows) if new_slot_rows else slot_rows


# --------------------------------------------------------------------------
# Moving rows: gather -> shared steps + rule -> scatter.
# --------------------------------------------------------------------------


def update_rows(
  rule: UpdateRule,
  table_rows: tf.Tensor,
  slot_rows: Tuple[tf.Tensor, ...],
  grads: tf.Tensor,
  learning_rate: tf.Tensor,
) -> Rows:
  """Decay -> optimizer rule -> weight clipping on one block of rows."""
  table_rows = decay_weights(rule.optimizer, table_rows, learning_rate)
  table_rows, slot_rows = rule.compute(table_rows, slot_rows, grads, learning_rate)
  return clip_weights(rule.optimizer, table_rows), tuple(slot_rows)


def scatter_rows(
  table: tf.Variable, slots: Sequence[tf.Variable], row_ids: tf.Tensor, rows: Rows
) -> None:
  """Writes a block of table rows and slot rows back at `row_ids`."""
  table_rows, slot_rows = rows
  _scatter(table, row_ids, tf.cast(table_rows, table.dtype))
  for variable, values in zip(slots, slot_rows):
    _scatter(variable, row_ids, tf.cast(values, variable.dtype))


def gather_rows(
  table: tf.Variable,
  slots: Sequence[tf.Variable],
  row_ids: tf.Tensor,
  table_rows: Optional[tf.Tensor] = None,
) -> Rows:
  """Reads the rows `row_ids` of the table (unless given) and of each slot."""
  if table_rows is None:
    table_rows = _gather(table, row_ids)
  return table_rows, tuple(_gather(s, row_ids) for s in slots)


def _apply_every_row(
  rule: UpdateRule,
  state: TableState,
  row_ids: tf.Tensor,
  grads: tf.Tensor,
  learning_rate: tf.Tensor,
  table_rows: Optional[tf.Tensor],
) -> None:
  """Non-lazy step: touched rows with their gradient, all others with g = 0.

  The touched rows are read before the dense pass and written after it, so
  no dense gradient is built. Weight decay stays on touched rows only (the
  provisional §2.9 rule); weight clipping covers every row, as all are updated.
  """
  table, slots = state.parameters, state.slots
  touched = update_rows(rule, *gather_rows(table, slots, row_ids, table_rows), grads, learning_rate)
  _zero_gradient_pass(rule, table, slots, learning_rate)
  scatter_rows(table, slots, row_ids, touched)


def _zero_gradient_values(
  rule: UpdateRule, table: tf.Variable, slots: Tuple[tf.Variable, ...], learning_rate: tf.Tensor
) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
  """Every row's (table, slots) after an update with g = 0 and weight clipping: what
  `_zero_gradient_pass` writes and `zero_gradient_step_is_finite` checks, computed one way."""
  zero = tf.zeros([], table.dtype)
  new_table, new_slots = rule.compute(
    table.read_value(), tuple(s.read_value() for s in slots), zero, learning_rate
  )
  return clip_weights(rule.optimizer, new_table), tuple(new_slots)


@tf.function(jit_compile=True)
def _zero_gradient_pass(
  rule: UpdateRule, table: tf.Variable, slots: Tuple[tf.Variable, ...], learning_rate: tf.Tensor
) -> None:
  """Every row's update with g = 0, then weight clipping, in place.

  XLA fuses the whole pass into one sweep over table and slots (about 4x
  faster than separate TF ops, which each stream [V, D] through memory).
  """
  new_table, new_slots = _zero_gradient_values(rule, table, slots, learning_rate)
  table.assign(new_table)
  for variable, values in zip(slots, new_slots):
    variable.assign(values)


@tf.function(jit_compile=True)
def zero_gradient_step_is_finite(
  rule: UpdateRule, table: tf.Variable, slots: Tuple[tf.Variable, ...], learning_rate: tf.Tensor
) -> tf.Tensor:
  """Whether `_zero_gradient_pass` would write only finite values (computed, not written)."""
  new_table, new_slots = _zero_gradient_values(rule, table, slots, learning_rate)
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in (new_table, *new_slots)])


# --------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------


def apply_sparse_update(
  rule: UpdateRule,
  state: TableState,
  row_ids: tf.Tensor,
  grads: tf.Tensor,
  learning_rate: tf.Tensor,
  table_rows: Optional[tf.Tensor] = None,
  atomic: bool = False,
) -> None:
  """Applies one optimizer step to the touched rows of a table and its slots.

  Args:
    rule: the update rule of the table's `tf.tpu.experimental.embedding` optimizer (SGD,
      Adagrad, AdagradMomentum, Adam, FTRL, CustomOptimizer), from `rule_for`.
    state: the `[V, D]` table and its slots (any plain resource variables, e.g. one replica's
      component of a MirroredVariable), slots in `rule.slot_names` order.
    row_ids: `[U]` int32/int64 row ids, unique (the caller merged duplicates).
    grads: `[U, D]` gradient per row, already summed over the step (SPEC §2.1).
    learning_rate: scalar learning rate of this step (dynamic LRs evaluated).
    table_rows: the current `[U, D]` rows of the table at `row_ids`, when the caller has just
      read them (saves one random read per row); read here otherwise.
    atomic: other steps may update the same rows concurrently (parameter-server workers), so
      the read-modify-write of each row must not interleave with theirs. The compiled kernel
      and the rule's locked form (SGD and Adagrad without clipping or decay) guarantee it;
      the gather-compute-scatter path does not (updates may then be lost, as in any
      lock-free asynchronous training).

  Works eagerly and in `tf.function`. Rows outside `row_ids` are untouched,
  except with non-lazy Adam, which updates every row (SPEC §2.6).
  """
  optimizer = rule.optimizer
  table, slot_vars = state.parameters, state.slots
  learning_rate = tf.cast(learning_rate, table.dtype)
  native_form = rule.native_form()
  if native_form is not None and native.runs_on(state.variables):
    native.apply_rows(
      *native_form,
      table,
      slot_vars,
      row_ids,
      grads,
      learning_rate,
      clip_gradient=gradient_limits(optimizer),
      weight_decay=optimizer.weight_decay_factor if has_weight_decay(optimizer) else 0.0,
      weight_decay_by_learning_rate=bool(
        getattr(optimizer, "multiply_weight_decay_factor_by_learning_rate", False)
      ),
      clip_weight=weight_limits(optimizer),
    )
    return
  locked_form = rule.locked_form() if atomic else None
  if locked_form is not None:
    locked_form(state, row_ids, tf.cast(grads, table.dtype), learning_rate)
    return
  grads = clip_gradient(optimizer, tf.cast(grads, table.dtype))
  if rule.updates_every_row:
    _apply_every_row(rule, state, row_ids, grads, learning_rate, table_rows)
    return
  rows = update_rows(
    rule, *gather_rows(table, slot_vars, row_ids, table_rows), grads, learning_rate
  )
  scatter_rows(table, slot_vars, row_ids, rows)
