"""`ManagedIds`: how one table manages its own vocabulary (what the user passes); `KeyRowMap`:
what callers ask of that table's map, whichever kind it is."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping, Optional, Protocol

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
      A string-key map holds each string's 64-bit FarmHash fingerprint (`fingerprint`) as its
      key, so its rows cost what int64 rows cost and every save format holds it; two strings
      share a row only if their fingerprints collide: among n distinct strings, with
      probability about n**2 / 2**65 (10**6 strings: 3e-8; 10**8: 3e-4).
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


# ---------------------------------------------------------------------------------------------
# `KeyRowMap`: what callers ask of a managed table's map, whichever kind it is.
#
# Off parameter servers a table has one `IdMap`; under `ParameterServerStrategy` a `ShardedIdMap`
# split with the table's row blocks. Both satisfy this protocol, so the layer, serving and the
# tests call them alike and never ask which one they hold.


class Reset(Protocol):
  """Writes fresh values into the table rows given to new keys, before anything reads them;
  `block`: the table's row block holding all of `rows` (a map split over parameter servers)."""

  def __call__(self, rows: tf.Tensor, block: Optional[int] = None) -> None: ...


class KeyRowMap(Protocol):
  """A table's key -> row map (docs/managed-ids.md); rows are the table's."""

  spec: ManagedIds
  table_name: str
  capacity: int

  @property
  def key_dtype(self) -> tf.DType: ...

  def lookup(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of `keys` (of `key_dtype`: strings, for a string-key map; 0 for keys without a
    row); never admits, evicts or counts."""

  def rows_of(self, keys: tf.Tensor) -> tf.Tensor:
    """`lookup` of the int64 keys the map holds (`as_keys`'s)."""

  def size(self) -> tf.Tensor:
    """How many keys hold a row."""

  def export(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(keys, rows, counts) of every key holding a row, by ascending row; the keys are int64
    (a string-key map's: the strings' fingerprints)."""

  def remap(
    self, keys: tf.Tensor, training: bool, reset: Optional[Reset] = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """(row of each key, rows given to new keys), `keys` being the int64 keys the map holds
    (`as_keys`); with `training` one step of the map, the given rows passed to `reset` before
    any later step can read them."""

  def serving_tables(self) -> list[Any]:
    """The hash tables a serving lookup reads (a SavedModel must hold them)."""

  def reindex(self) -> None:
    """Rebuilds the hash tables from the map's variables, once something else assigned them."""


def as_keys(keys: Any, key_dtype: tf.DType, where: str) -> tf.Tensor:
  """`keys` (of a map taking `key_dtype`) as the int64 keys the map holds: strings as their
  `fingerprint`, narrower integers widened, uint64 keys above 2**63 - 1 refused (int64 cannot
  hold them: they would wrap onto negative keys); `where` starts each error, naming the feature
  and table."""
  keys = tf.convert_to_tensor(keys)
  dtype = keys.dtype
  if not (dtype == tf.string if key_dtype == tf.string else dtype.is_integer):
    wanted = "tf.string keys" if key_dtype == tf.string else "integer keys (int64 or narrower)"
    raise ValueError(
      f"{where} manages its ids with key_dtype {key_dtype.name}, which takes {wanted}; got "
      f"{dtype.name} keys."
    )
  if dtype == tf.string:
    return fingerprint(keys)
  if dtype == tf.uint64:
    keys = _below_int64_max(keys, where)
  return tf.cast(keys, tf.int64) if dtype != tf.int64 else keys


def fingerprint(strings: Any) -> tf.Tensor:
  """Each string's FarmHash Fingerprint64 as int64: the key a string-key map holds for it.

  TF's stable fingerprint (the same in every process, version and platform, and the hash
  `tf.strings.to_hash_bucket_fast` takes modulo its buckets), by a stock op, so a SavedModel
  computes it in its graph. Its 8 little-endian bytes read as one int64 (every platform TF
  runs on is little-endian): all 64 bits kept, where `to_hash_bucket_fast(s, 2**63 - 1)` would
  fold two values onto one.
  """
  strings = tf.convert_to_tensor(strings, tf.string)
  flat = tf.bitcast(tf.fingerprint(tf.reshape(strings, [-1])), tf.int64)
  return tf.reshape(flat, tf.shape(strings))


def _below_int64_max(keys: tf.Tensor, where: str) -> tf.Tensor:
  """uint64 `keys`, checked to fit int64 (eagerly an error listing some; traced, an op)."""
  largest = tf.constant(np.iinfo(np.int64).max, tf.uint64)
  message = (
    f"{where} manages int64 keys: uint64 keys above 2**63 - 1 cannot be held without wrapping "
    "onto negative ones. Map them into int64 first (e.g. tf.bitcast to int64, if the bits "
    "are what identifies a key). Nothing was changed."
  )
  if tf.executing_eagerly():
    too_large = tf.boolean_mask(keys, keys > largest)[:5].numpy().tolist()
    if too_large:
      raise ValueError(f"{message} Offending keys: {too_large}.")
    return keys
  with tf.control_dependencies([tf.debugging.assert_less_equal(keys, largest, message=message)]):
    return tf.identity(keys)
