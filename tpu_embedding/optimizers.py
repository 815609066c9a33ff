"""Turns the optimizer a user hands us into a `tf.tpu.experimental.embedding` one.

Embedding tables are trained by the TPU embedding engine (or our CPU engine that reproduces it),
which only understands the mid-level optimizer classes. Users naturally reach for Keras
optimizers, so we translate them, but only where the TPU update is the Keras update: every
hyperparameter without an exact counterpart is refused with a `ValueError` rather than dropped.

What "exact" means, and the two places where it is knowingly not:

* Keras `SGD`, `Adagrad`, `Adam`, `Ftrl` of the three families (tf-keras legacy, tf-keras,
  Keras 3) map to `SGD`, `Adagrad`, `Adam`, `FTRL`; `clipvalue` maps to the mid-level
  `clipvalue`, which clips each row's gradient summed over the batch (Keras clips before
  duplicate ids are summed, so the two differ only when an id repeats within a step).
* Adam: Keras divides by `sqrt(v) + epsilon`, so the twin is `Adam(sum_inside_sqrt=False)`.
  The TPU has no bias correction: the translated Adam steps by `lr` where Keras steps by
  `lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)` (t = iterations + 1). This is not folded into
  the learning rate behind the user's back; to get it, pass a mid-level `Adam` whose
  `learning_rate` is a callable computing that product. The twin is also the TPU's default lazy
  Adam (rows absent from a step keep their moments), the only form every backend, SparseCore
  included, implements; Keras decays the moments of every row each step.
* Adagrad: the TPU has no epsilon. Keras adds it outside (tf-keras legacy) or inside (tf-keras,
  Keras 3) the square root. Accumulators start at `initial_accumulator_value` (a0) and only grow,
  so epsilon shrinks any Keras step by a relative amount below
  `max(epsilon / sqrt(a0), epsilon / (2 * a0))`. We accept epsilon when that bound is at most
  `ADAGRAD_EPSILON_RTOL` (1e-6, a few float32 ulps; Keras's default 1e-7 with a0 = 0.1 gives
  5e-7) and refuse it otherwise.
* tf-keras legacy `decay` is refused: `InverseTimeDecay(lr, decay_steps=1, decay_rate=decay)` is
  its exact replacement.

Learning rates are never frozen: a translated optimizer's `learning_rate` is a
`KerasLearningRate`, which reads the Keras optimizer's rate (schedule at `iterations`, variable,
or callable) each time it is called. The user's Keras optimizer advances `iterations` in its own
`apply_gradients`; the embedding update of a step sees the rate of that step if it runs before
that increment, as Keras's own update does. Only functions traced while a SavedModel is saved
take the rate at that time, as a constant: the SavedModel need not reach the Keras optimizer.

Mid-level optimizers pass through untouched, except that a `learning_rate` which is neither a
number nor a callable (e.g. a `tf.Variable`) is refused: TF's V1 API would silently store its
current value as a constant. Wrap a variable as `lambda: var`.
"""

import dataclasses
import math
import numbers
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf
from absl import logging

from tpu_embedding import optimizer_specs as specs
from tpu_embedding import tf_internals
from tpu_embedding.optimizer_specs import MidLevelOptimizer, keras_slot_name, learning_rate_tensor

__all__ = [
  "ADAGRAD_EPSILON_RTOL",
  "KerasLearningRate",
  "MidLevelOptimizer",
  "NotAnOptimizerError",
  "follows_keras_optimizer",
  "keras_slot_name",
  "learning_rate_tensor",
  "normalize_optimizer",
  "warn_if_bias_correction_dropped",
  "translate_keras_optimizer",
]

_embedding = tf.tpu.experimental.embedding

ADAGRAD_EPSILON_RTOL = 1e-6
"""Largest relative change Keras's Adagrad epsilon may make to a step for us to drop it."""

# A rule says whether a Keras hyperparameter value (given all of them) has the TPU's behaviour.
_Rule = Callable[[Any, Mapping[str, Any]], bool]


