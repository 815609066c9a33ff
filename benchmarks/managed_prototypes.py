"""`python -m benchmarks managed --sweep --prototypes [--seeds 3] [--part NAME]`: scores that
`ManagedIds` does not have, tried in a plain-Python map before anyone builds them into the
kernel (issue 45). Not the package's map: a dict-based one written for this screen, fed to the
same TF model as benchmarks/managed_sweep.py's settings (rows given to new keys reset first).

"Absence in own gaps": a row's distance is
counted in its mean gaps between occurrences since its key took the row (count over steps held;
at least 1): a key absent for longer than usual loses its score, one seen as often as before
keeps its count.

`distance_lfu`, as the package scores it: a row's count over its distance (steps since its key was
last seen) to the power `decay`; a new key competes with its count so far (candidate count plus
this step's occurrences). "Newcomers scored like incumbents": a new key seen before (as a
candidate) competes with its count over the steps since it was last seen, as a row does; one
never seen (or pruned) with its count. Candidates, pruning and ties as in docs/managed-ids.md.

"Adaptive": `AdaptiveMap`, a score that learns from the stream how fast to forget (ADAPTIVE).
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

import tpu_embedding
from benchmarks import managed_policies as mp

PROTOTYPES = {  # name: (newcomers scored like incumbents, decay, distance in own gaps)
  "prototype: distance_lfu compete, decay 1": (False, 1.0, False),
  "prototype: distance_lfu compete, newcomers scored like rows, decay 1": (True, 1.0, False),
  "prototype: distance_lfu compete, newcomers scored like rows, decay 0.5": (True, 0.5, False),
  "prototype: absence in own gaps, decay 1": (False, 1.0, True),
  "prototype: absence in own gaps, decay 2": (False, 2.0, True),
  "prototype: distance_lfu compete, decay 0": (False, 0.0, False),  # AdaptiveMap's long memory
}
ADAPTIVE = {  # name: (long memory's decay, short memory's decay, window in steps, by count)
  "prototype: adaptive, decay 0 or 2 by ghost hits, window 10": (0.0, 2.0, 10, False),
  "prototype: adaptive, decay 0 or 2 by ghost hits, window 40": (0.0, 2.0, 40, False),
  "prototype: adaptive, decay 0 or 2 by count-weighed ghosts, window 10": (0.0, 2.0, 10, True),
}
PROTOTYPES.update(ADAPTIVE)


class PrototypeMap:
  """Rows 1.. of a table of `capacity` rows for keys; row 0 for keys without one."""

  def __init__(self, capacity: int, symmetric: bool, decay: float, in_gaps: bool):
    self.capacity, self.symmetric, self.decay, self.in_gaps = capacity, symmetric, decay, in_gaps
    self.row_of, self.key_of, self.count, self.last, self.taken = {}, {}, {}, {}, {}
    self.candidates, self.candidate_last = {}, {}
    self.step = 0

  def _score(self, row: int) -> float:
    distance = self.step - self.last[row]
    if self.in_gaps:  # the absence over the row's mean gap since its key took it, at least 1
      distance = max(1.0, distance * self.count[row] / (self.step - self.taken[row] + 1))
    return self.count[row] / distance**self.decay

  def train(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each key, rows given to new keys) after one training step."""
    self.step += 1
    occurrences = collections.Counter(keys.tolist())
    in_order = list(dict.fromkeys(keys.tolist()))
    for key in in_order:
      if key in self.row_of:
        row = self.row_of[key]
        self.count[row] += occurrences[key]
        self.last[row] = self.step
    new = [k for k in in_order if k not in self.row_of]
    totals = {k: self.candidates.get(k, 0) + occurrences[k] for k in new}
    given = self._admit(new, totals)
    for key, row in given:
      if row in self.key_of:
        del self.row_of[self.key_of[row]]
      self.row_of[key], self.key_of[row] = row, key
      self.count[row], self.last[row], self.taken[row] = totals[key], self.step, self.step
    self._remember(new, totals, {k for k, _ in given})
    return self.lookup(keys), np.array([r for _, r in given], np.int64)

  def _admit(self, new: list, totals: dict) -> list:
    """(key, row) for the new keys given rows: free rows in row order, then victims."""
    scores = dict(totals)
    if self.symmetric:
      for k in new:
        if k in self.candidate_last:
          scores[k] = totals[k] / (self.step - self.candidate_last[k]) ** self.decay
    free = [r for r in range(1, self.capacity) if r not in self.key_of]
    given = list(zip(new, free))
    victims = sorted(
      (r for r in self.key_of if self.last[r] < self.step),
      key=lambda r: (self._score(r), self.last[r], r),
    )
    for key, row in zip(sorted(new[len(free) :], key=lambda k: -scores[k]), victims):
      if scores[key] <= self._score(row):
        break
      given.append((key, row))
    return given

  def _remember(self, new: list, totals: dict, admitted: set) -> None:
    for key in new:
      if key in admitted:
        self.candidates.pop(key, None)
        self.candidate_last.pop(key, None)
      else:
        self.candidates[key], self.candidate_last[key] = totals[key], self.step
    if len(self.candidates) > 2 * self.capacity:
      kept = sorted(self.candidates.items(), key=lambda kv: (-kv[1], kv[0]))[: self.capacity]
      self.candidates = dict(kept)
      self.candidate_last = {k: self.candidate_last[k] for k in self.candidates}

  def lookup(self, keys: np.ndarray) -> np.ndarray:
    return np.array([self.row_of.get(k, 0) for k in keys.tolist()], np.int64)


