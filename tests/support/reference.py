"""Float64 NumPy reference of the TPU embedding semantics, written from the SPEC.

Independent of the engine code on purpose: every formula here is transcribed
from docs/SPEC-tpu-embedding-semantics.md, so engine tests compare the
implementation with the spec, not with itself.

Optimizer parameters are plain dicts keyed by the mid-level optimizer's
attribute names (`params_from_optimizer` builds one from a
`tf.tpu.experimental.embedding` optimizer), slots are dicts keyed by the TF
slot names. The API:

Optimizer rules on a block of rows (SPEC §2.3-2.8, no clipping or decay):
  RULES[kind](W, slots, g, lr, params) -> (W', slots')
  with kind in {"sgd", "adagrad", "adagrad_momentum", "adam", "ftrl", "custom"}.

Whole step on a table (SPEC §1 steps 4-7, §2.2, §2.9):
  apply_step(W, slots, row_ids, grads, lr, params) -> (W', slots')
  clip gradient -> provisional weight decay -> rule -> clip weights, on the
  touched rows only (every row for non-lazy Adam, untouched ones with g = 0).

Helpers: params_from_optimizer(opt), initial_slots(params, shape),
  slot_names(kind), clip(x, low, high).

Forward and gradient assembly (SPEC §3.2-3.3, §2.1):
  bag_scale(weights, combiner) -> c_s
  combine_bag(W, ids, weights, combiner) -> activation [D]
  assemble_gradients(bags, upstream, combiner, dim) -> (row_ids, grads)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

Slots = Dict[str, np.ndarray]
Params = Dict[str, Any]
Bag = Tuple[Sequence[int], Optional[Sequence[float]]]
"""One sample: its ids and their weights (None = all weights 1)."""

_SLOTS = {
  "sgd": (),
  "adagrad": ("accumulators",),
  "adagrad_momentum": ("accumulators", "momenta"),
  "adam": ("momenta", "velocities"),
  "ftrl": ("accumulators", "linears"),
}

_COMMON = (
  "learning_rate",
  "clip_gradient_min",
  "clip_gradient_max",
  "clip_weight_min",
  "clip_weight_max",
  "weight_decay_factor",
  "multiply_weight_decay_factor_by_learning_rate",
)
_HYPERPARAMETERS = {
  "sgd": (),
  "adagrad": ("initial_accumulator_value",),
  "adagrad_momentum": ("momentum", "use_nesterov", "exponent", "beta2", "epsilon"),
  "adam": ("beta_1", "beta_2", "epsilon", "lazy_adam", "sum_inside_sqrt"),
  "ftrl": (
    "learning_rate_power",
    "l1_regularization_strength",
    "l2_regularization_strength",
    "beta",
    "initial_accumulator_value",
    "multiply_linear_by_learning_rate",
  ),
}
_KINDS = {
  "SGD": "sgd",
  "Adagrad": "adagrad",
  "AdagradMomentum": "adagrad_momentum",
  "Adam": "adam",
  "FTRL": "ftrl",
  "CustomOptimizer": "custom",
}


# ---------------------------------------------------------------- parameters


def params_from_optimizer(optimizer) -> Params:
  """The reference's parameter dict for a mid-level optimizer object."""
  kind = _KINDS[type(optimizer).__name__]
  params: Params = {"kind": kind}
  for name in _COMMON:
    params[name] = getattr(optimizer, name, None)
  if kind == "custom":
    params["custom_computation"] = optimizer.custom_computation
    params["slot_names"] = tuple(optimizer._slot_names())
    params["hyperparameters"] = tuple(h() if callable(h) else h for h in optimizer.hyperparameters)
    return params
  for name in _HYPERPARAMETERS[kind]:
    params[name] = getattr(optimizer, name)
  return params


def slot_names(params: Params) -> Tuple[str, ...]:
  if params["kind"] == "custom":
    return tuple(params["slot_names"])
  return _SLOTS[params["kind"]]


def initial_slots(params: Params, shape: Sequence[int]) -> Slots:
  """Slot values of a fresh table (SPEC §2.4-2.7 initialisers)."""
  kind = params["kind"]
  init = {
    "adagrad": {"accumulators": params.get("initial_accumulator_value")},
    "adagrad_momentum": {"accumulators": 0.0, "momenta": 0.0},
    "adam": {"momenta": 0.0, "velocities": 0.0},
    "ftrl": {"accumulators": params.get("initial_accumulator_value"), "linears": 0.0},
  }.get(kind, {})
  return {name: np.full(shape, init[name], np.float64) for name in _SLOTS.get(kind, ())}


