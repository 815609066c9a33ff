"""A plain-Python reference of a managed-id map, written from docs/managed-ids.md alone.

Dicts and sorted lists, one step at a time: what `tpu_embedding.managed_ids.IdMap` must give for
the same key stream (rows, rows given to new keys, export).
"""

from __future__ import annotations

import collections
import math
from typing import Hashable, Optional, Sequence

import tensorflow as tf


def fingerprints(strings: Sequence[bytes]) -> list[int]:
  """The keys a string-key map holds for `strings`: each one's FarmHash Fingerprint64 (TF's
  stable `tf.fingerprint`, the one thing taken from TF here), its 8 little-endian bytes read as
  a signed int64. Feed these to `ReferenceMap` for a string-key map."""
  raw = tf.fingerprint(tf.constant(list(strings), tf.string)).numpy()
  return [int.from_bytes(bytes(row), "little", signed=True) for row in raw]


class ReferenceMap:
  def __init__(
    self,
    capacity: int,
    eviction: str = "lfu",
    min_count: int = 1,
    ttl_steps: Optional[int] = None,
    half_life: int = 1000,
    candidate_capacity: Optional[int] = None,
    admission: Optional[str] = None,
    distance_decay: float = 1.0,
  ):
    self.capacity, self.eviction, self.min_count = capacity, eviction, min_count
    if admission is None:  # ManagedIds' default: compete where rows have a score
      admission = "compete" if eviction in ("lfu", "distance_lfu") else "always"
    self.admission, self.distance_decay = admission, distance_decay
    self.keeps_candidates = min_count > 1 or admission == "compete"
    self.ttl_steps, self.half_life = ttl_steps, half_life
    self.candidate_capacity = candidate_capacity or capacity
    self.row_of: dict = {}
    self.key_of: dict = {}
    self.count: dict = {}  # row -> (count, epoch of last update)
    self.last: dict = {}  # row -> step last seen
    self.candidates: dict = {}
    self.step = 0

  def aged(self, row: int, epoch: int) -> int:
    count, at = self.count[row]
    if self.eviction == "distance_lfu":  # never halved
      return count
    return count >> min(epoch - at, 62)

  def score(self, row: int, step: int, epoch: int):
    """What orders victims first, and what a competing new key must beat."""
    if self.eviction == "distance_lfu":
      distance = float(step - self.last[row])
      power = 1.0
      for _ in range(int(self.distance_decay)):
        power *= distance
      if self.distance_decay % 1:
        power *= math.sqrt(distance)
      return self.count[row][0] / power
    return self.aged(row, epoch)

  def lookup(self, keys: Sequence[Hashable]) -> list[int]:
    return [self.row_of.get(k, 0) for k in keys]

  def train(self, keys: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    self.step += 1
    step, epoch = self.step, self.step // self.half_life
    occurrences = collections.Counter(keys)
    in_order = list(dict.fromkeys(keys))
    for key in in_order:
      if key in self.row_of:
        row = self.row_of[key]
        self.count[row] = (self.aged(row, epoch) + occurrences[key], epoch)
        self.last[row] = step
    new = [k for k in in_order if k not in self.row_of]
    if self.eviction == "ttl":
      for row in sorted(self.key_of):
        if step - self.last[row] >= self.ttl_steps:
          self._free(row)
    totals = {k: self.candidates.get(k, 0) + occurrences[k] for k in new}
    if not self.keeps_candidates:
      totals = {k: occurrences[k] for k in new}
    eligible = [k for k in new if totals[k] >= self.min_count]
    free = [r for r in range(1, self.capacity) if r not in self.key_of]
    given = list(zip(eligible, free))
    given += self._admitted(eligible[len(free) :], totals, self._victims(step, epoch), step, epoch)
    for key, row in given:
      if row in self.key_of:
        self._free(row)
      self.row_of[key], self.key_of[row] = row, key
      self.count[row], self.last[row] = (totals[key], epoch), step
    if self.keeps_candidates:
      self._remember_candidates(new, totals, {k for k, _ in given})
    return self.lookup(keys), [r for _, r in given]

  def _victims(self, step: int, epoch: int) -> list[int]:
    """Rows that may be given away this step, the first to go first."""
    victims = [r for r in self.key_of if self.last[r] < step]
    if self.eviction in ("lfu", "distance_lfu"):
      return sorted(victims, key=lambda r: (self.score(r, step, epoch), self.last[r], r))
    return sorted(victims, key=lambda r: (self.last[r], r))

  def _admitted(self, rest: list, totals: dict, victims: list[int], step: int, epoch: int) -> list:
    """(key, row) for the new keys beyond the free rows: each takes the next victim; competing,
    the strongest new keys meet the weakest rows first and one takes a row only if its count
    beats the row's score (ties keep the row's key)."""
    if self.admission != "compete":
      return list(zip(rest, victims))
    given = []
    for key, row in zip(sorted(rest, key=lambda k: -totals[k]), victims):  # stable sort
      if totals[key] <= self.score(row, step, epoch):
        break
      given.append((key, row))
    return given

  def _remember_candidates(self, new: list, totals: dict, admitted: set) -> None:
    """Counts of the new keys not admitted (min_count > 1, or lost a competition), the most
    frequent kept."""
    for key in new:
      if key in admitted:
        self.candidates.pop(key, None)
      else:
        self.candidates[key] = totals[key]
    if len(self.candidates) > 2 * self.candidate_capacity:
      kept = sorted(self.candidates.items(), key=lambda kv: (-kv[1], kv[0]))
      self.candidates = dict(kept[: self.candidate_capacity])

  def _free(self, row: int) -> None:
    del self.row_of[self.key_of.pop(row)]
    del self.count[row], self.last[row]

  def export(self) -> tuple[list, list[int], list[int]]:
    rows = sorted(self.key_of)
    epoch = self.step // self.half_life
    return [self.key_of[r] for r in rows], rows, [self.aged(r, epoch) for r in rows]
