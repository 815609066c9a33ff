"""Tests of `tpu_embedding.preflight.topologies`: Cloud TPU names read into chips, HBM and
SparseCores as Cloud TPU's documentation gives them."""

import pytest

from tpu_embedding.preflight import topologies

GIB = 2**30


@pytest.mark.parametrize(
  "name,chips,hbm,sparse_cores,embedding",
  [
    ("v4-8", 4, 32 * GIB, 4, topologies.V1),
    ("v5p-8", 4, 95 * GIB, 4, topologies.V2),
    ("v5p-128", 64, 95 * GIB, 4, topologies.V2),
    ("v6e-8", 8, 32 * 10**9, 2, topologies.V2),
    ("v5litepod-16", 16, 16 * 10**9, 0, topologies.REPLICATED),
    ("v5e-1", 1, 16 * 10**9, 0, topologies.REPLICATED),
  ],
)
def test_cloud_tpu_names_are_read_as_cloud_tpu_reads_them(
  name, chips, hbm, sparse_cores, embedding
):
  got = topologies.topology(name)
  assert (got.num_chips, got.hbm_bytes_per_chip) == (chips, hbm)
  assert (got.sparse_cores_per_chip, got.embedding) == (sparse_cores, embedding)


def test_every_generation_cites_its_source():
  for generation in topologies.GENERATIONS.values():
    assert "https://cloud.google.com/tpu/docs/" + generation.name in generation.source