def _is(*neutral: Any) -> _Rule:
  return lambda value, _: value in neutral


def _max_adagrad_epsilon(params: Mapping[str, Any]) -> float:
  a0 = params["initial_accumulator_value"]
  return min(math.sqrt(a0), 2 * a0) * ADAGRAD_EPSILON_RTOL if a0 > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class _Refused:
  """A Keras hyperparameter with no TPU counterpart unless `allowed` holds."""

  allowed: _Rule
  advice: Union[str, Callable[[Mapping[str, Any]], str]]


_NO_WEIGHT_DECAY = _Refused(
  _is(None, 0),
  "the TPU has no Keras-style weight decay; pass a tf.tpu.experimental.embedding optimizer "
  "with `weight_decay_factor` (and `multiply_weight_decay_factor_by_learning_rate=True`)",
)
_NO_NORM_CLIPPING = _Refused(
  _is(None),
  "the TPU cannot clip by norm; use `clipvalue` (element-wise gradient clipping) instead",
)

# Hyperparameters every Keras optimizer may carry; absent from a family means not applicable.
_COMMON_REFUSED: Dict[str, _Refused] = {
  "weight_decay": _NO_WEIGHT_DECAY,
  "clipnorm": _NO_NORM_CLIPPING,
  "global_clipnorm": _NO_NORM_CLIPPING,
  "use_ema": _Refused(
    _is(False), "the TPU keeps no moving average of embedding tables; set use_ema=False"
  ),
  "loss_scale_factor": _Refused(
    _is(None),
    "the TPU applies embedding gradients without unscaling them; leave it None",
  ),
  "gradient_accumulation_steps": _Refused(
    _is(None), "the TPU applies the embedding update every step; leave it None"
  ),
  "decay": _Refused(
    _is(0),
    "use learning_rate=tf_keras.optimizers.schedules.InverseTimeDecay(lr, decay_steps=1, "
    "decay_rate=decay), which is the same rate",
  ),
  "gradient_transformers": _Refused(
    _is([]), "transform the gradients before they reach the embedding layer"
  ),
}
# Settings with no effect on the update (or only under a setting refused above).
_COMMON_IGNORED = frozenset(
  {"name", "jit_compile", "is_legacy_optimizer", "ema_momentum", "ema_overwrite_frequency"}
)
# Read as attributes because `get_config()` leaves them out.
_NOT_IN_CONFIG = ("adaptive_epsilon", "gradient_transformers")


@dataclasses.dataclass(frozen=True)
class _Translation:
  """How one Keras optimizer class becomes its mid-level twin."""

  mid_level: type
  carried: Tuple[str, ...]  # same name on both sides
  refused: Dict[str, _Refused]
  fixed: Dict[str, Any] = dataclasses.field(default_factory=dict)


_TRANSLATIONS: Dict[str, _Translation] = {
  "SGD": _Translation(
    _embedding.SGD,
    carried=(),
    refused={
      "momentum": _Refused(
        _is(0),
        "the TPU's SGD has no momentum; use momentum=0.0, or pass "
        "tf.tpu.experimental.embedding.AdagradMomentum (a different update) yourself",
      ),
      "nesterov": _Refused(_is(False), "the TPU's SGD has no momentum; use nesterov=False"),
    },
  ),
  "Adagrad": _Translation(
    _embedding.Adagrad,
    carried=("initial_accumulator_value",),
    refused={
      "epsilon": _Refused(
        lambda epsilon, params: epsilon <= _max_adagrad_epsilon(params),
        lambda params: (
          "the TPU's Adagrad has no epsilon, and this one changes steps by more than "
          f"{ADAGRAD_EPSILON_RTOL:g} relative; use epsilon <= "
          f"{_max_adagrad_epsilon(params):.3g} or pass "
          "tf.tpu.experimental.embedding.Adagrad"
        ),
      ),
    },
  ),
  "Adam": _Translation(
    _embedding.Adam,
    carried=("beta_1", "beta_2", "epsilon"),
    refused={
      "amsgrad": _Refused(_is(False), "the TPU has no AMSGrad; use amsgrad=False"),
      "adaptive_epsilon": _Refused(
        _is(False), "the TPU's epsilon is fixed; use adaptive_epsilon=False"
      ),
    },
    fixed={"sum_inside_sqrt": False},
  ),
  "Ftrl": _Translation(
    _embedding.FTRL,
    carried=(
      "learning_rate_power",
      "initial_accumulator_value",
      "l1_regularization_strength",
      "l2_regularization_strength",
      "beta",
    ),
    refused={
      "l2_shrinkage_regularization_strength": _Refused(
        _is(0),
        "the TPU's FTRL has no L2 shrinkage; use 0.0, or l2_regularization_strength",
      ),
    },
  ),
}


