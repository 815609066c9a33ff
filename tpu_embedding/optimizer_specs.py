"""One description per `tf.tpu.experimental.embedding` optimizer class: what the package knows.

Each `OptimizerSpec` says, for one mid-level class, the name a user may give it by, the names
tf-recommenders' checkpoints give its slots (they come from the Keras optimizer that created
them), and whether a `.keras` file can hold it. The readers every module shares sit beside it:
slot names, shapes and initial values (the only place TF's private `_slot_names` and
`_slot_initializers` are read), the clipping and weight-decay settings, the learning rate and
the `.keras` serialization. The maths lives in one `engine.updates.UpdateRule` per class, so
adding an optimizer is one spec here plus one rule there.

This module imports nothing else of the package: the configuration, the engine, the layers and
the checkpoints all read optimizers through it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, Optional, Union

import tensorflow as tf

_embedding = tf.tpu.experimental.embedding


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """What the package knows about one mid-level optimizer class.

  Attributes:
    mid_level: the `tf.tpu.experimental.embedding` class.
    name: the lower-case name a user may pass instead of an object ("sgd"), if any.
    keras_slots: {mid-level slot name: the Keras (legacy) optimizer's name for it}: read when a
      checkpoint written by tf-recommenders (slots owned by the Keras optimizer) is restored.
    in_keras_files: whether `serialize` can write it into a `.keras` file (a CustomOptimizer's
      computation is code, not configuration).
  """

  mid_level: type
  name: Optional[str] = None
  keras_slots: Mapping[str, str] = dataclasses.field(default_factory=dict)
  in_keras_files: bool = True


SPECS: tuple[OptimizerSpec, ...] = (
  OptimizerSpec(_embedding.SGD, name="sgd"),
  OptimizerSpec(_embedding.Adagrad, name="adagrad", keras_slots={"accumulators": "accumulator"}),
  OptimizerSpec(_embedding.AdagradMomentum),
  OptimizerSpec(_embedding.Adam, name="adam", keras_slots={"momenta": "m", "velocities": "v"}),
  OptimizerSpec(
    _embedding.FTRL, name="ftrl", keras_slots={"accumulators": "accumulator", "linears": "linear"}
  ),
  OptimizerSpec(_embedding.CustomOptimizer, in_keras_files=False),
)

MID_LEVEL_CLASSES: tuple[type, ...] = tuple(spec.mid_level for spec in SPECS)
MidLevelOptimizer = Union[MID_LEVEL_CLASSES]
BY_NAME: dict[str, OptimizerSpec] = {spec.name: spec for spec in SPECS if spec.name}
CLASS_NAMES = ", ".join(cls.__name__ for cls in MID_LEVEL_CLASSES)
"""The mid-level classes, for error messages."""

Limits = tuple[Optional[float], Optional[float]]


def spec_of(optimizer: Any) -> Optional[OptimizerSpec]:
  """The spec of a mid-level optimizer object (subclasses included), None for anything else."""
  for klass in type(optimizer).__mro__:
    for spec in SPECS:
      if spec.mid_level is klass:
        return spec
  return None


# ---------------------------------------------------------------------------------------------
# Slots


def slot_names(optimizer: MidLevelOptimizer) -> tuple[str, ...]:
  """The optimizer's slots, in TF's order (the order of every update form and checkpoint)."""
  return tuple(optimizer._slot_names())


def slot_initializers(optimizer: MidLevelOptimizer) -> tuple[Any, ...]:
  """The initializer of each slot, in `slot_names` order."""
  return tuple(optimizer._slot_initializers())


def slot_shapes(
  optimizer: Optional[MidLevelOptimizer], vocabulary_size: int, dim: int
) -> list[tuple[str, list[int]]]:
  """(slot name, shape) of each slot, in `slot_names` order; none without an optimizer.

  Slots are [vocabulary_size, dim], or [vocabulary_size] for a CustomOptimizer slot of rank 1.
  """
  if optimizer is None:
    return []
  names = slot_names(optimizer)
  ranks = getattr(optimizer, "slot_dims", ()) or (2,) * len(names)  # CustomOptimizer only
  full = [vocabulary_size, dim]
  return [(name, full[:rank]) for name, rank in zip(names, ranks)]


def keras_slot_name(optimizer: MidLevelOptimizer, slot: str) -> Optional[str]:
  """The Keras optimizer's name for `slot` of the mid-level `optimizer`, or None if it has none.

  tf-recommenders creates the slots of its tables through the Keras optimizer, so its
  checkpoints hold them under these names (e.g. Adagrad's "accumulators" as "accumulator").
  """
  spec = spec_of(optimizer)
  return None if spec is None else spec.keras_slots.get(slot)


# ---------------------------------------------------------------------------------------------
# Settings shared by every optimizer (SPEC §2.2, §2.9)


def gradient_limits(optimizer: Any) -> Limits:
  """(min, max) of `clipvalue` gradient clipping; None where there is no limit."""
  return (
    getattr(optimizer, "clip_gradient_min", None),
    getattr(optimizer, "clip_gradient_max", None),
  )


def weight_limits(optimizer: Any) -> Limits:
  """(min, max) the stored table rows are clamped to; None where there is no limit."""
  return (getattr(optimizer, "clip_weight_min", None), getattr(optimizer, "clip_weight_max", None))


def has_weight_decay(optimizer: Any) -> bool:
  """Whether the optimizer decays weights: the proto only receives a truthy factor, so 0.0
  means "no decay" (SPEC §2.0)."""
  return bool(getattr(optimizer, "weight_decay_factor", None))


def learning_rate_tensor(optimizer: MidLevelOptimizer, where: str = "optimizer") -> tf.Tensor:
  """The rate of the current step as a float32 scalar, calling a dynamic rate every time.

  Anything but a real scalar is refused here, so that both ways the engine updates rows
  (compiled kernel and TF ops, which would broadcast a vector) accept exactly the same rates.
  """
  rate = optimizer.learning_rate
  value = rate() if callable(rate) else rate
  try:
    tensor = tf.convert_to_tensor(value)
  except (TypeError, ValueError):
    tensor = None
  if (
    tensor is None
    or not (tensor.dtype.is_floating or tensor.dtype.is_integer)
    or tensor.shape.rank not in (0, None)
  ):
    source = "its learning_rate callable returned" if callable(rate) else "learning_rate is"
    raise TypeError(f"{where}: {source} {value!r}; expected a scalar float.")
  if tensor.shape.rank is None:
    tensor = tf.reshape(tensor, [])  # checked when the step runs
  return tf.cast(tensor, tf.float32)


# ---------------------------------------------------------------------------------------------
# `.keras` files


def _in_keras_files() -> list[str]:
  return [spec.mid_level.__name__ for spec in SPECS if spec.in_keras_files]


def serialize(optimizer: Optional[MidLevelOptimizer], table: str) -> Optional[dict]:
  """A mid-level optimizer as {"class", "config"}: its constructor arguments' current values."""
  if optimizer is None:
    return None
  spec = spec_of(optimizer)
  if spec is None or spec.mid_level is not type(optimizer) or not spec.in_keras_files:
    raise ValueError(
      f"Table {table!r}: its optimizer {type(optimizer).__name__} cannot be "
      f"saved in a .keras file; use one of {', '.join(_in_keras_files())}."
    )
  if getattr(optimizer, "slot_variable_creation_fn", None) is not None:
    raise ValueError(
      f"Table {table!r}: an optimizer with a slot_variable_creation_fn cannot be "
      "saved in a .keras file (the function is code, not configuration)."
    )
  config = {}
  for argument in inspect.signature(type(optimizer).__init__).parameters:
    if argument in ("self", "slot_variable_creation_fn", "low_dimensional_packing_status"):
      continue
    if argument == "clipvalue":
      limits = gradient_limits(optimizer)
      config["clipvalue"] = None if limits == (None, None) else list(limits)
    elif argument == "learning_rate":
      config["learning_rate"] = float(learning_rate_tensor(optimizer))
    else:
      config[argument] = getattr(optimizer, argument)
  return {"class": spec.mid_level.__name__, "config": config}


def deserialize(serialized: Optional[Mapping[str, Any]]) -> Optional[MidLevelOptimizer]:
  """The optimizer `serialize` described."""
  if serialized is None:
    return None
  if serialized["class"] not in _in_keras_files():
    raise ValueError(
      f"Unknown embedding optimizer {serialized['class']!r} in a .keras file; "
      f"expected one of {', '.join(_in_keras_files())}."
    )
  config = dict(serialized["config"])
  if config.get("clipvalue") is not None:
    config["clipvalue"] = tuple(config["clipvalue"])
  return getattr(_embedding, serialized["class"])(**config)