# ---------------------------------------------------------------- rules (SPEC §2.3-2.8)


def sgd(w: np.ndarray, slots: Slots, g: np.ndarray, lr: float, params: Params):
  """§2.3: W - lr g."""
  return w - lr * g, {}


def adagrad(w, slots, g, lr, params):
  """§2.4: A += g^2 (new A used, no epsilon)."""
  a = slots["accumulators"] + g**2
  return w - lr * g / np.sqrt(a), {"accumulators": a}


def adagrad_momentum(w, slots, g, lr, params):
  """§2.5, gradient inside the momentum (SparseCore form)."""
  beta2 = params["beta2"]
  if beta2 == 1:
    a = slots["accumulators"] + g**2
  else:
    a = beta2 * slots["accumulators"] + (1 - beta2) * g**2
  g_hat = (a + params["epsilon"]) ** (-1.0 / params["exponent"]) * g
  mu = params["momentum"]
  m = mu * slots["momenta"] + g_hat
  step = mu * m + g_hat if params["use_nesterov"] else m
  return w - lr * step, {"accumulators": a, "momenta": m}


def adam(w, slots, g, lr, params):
  """§2.6: no bias correction; epsilon inside (default) or outside the sqrt."""
  b1, b2, eps = params["beta_1"], params["beta_2"], params["epsilon"]
  m = b1 * slots["momenta"] + (1 - b1) * g
  v = b2 * slots["velocities"] + (1 - b2) * g**2
  if params["sum_inside_sqrt"]:
    w = w - lr * m / np.sqrt(v + eps**2)
  else:
    w = w - lr * m / (np.sqrt(v) + eps)
  return w, {"momenta": m, "velocities": v}


def ftrl(w, slots, g, lr, params):
  """§2.7: W recomputed from the slots; `linears` stores lr*L when multiplied."""
  p = params["learning_rate_power"]
  l1 = params["l1_regularization_strength"]
  l2 = params["l2_regularization_strength"]
  beta = params["beta"]
  a_old = slots["accumulators"]
  a_new = a_old + g**2
  delta = a_new ** (-p) - a_old ** (-p)
  lin = slots["linears"]
  if params["multiply_linear_by_learning_rate"]:
    lin = lin + lr * g - delta * w
    w = (np.clip(lin, -lr * l1, lr * l1) - lin) / (a_new ** (-p) + 2 * lr * l2 + beta)
  else:
    lin = lin + g - delta / lr * w
    w = (np.clip(lin, -l1, l1) - lin) / ((a_new ** (-p) + beta) / lr + 2 * l2)
  return w, {"accumulators": a_new, "linears": lin}


def custom(w, slots, g, lr, params):
  """§2.8: the user's per-row computation, called one row at a time.

  Rows are passed as `[1, D]` slices (slots of rank 1 as `[1]`), as the
  SparseCore contract describes; this is the per-row oracle for the engine's
  vectorised call.
  """
  fn: Callable = params["custom_computation"]
  names = slot_names(params)
  new_w = np.array(w, np.float64)
  new_slots = {n: np.array(slots[n], np.float64) for n in names}
  for r in range(w.shape[0]):
    out = fn(
      g[r : r + 1],
      w[r : r + 1],
      [slots[n][r : r + 1] for n in names],
      lr,
      list(params["hyperparameters"]),
    )
    if isinstance(out, (tuple, list)):
      new_w[r] = np.asarray(out[0])[0]
      for n, value in zip(names, out[1:]):
        new_slots[n][r] = np.asarray(value)[0]
    else:
      new_w[r] = np.asarray(out)[0]
  return new_w, new_slots


RULES: Dict[str, Callable[..., Tuple[np.ndarray, Slots]]] = {
  "sgd": sgd,
  "adagrad": adagrad,
  "adagrad_momentum": adagrad_momentum,
  "adam": adam,
  "ftrl": ftrl,
  "custom": custom,
}


# ---------------------------------------------------------------- one step on a table


def clip(x: np.ndarray, low: Optional[float], high: Optional[float]) -> np.ndarray:
  """Elementwise min(max(x, low), high); None = no limit on that side."""
  if low is not None:
    x = np.maximum(x, low)
  if high is not None:
    x = np.minimum(x, high)
  return x


