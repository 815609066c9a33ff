"""Tests of `tpu_embedding.managed_ids.spec`: a `ManagedIds` spec refuses bad settings by name
and takes NumPy integers as Python ints; string keys enter a map as
fingerprints."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.managed_ids import ManagedIds
from tpu_embedding.managed_ids.spec import as_keys, fingerprint

from managed_ids_reference import fingerprints


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(eviction="random"), "unknown eviction policy"),
    (dict(min_count=0), "min_count=0"),
    (dict(key_dtype=tf.float32), "key_dtype"),
    (dict(eviction="ttl"), "ttl_steps=None"),
    (dict(ttl_steps=3), "only used with eviction='ttl'"),
    (dict(reset_every_steps=0), r"reset_every_steps=0\): expected an int >= 1"),
    (dict(admission="maybe"), "admission=.maybe.*expected one of"),
    (dict(eviction="lru", admission="compete"), "needs a scored eviction policy"),
    (dict(eviction="distance_lfu", distance_decay=0.7), "distance_decay=0.7.*expected one of"),
  ],
)
def test_bad_specs_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ManagedIds(**kwargs)


def test_numpy_integers_are_taken_as_python_ints():
  spec = ManagedIds(
    eviction="ttl", min_count=np.int64(2), ttl_steps=np.int32(3), candidate_capacity=np.uint8(4)
  )
  assert spec == ManagedIds(eviction="ttl", min_count=2, ttl_steps=3, candidate_capacity=4)
  assert type(spec.to_config()["min_count"]) is int  # JSON-able in a Keras config
  with pytest.raises(ValueError, match=r"min_count=np.True_\): expected an int >= 1"):
    ManagedIds(min_count=np.bool_(True))


def test_string_keys_enter_a_map_as_their_stable_64_bit_fingerprints():
  """The values are FarmHash Fingerprint64's (stable across processes and versions: a change
  here orphans every saved string-key map); taken modulo n as unsigned, they are
  `to_hash_bucket_fast`'s buckets of the strings, which placed them in sharded maps before."""
  strings = tf.constant([[b"apple", b""], [b"k\x00y", b"x" * 100]])
  keys = as_keys(strings, tf.string, "t")
  assert keys.dtype == tf.int64 and keys.shape == [2, 2]
  assert keys.numpy().ravel().tolist() == fingerprints(strings.numpy().ravel().tolist())
  assert fingerprint([b""]).numpy().tolist() == [-7286425919675154353]
  unsigned = keys.numpy().ravel().astype(np.uint64)
  for n in (2, 3, 7, 1000):
    buckets = tf.strings.to_hash_bucket_fast(tf.reshape(strings, [-1]), n).numpy()
    assert (unsigned % np.uint64(n)).tolist() == buckets.tolist()


def test_documented_collision_odds_are_n_squared_over_2_to_the_65():
  """Among n distinct strings, P(some two share a fingerprint) ~ n(n - 1) / 2 / 2**64: the
  figures in `ManagedIds`' docstring and docs/managed-ids.md, to one significant digit."""
  docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "managed-ids.md")
  with open(docs) as f:
    page = f.read()
  figures = [(int(n), float(p)) for p, n in re.findall(r"(\de-\d+)\s+for\s+10\^(\d+)", page)]
  figures += [
    (int(n), float(p))
    for n, p in re.findall(r"10\*\*(\d+)(?: strings)?: (\de-\d+)", ManagedIds.__doc__)
  ]
  assert len(figures) >= 6
  for exponent, stated in figures:
    n = 10**exponent
    assert f"{n * (n - 1) / 2 / 2**64:.0e}" == f"{stated:.0e}", (exponent, stated)