def _imported_keras(name: str) -> Optional[ModuleType]:
  """The Keras package `name` ("tf_keras" or "keras") if it has been imported: otherwise no
  object of it can exist, and we never import it ourselves (each layer flavour must load only
  its own Keras)."""
  keras = sys.modules.get(name)
  return keras if hasattr(keras, "optimizers") else None


def _keras_family(optimizer: Any) -> Optional[Tuple[str, ModuleType]]:
  """(label, module) of the Keras optimizer family `optimizer` belongs to."""
  families = []
  tf_keras = _imported_keras("tf_keras")
  if tf_keras is not None:
    families.append(("tf_keras.optimizers.legacy", tf_keras.optimizers.legacy))
    families.append(("tf_keras.optimizers", tf_keras.optimizers))
  keras = _imported_keras("keras")
  if keras is not None:
    families.append(("keras.optimizers", keras.optimizers))
  for label, module in families:
    if isinstance(optimizer, module.Optimizer):
      return label, module
  return None


def _schedule_types() -> Tuple[type, ...]:
  kerases = [_imported_keras("tf_keras"), _imported_keras("keras")]
  return tuple(k.optimizers.schedules.LearningRateSchedule for k in kerases if k is not None)


class NotAnOptimizerError(TypeError, ValueError):
  """Something that is not an optimizer was given as one.

  A TypeError by nature; also a ValueError because tf-recommenders raised that here and code
  written for it catches ValueError.
  """


class KerasLearningRate:
  """Zero-argument callable giving a Keras optimizer's current learning rate as float32.

  It is a mid-level `learning_rate`, so TF calls it while tracing each step and the rate
  follows the Keras optimizer (schedule, assigned variable, callable) instead of being fixed
  at translation time. Two instances for the same Keras optimizer are equal, so optimizers
  translated twice from it compare equal (TF uses that to share tables and learning rates).
  """

  def __init__(self, keras_optimizer: Any):
    self.keras_optimizer = keras_optimizer

  def __call__(self) -> tf.Tensor:
    # tf-keras's legacy optimizers create their hyperparameter variables on the first read of one.
    # That is left to the first step, as in tf-recommenders (a checkpoint written before it has
    # none, and must restore with `assert_existing_objects_matched`), but lifted out of the
    # step's graph: inside a replica step of `MirroredStrategy` TF could not run a variable
    # created there.
    with tf.init_scope():
      _ = self.keras_optimizer.learning_rate
    if tf_internals.in_save_context():
      # A SavedModel holds only what its root reaches, and a custom loop's Keras optimizer is
      # not reachable from the model: functions traced while saving (the trap's gradient among
      # them) take the rate at the time of saving, as a constant.
      with tf.init_scope():
        rate = float(self._current())
      return tf.constant(rate, tf.float32)
    return self._current()

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    """The current rate, so code that reads a mid-level rate as a number (NumPy, keras-rs's
    tests) reads this one too."""
    with tf.init_scope():
      return np.asarray(self._current().numpy(), dtype=dtype)

  def _current(self) -> tf.Tensor:
    optimizer = self.keras_optimizer
    # tf-keras and Keras 3 keep what the user passed in `_learning_rate` (tf-keras's public
    # property gives the previous step's rate for a schedule); the legacy family keeps it as a
    # hyperparameter that its `learning_rate` attribute returns.
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None:
      rate = optimizer.learning_rate
    if isinstance(rate, _schedule_types()):
      rate = rate(optimizer.iterations)
    elif callable(rate):
      rate = rate()
    return tf.cast(rate, tf.float32)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, KerasLearningRate) and other.keras_optimizer is self.keras_optimizer

  def __hash__(self) -> int:
    return id(self.keras_optimizer)

  def __repr__(self) -> str:
    return f"KerasLearningRate({type(self.keras_optimizer).__name__})"