class AdaptiveMap(PrototypeMap):
  """`distance_lfu` compete whose decay each step is one of two, chosen by which would have
  evicted fewer keys that came back (ARC-like ghosts; deterministic).

  Long memory: decay `long` (0: the count alone, LFU); short memory: decay `short` (2: recency
  weighted). Each step that evicts n rows, each decay's n victims are the n lowest rows under its
  score (ties as in `_admit`; the decay in force picks the rows actually evicted). A key among one
  decay's victims but not the other's goes into that decay's ghosts with the step. A key of a
  later batch found in a decay's ghosts within `window` steps of that step is a miss of that
  decay (it came back: the other would have kept it), counted once and leaves the ghosts; with
  `by_count`, a miss weighs the key's count when it became a ghost (the training its row had),
  else 1. The step's decay is the one with fewer misses over the last `window` steps; on a tie
  the decay of the previous step stays (long memory at first).
  """

  def __init__(self, capacity: int, long: float, short: float, window: int, by_count: bool):
    super().__init__(capacity, False, long, False)
    self.decays, self.window, self.by_count = (long, short), window, by_count
    self.ghosts = ({}, {})  # per decay, {key: (step it would have been evicted, weight)}
    self.misses = collections.deque()  # (step, index of the decay that missed, weight)
    self.choices = []  # the decay in force at each step

  def train(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    step = self.step + 1
    for key in dict.fromkeys(keys.tolist()):
      for i, ghosts in enumerate(self.ghosts):
        if key in ghosts:
          at, weight = ghosts.pop(key)
          if step - at <= self.window:
            self.misses.append((step, i, weight))
    while self.misses and step - self.misses[0][0] >= self.window:
      self.misses.popleft()
    counts = [sum(w for _, i, w in self.misses if i == j) for j in (0, 1)]
    if counts[0] != counts[1]:
      self.decay = self.decays[int(counts[1] < counts[0])]
    self.choices.append(self.decay)
    return super().train(keys)

  def _admit(self, new: list, totals: dict) -> list:
    given = super()._admit(new, totals)
    evicted = sum(row in self.key_of for _, row in given)
    rows = [r for r in self.key_of if self.last[r] < self.step]
    victims = []
    for decay in self.decays:
      order = sorted(
        rows, key=lambda r: (self.count[r] / (self.step - self.last[r]) ** decay, self.last[r], r)
      )
      victims.append({self.key_of[r]: self.count[r] for r in order[:evicted]})
    for i, ghosts in enumerate(self.ghosts):
      for key in victims[i].keys() - victims[1 - i].keys():
        ghosts[key] = (self.step, victims[i][key] if self.by_count else 1)
      for key in [k for k, (s, _) in ghosts.items() if self.step - s > self.window]:
        del ghosts[key]
    return given


class PrototypeFeed(mp.Feed):
  """The rows a `PrototypeMap` per table gives, in a managed table of as many rows whose own map
  never steps; rows given to new keys are reset before the step that reads them."""

  remapped = True

  def __init__(self, variant: str, capacities: dict, full_sizes: dict, seed: int):
    self.variant = variant
    self.layer = mp.model_layer(capacities, tpu_embedding.ManagedIds(), seed)
    kind = AdaptiveMap if variant in ADAPTIVE else PrototypeMap
    self.maps = {name: kind(c, *PROTOTYPES[variant]) for name, c in capacities.items()}
    self._reset = tf.function(self.layer.reset_rows, reduce_retracing=True)
    self.started = False

  def train(self, batch: dict) -> dict:
    if not self.started:  # the tables exist from the first call on
      self.layer({name: tf.zeros([1], tf.int64) for name in batch}, remapped=True)
      self.started = True
    rows, resets = {}, {}
    for name, keys in batch.items():
      rows[name], given = self.maps[name].train(keys.keys)
      resets[name] = tf.constant(given)
    self._reset(resets)
    return {name: tf.constant(r) for name, r in rows.items()}

  def test(self, batch: dict) -> dict:
    return {name: tf.constant(self.maps[name].lookup(k.keys)) for name, k in batch.items()}