def _decay(w: np.ndarray, lr: float, params: Params) -> np.ndarray:
  """§2.9 provisional rule: W - lambda W, lambda = factor (* lr with the flag)."""
  factor = params.get("weight_decay_factor")
  if not factor:
    return w
  if params.get("multiply_weight_decay_factor_by_learning_rate"):
    factor = factor * lr
  return w - factor * w


def apply_step(
  table: np.ndarray,
  slots: Mapping[str, np.ndarray],
  row_ids: Sequence[int],
  grads: np.ndarray,
  lr: float,
  params: Params,
) -> Tuple[np.ndarray, Slots]:
  """One optimizer step on a whole table with unique touched `row_ids`.

  Touched rows: clip g -> decay W -> rule -> clip W. Untouched rows are left
  as they are, except for non-lazy Adam, where they get the rule with g = 0
  (unclipped, undecayed) and weight clipping.
  """
  table = np.array(table, np.float64)
  slots = {k: np.array(v, np.float64) for k, v in slots.items()}
  row_ids = np.asarray(row_ids, np.int64)
  rule = RULES[params["kind"]]
  names = slot_names(params)
  new_table, new_slots = table.copy(), {k: v.copy() for k, v in slots.items()}
  if params["kind"] == "adam" and not params["lazy_adam"]:
    w0, s0 = rule(table, slots, np.zeros_like(table), lr, params)
    new_table = clip(w0, params.get("clip_weight_min"), params.get("clip_weight_max"))
    new_slots.update(s0)
  g = clip(
    np.asarray(grads, np.float64), params.get("clip_gradient_min"), params.get("clip_gradient_max")
  )
  w = _decay(table[row_ids], lr, params)
  w, touched_slots = rule(w, {n: slots[n][row_ids] for n in names}, g, lr, params)
  new_table[row_ids] = clip(w, params.get("clip_weight_min"), params.get("clip_weight_max"))
  for n in names:
    new_slots[n][row_ids] = touched_slots[n]
  return new_table, new_slots


# ---------------------------------------------------------------- combiners (SPEC §3.2-3.3)


def bag_scale(weights: Sequence[float], combiner: str) -> float:
  """c_s: 1 (sum), 1/sum(w) (mean), 1/sqrt(sum(w^2)) (sqrtn); 0 when that is 1/0."""
  w = np.asarray(weights, np.float64)
  if combiner == "sum":
    return 1.0
  if combiner == "mean":
    total = w.sum()
  elif combiner == "sqrtn":
    total = np.sqrt((w**2).sum())
  else:
    raise ValueError(f"unknown combiner {combiner!r}")
  return 0.0 if total == 0 else 1.0 / total


def _weights(ids: Sequence[int], weights: Optional[Sequence[float]]) -> np.ndarray:
  return np.ones(len(ids)) if weights is None else np.asarray(weights, np.float64)


def combine_bag(
  table: np.ndarray, ids: Sequence[int], weights: Optional[Sequence[float]], combiner: str
) -> np.ndarray:
  """a_s = c_s * sum_k w_k W[i_k]; an empty bag (or zero weight sum) gives 0."""
  table = np.asarray(table, np.float64)
  if len(ids) == 0:
    return np.zeros(table.shape[1])
  w = _weights(ids, weights)
  return bag_scale(w, combiner) * (w[:, None] * table[np.asarray(ids)]).sum(axis=0)


def assemble_gradients(
  bags: Sequence[Bag], upstream: np.ndarray, combiner: str, dim: Optional[int] = None
) -> Tuple[np.ndarray, np.ndarray]:
  """§2.1: g_r = sum over samples and occurrences of c_s w_k dL/da_s.

  `bags` are all samples of all features on one table (concatenate features,
  with their `upstream` rows in the same order). Returns sorted unique touched
  row ids and their gradients; a touched row with zero total gain still
  appears (with g = 0), because touching depends on presence, not on value.
  """
  upstream = np.asarray(upstream, np.float64)
  dim = upstream.shape[1] if dim is None else dim
  total: Dict[int, np.ndarray] = {}
  for (ids, weights), grad in zip(bags, upstream):
    if len(ids) == 0:
      continue
    w = _weights(ids, weights)
    scale = bag_scale(w, combiner)
    for row, weight in zip(ids, w):
      total.setdefault(int(row), np.zeros(dim))
      total[int(row)] += scale * weight * grad
  rows = np.array(sorted(total), np.int64)
  grads = np.stack([total[r] for r in rows]) if len(rows) else np.zeros([0, dim])
  return rows, grads
