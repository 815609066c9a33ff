"""`ManagedIds`: how one table manages its own vocabulary (what the user passes)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping, Optional

import numpy as np
import tensorflow as tf

EVICTION_POLICIES = ("lfu", "lru", "ttl", "distance_lfu")
ADMISSIONS = ("always", "compete")
SCORED_POLICIES = ("lfu", "distance_lfu")  # those whose rows have a score a newcomer can beat
DISTANCE_DECAYS = (0.5, 1.0, 1.5, 2.0)
KEY_DTYPES = (tf.int64, tf.string)


@dataclasses.dataclass(frozen=True)
class ManagedIds:
  """A table that takes raw keys and gives each admitted key a row of its own.

  Args:
    key_dtype: tf.int64 (any int64 value; narrower integer inputs are widened) or tf.string.
    eviction: which row to free when every row is taken: "lfu" (smallest aged count), "lru"
      (least recently seen), "ttl" (rows unseen for `ttl_steps` steps are freed, then lru) or
      "distance_lfu" (smallest `count / distance ** distance_decay`: the key's occurrences since
      it took its row, never halved, over the steps since it was last seen: a heavy key keeps
      its row through a long absence, a key seen once loses it after a step or two).
    admission: "always" (every eligible new key takes a row while one can be freed) or
      "compete" ("lfu" and "distance_lfu" only): once no row is free, a new key takes a
      victim's row only if its score, its count so far (occurrences at this step plus its
      candidate count: keys that lose wait as candidates, their counts kept), is strictly above
      the victim's (aged count, or count over distance); the strongest new keys meet the
      weakest rows first, ties keep the row's key. None (the default): "compete" for "lfu" and
      "distance_lfu", "always" for "lru" and "ttl" (measured: benchmarks/managed_policies.py).
    min_count: a key gets a row at its `min_count`-th occurrence in training steps.
    ttl_steps: for "ttl" only: steps without an occurrence after which a row is freed.
    lfu_half_life_steps: LFU counts are halved every this many steps (yesterday's hits fade).
    distance_decay: for "distance_lfu" only: the exponent of the distance, one of 0.5, 1.0, 1.5,
      2.0 (in halves, so every path computes the same score bit for bit: square roots and
      products are exactly rounded, a general power is not). Higher forgets absent keys faster.
    candidate_capacity: how many not yet admitted keys' counts are kept (min_count > 1, or
      competing); None: the table's vocabulary size.
    reset_every_steps: TPU V1 only: rows given to new keys are reset in TPU memory at training
      steps that are multiples of this (a copy of the tables out of TPU memory and back); until
      then their keys read row 0. 1 gives every path the same rows at every step.
  """

  key_dtype: Any = tf.int64
  eviction: str = "lfu"
  min_count: int = 1
  ttl_steps: Optional[int] = None
  lfu_half_life_steps: int = 1000
  admission: Optional[str] = None
  distance_decay: float = 1.0
  candidate_capacity: Optional[int] = None
  reset_every_steps: int = 1

  def __post_init__(self):
    dtype = _as_dtype(self.key_dtype)
    if dtype not in KEY_DTYPES:
      raise ValueError(
        f"ManagedIds(key_dtype={self.key_dtype!r}): expected tf.int64 or tf.string (narrower "
        "integer keys are widened to int64 when they arrive)."
      )
    object.__setattr__(self, "key_dtype", dtype)
    if self.eviction not in EVICTION_POLICIES:
      raise ValueError(
        f"ManagedIds(eviction={self.eviction!r}): unknown eviction policy; expected one of "
        f"{EVICTION_POLICIES}."
      )
    if self.admission is None:
      scored = self.eviction in SCORED_POLICIES
      object.__setattr__(self, "admission", "compete" if scored else "always")
    if self.admission not in ADMISSIONS:
      raise ValueError(f"ManagedIds(admission={self.admission!r}): expected one of {ADMISSIONS}.")
    if self.admission == "compete" and self.eviction not in SCORED_POLICIES:
      raise ValueError(
        f"ManagedIds(admission='compete') needs a scored eviction policy, one of "
        f"{SCORED_POLICIES} (got eviction={self.eviction!r}, whose rows have no count to beat)."
      )
    if isinstance(self.distance_decay, bool) or self.distance_decay not in DISTANCE_DECAYS:
      raise ValueError(
        f"ManagedIds(distance_decay={self.distance_decay!r}): expected one of {DISTANCE_DECAYS}."
      )
    object.__setattr__(self, "distance_decay", float(self.distance_decay))
    counts = ["min_count", "lfu_half_life_steps", "reset_every_steps"]
    counts += ["ttl_steps"] if self.eviction == "ttl" else []
    counts += [] if self.candidate_capacity is None else ["candidate_capacity"]
    for name in counts:
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
    if self.eviction != "ttl" and self.ttl_steps is not None:
      raise ValueError(
        f"ManagedIds(ttl_steps={self.ttl_steps!r}) is only used with eviction='ttl' (got "
        f"eviction={self.eviction!r})."
      )

  @property
  def keeps_candidates(self) -> bool:
    """Whether keys without a row have their counts kept (to reach `min_count`, or to beat a
    row's score when they compete)."""
    return self.min_count > 1 or self.admission == "compete"

  def to_config(self) -> dict:
    """These settings as JSON-able values (the key dtype by name), for a Keras layer's config."""
    config = dataclasses.asdict(self)
    config["key_dtype"] = self.key_dtype.name
    return config

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> ManagedIds:
    """The settings `to_config` gave, checked again as the constructor checks them."""
    fields = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
      raise ValueError(
        f"ManagedIds config has unknown settings {unknown}; expected some of {sorted(fields)}."
      )
    return cls(**config)

  def check_capacity(self, table_name: str, vocabulary_size: int) -> None:
    """Refuses a table too small to hold the out-of-vocabulary row and one key."""
    if vocabulary_size < 2:
      raise ValueError(
        f"Table {table_name!r}: managed ids need vocabulary_size >= 2 (row 0 is the "
        f"out-of-vocabulary row, the others are given to keys); got {vocabulary_size}."
      )


def _as_dtype(value: Any) -> Any:
  try:
    return tf.as_dtype(value)
  except TypeError:
    return value


def _positive_int(name: str, value: Any) -> int:
  """`value` as a Python int (NumPy integers accepted, as everywhere ints are), if >= 1."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"ManagedIds({name}={value!r}): expected an int >= 1.")
  return int(value)
