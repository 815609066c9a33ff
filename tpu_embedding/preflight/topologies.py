"""Cloud TPU generations as data: HBM and SparseCores per chip, and how a slice name counts chips.

Each figure is the one its public source states (quoted in `source`), in the unit it states: a
"GB" stays 10^9 bytes, a "GiB" 2^30, so a plan never assumes more memory than the page promises.
TensorFlow reaches each generation's embedding hardware through one of its mid-level classes:
v4 through `TPUEmbedding` (V1), v5p and v6e through `TPUEmbeddingV2` (SparseCore); v5e has no
embedding hardware, so TF replicates every table there (`TPUEmbeddingV0`). TPU7x (Ironwood) is
not listed: its Cloud page says TensorFlow is not supported on it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

GIB = 2**30
GB = 10**9

# The embedding hardware TF's classes use on a generation (`hardware.ExecutionPath` names).
REPLICATED = "tpu_v0"  # no embedding hardware: every table whole on every chip
V1 = "tpu_v1"  # TPUEmbedding: tables split row by row over all chips (mod sharding)
V2 = "tpu_v2"  # TPUEmbeddingV2: tables stacked, padded and dealt over every SparseCore


@dataclasses.dataclass(frozen=True)
class Generation:
  """One Cloud TPU generation.

  Attributes:
    name: the accelerator-type prefix ("v5p").
    hbm_bytes_per_chip: HBM per chip, in the unit the source states.
    sparse_cores_per_chip: SparseCores per chip (0 where the chip has none).
    cores_per_chip: how many of the slice name's count make one chip (2 where Cloud TPU counts
      TensorCores, as "v5p-8" is 4 chips; 1 where it counts chips).
    embedding: how TF's classes lay tables out there (`REPLICATED`, `V1`, `V2`).
    source: where each figure is stated.
  """

  name: str
  hbm_bytes_per_chip: int
  sparse_cores_per_chip: int
  cores_per_chip: int
  embedding: str
  source: str


GENERATIONS: dict[str, Generation] = {
  g.name: g
  for g in (
    Generation(
      "v4",
      32 * GIB,
      4,
      2,
      V1,
      "https://cloud.google.com/tpu/docs/v4 ('Each TPU v4 chip contains two TensorCores'; "
      "'HBM2 capacity and bandwidth: 32 GiB'); SparseCores: Jouppi et al., 'TPU v4: An "
      "Optically Reconfigurable Supercomputer for Machine Learning with Hardware Support for "
      "Embeddings', ISCA 2023 (arXiv:2304.01433), four SparseCores per chip",
    ),
    Generation(
      "v5e",
      16 * GB,
      0,
      1,
      REPLICATED,
      "https://cloud.google.com/tpu/docs/v5e ('Each v5e chip contains one TensorCore'; "
      "'HBM capacity per chip: 16 GB'; no SparseCore listed)",
    ),
    Generation(
      "v5p",
      95 * GIB,
      4,
      2,
      V2,
      "https://cloud.google.com/tpu/docs/v5p ('HBM capacity per chip (GiB): 95'; 'Number of "
      "TensorCores per chip: 2'; 'Number of SparseCores per chip: 4')",
    ),
    Generation(
      "v6e",
      32 * GB,
      2,
      1,
      V2,
      "https://cloud.google.com/tpu/docs/v6e ('Each v6e chip contains one TensorCore'; 'HBM "
      "capacity per chip: 32 GB'; special feature: SparseCore, count not stated there); "
      "https://docs.jax.dev/en/latest/pallas/tpu/sparsecore.html ('a TPU chip may have 2 or 4 "
      "SparseCores'): 2 for v6e, the figure issue 42's statistics use (not confirmed on a chip)",
    ),
  )
}
# Cloud TPU's API name for v5e slices ("v5litepod-8").
ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True)
class Topology:
  """The chips a plan spreads tables over.

  Attributes:
    name: the Cloud TPU name ("v5p-8") or a description of an explicit topology.
    num_chips: how many chips (one replica each).
    hbm_bytes_per_chip: HBM of each chip.
    sparse_cores_per_chip: SparseCores of each chip.
    embedding: how TF's classes lay tables out (`REPLICATED`, `V1`, `V2`).
  """

  name: str
  num_chips: int
  hbm_bytes_per_chip: int
  sparse_cores_per_chip: int
  embedding: str


def topology(spec: Any) -> Topology:
  """A Topology from a Cloud TPU name ("v5p-8", "v6e-16", "v5litepod-4"), read as Cloud TPU
  reads it, or from an explicit (HBM bytes per chip, chips, SparseCores per chip): SparseCore
  layout (`TPUEmbeddingV2`) when it has SparseCores, every table replicated when it has none."""
  if isinstance(spec, Topology):
    return spec
  if isinstance(spec, str):
    return _named(spec)
  if isinstance(spec, (tuple, list)) and len(spec) == 3:
    hbm, chips, sparse_cores = spec
    check_int("HBM bytes per chip", hbm, 1)
    check_int("num_chips", chips, 1)
    check_int("SparseCores per chip", sparse_cores, 0)
    return Topology(
      f"{chips} chip(s) of {hbm:,} B HBM, {sparse_cores} SparseCore(s) each",
      chips,
      hbm,
      sparse_cores,
      V2 if sparse_cores else REPLICATED,
    )
  raise ValueError(
    f"topology={spec!r}; expected a Cloud TPU name such as 'v5p-8' (generations: "
    f"{', '.join(GENERATIONS)}) or (HBM bytes per chip, chips, SparseCores per chip)."
  )


def _named(name: str) -> Topology:
  match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
  prefix = match and ALIASES.get(match.group(1), match.group(1))
  generation: Optional[Generation] = GENERATIONS.get(prefix) if prefix else None
  if generation is None:
    raise ValueError(
      f"Unknown TPU topology {name!r}; expected '<generation>-<count>' with a generation "
      f"TensorFlow supports: {', '.join(GENERATIONS)} (or 'v5litepod' for v5e). TPU7x "
      "(Ironwood) does not run TensorFlow. Or pass (HBM bytes per chip, chips, SparseCores "
      "per chip)."
    )
  count = int(match.group(2))
  if count < generation.cores_per_chip or count % generation.cores_per_chip:
    raise ValueError(
      f"Topology {name!r}: {generation.name} names count TensorCores, "
      f"{generation.cores_per_chip} a chip, so the count must be a positive multiple of "
      f"{generation.cores_per_chip}."
    )
  return Topology(
    name,
    count // generation.cores_per_chip,
    generation.hbm_bytes_per_chip,
    generation.sparse_cores_per_chip,
    generation.embedding,
  )


def check_int(what: str, value: Any, least: int) -> None:
  """Refuses, naming it, a `value` that is not an int >= `least`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < least:
    raise ValueError(f"{what}={value!r}; expected an int >= {least}.")
