"""Tests of `tpu_embedding.managed_ids.spec`: a `ManagedIds` spec refuses bad settings by name
and takes NumPy integers as Python ints."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.managed_ids import ManagedIds


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