def translate_keras_optimizer(optimizer: Any, *, where: str = "optimizer") -> MidLevelOptimizer:
  """Returns the mid-level twin of a Keras optimizer, or raises if there is none.

  `where` names the argument in error messages.
  """
  family = _keras_family(optimizer)
  if family is None:
    raise NotAnOptimizerError(
      f"{where}: expected a Keras optimizer, got {type(optimizer).__name__}: {optimizer!r}"
    )
  label, module = family
  class_name = type(optimizer).__name__
  full_name = f"{label}.{class_name}"
  translation = _TRANSLATIONS.get(class_name)
  if translation is None or getattr(module, class_name, None) is not type(optimizer):
    raise ValueError(
      f"{where}: Keras optimizer {full_name} has no TPU embedding equivalent; use a Keras "
      f"{', '.join(sorted(_TRANSLATIONS))} or a tf.tpu.experimental.embedding optimizer "
      f"({specs.CLASS_NAMES})"
    )

  with warnings.catch_warnings():
    # Keras 3 warns that a lambda learning rate cannot be reloaded; we do not serialize.
    warnings.filterwarnings("ignore", message="The object being serialized includes a `lambda`")
    params = dict(optimizer.get_config())
  params.update({k: getattr(optimizer, k) for k in _NOT_IN_CONFIG if hasattr(optimizer, k)})
  refused = {**_COMMON_REFUSED, **translation.refused}
  known = _COMMON_IGNORED | {"learning_rate", "clipvalue"} | set(translation.carried)
  for key, value in params.items():
    if key in known:
      continue
    rule = refused.get(key)
    if rule is None:
      raise ValueError(
        f"{where}: Keras optimizer {full_name} has {key}={value!r}, a hyperparameter this "
        "translation does not know, so it cannot promise the same update; pass a "
        f"tf.tpu.experimental.embedding.{translation.mid_level.__name__} instead"
      )
    if not rule.allowed(value, params):
      advice = rule.advice(params) if callable(rule.advice) else rule.advice
      raise ValueError(
        f"{where}: Keras optimizer {full_name} has {key}={value!r}, which the TPU "
        f"embedding {translation.mid_level.__name__} cannot reproduce: {advice}"
      )

  clipvalue = params.get("clipvalue")
  kwargs = {key: float(params[key]) for key in translation.carried}
  kwargs.update(translation.fixed)
  try:
    return translation.mid_level(
      learning_rate=KerasLearningRate(optimizer),
      clipvalue=None if clipvalue is None else float(clipvalue),
      **kwargs,
    )
  except ValueError as error:
    raise ValueError(f"{where}: Keras optimizer {full_name}: {error}") from error


def follows_keras_optimizer(optimizer: Optional[MidLevelOptimizer]) -> bool:
  """Whether `optimizer` was translated from a Keras optimizer, whose learning rate it reads."""
  return optimizer is not None and isinstance(optimizer.learning_rate, KerasLearningRate)


# Tables already named by the warning below: a layer rebuilt with the same tables (e.g. in a
# loop) does not log it again.
_NAMED_WITHOUT_BIAS_CORRECTION: set = set()


def warn_if_bias_correction_dropped(tables: Sequence[Any]) -> None:
  """Logs that a Keras Adam trains these tables without bias correction: one warning per
  layer, naming every such table, unless each was named before in this process.

  Called by layers whose tables are trained by their mid-level optimizers (the TPU embedding
  engine or this package's CPU engine), not by the Keras optimizer itself; a layer made of
  others (`PartialTPUEmbedding`) calls it once with all its tables, before its parts.
  """
  names = [
    table.name
    for table in tables
    if type(table.optimizer) is _embedding.Adam and follows_keras_optimizer(table.optimizer)
  ]
  if not names or set(names) <= _NAMED_WITHOUT_BIAS_CORRECTION:
    return
  _NAMED_WITHOUT_BIAS_CORRECTION.update(names)
  logging.warning(
    "tpu_embedding: tables %s are trained by the TPU embedding engine's Adam, translated "
    "from a Keras Adam; it has no bias correction. Keras scales each step by "
    "sqrt(1 - beta_2**t) / (1 - beta_1**t); the TPU does not, so with the default betas "
    "its first step is about 3.2x larger than Keras's (the ratio tends to 1 as t grows), "
    "which at a large learning rate changes early training. For Keras's steps, pass "
    "table_updates='keras' (CPU/GPU), or a tf.tpu.experimental.embedding.Adam whose "
    "learning_rate is a callable including that factor.",
    names,
  )


def normalize_optimizer(optimizer: Any, *, where: str = "optimizer") -> Optional[MidLevelOptimizer]:
  """One entry point for every form a user may give: None, a name, mid-level or Keras."""
  if optimizer is None:
    return None
  if isinstance(optimizer, str):
    spec = specs.BY_NAME.get(optimizer.lower())
    if spec is None:
      raise ValueError(
        f"{where}: unknown optimizer name {optimizer!r}; accepted names (any case): "
        f"{', '.join(repr(name) for name in sorted(specs.BY_NAME))}"
      )
    return spec.mid_level()
  if isinstance(optimizer, specs.MID_LEVEL_CLASSES):
    rate = optimizer.learning_rate
    if not (callable(rate) or isinstance(rate, numbers.Real)):
      raise ValueError(
        f"{where}: learning_rate={rate!r} of {type(optimizer).__name__} must be a number "
        "or a zero-argument callable (the TPU would freeze anything else at its current "
        "value); wrap a variable as `lambda: var`"
      )
  else:
    optimizer = translate_keras_optimizer(optimizer, where=where)
  _check_limits(optimizer, where)
  _check_initial_accumulator(optimizer, where)
  return optimizer


def _check_initial_accumulator(optimizer: MidLevelOptimizer, where: str) -> None:
  """Refuses Adagrad or FTRL accumulators starting at or below 0.

  TF's constructors refuse them, but an attribute set afterwards escapes that check, and the
  TPU's Adagrad has no epsilon: a touched row whose summed gradient is 0 would take 0 / sqrt(0)
  and become NaN (FTRL divides by the accumulator's power alike).
  """
  if not isinstance(optimizer, (_embedding.Adagrad, _embedding.FTRL)):
    return
  value = optimizer.initial_accumulator_value
  if not (isinstance(value, numbers.Real) and value > 0):
    raise ValueError(
      f"{where}: initial_accumulator_value={value!r} of {type(optimizer).__name__}; expected a "
      "float > 0 (the TPU's update divides by the accumulator's root, with no epsilon, so a "
      "zero gradient on a row whose accumulator is 0 would make the row NaN)."
    )


def _check_limits(optimizer: MidLevelOptimizer, where: str) -> None:
  """Refuses clipping limits whose minimum exceeds their maximum (they would clip to max)."""
  for what, hint, (low, high) in (
    (
      "clipvalue",
      " (a single clipvalue c means (-c, c), so c must be >= 0)",
      specs.gradient_limits(optimizer),
    ),
    ("clip_weight_min/clip_weight_max", "", specs.weight_limits(optimizer)),
  ):
    if low is not None and high is not None and low > high:
      raise ValueError(
        f"{where}: {what} has minimum {low} above maximum {high}; give min <= max{hint}."
      )
