"""Which TensorFlow versions the adapters to TF's internals were checked against.

The package reads TF internals only through `tf_mid_level`, `tf_restore` and `tf_internals`.
Each was checked (its tests run, with the version matrix `.ci/matrix`) against the TF releases in
`CHECKED_AGAINST`; TF changes internals between minor versions, not in patch releases, so a
minor version is checked as a whole (docs/compatibility.md says what differs between them).
Importing an adapter under any other TF raises
`UncheckedTensorFlow`: a moved internal would otherwise fail later, inside a user's training
step or restore, or silently train wrongly. `TPU_EMBEDDING_ALLOW_UNCHECKED_TF=1` turns the
refusal into one warning, for someone trying a newer TF at their own risk.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import tensorflow as tf

# {minor version: the release the matrix ran}; docs/compatibility.md says what was run.
CHECKED_AGAINST = {
  "2.15": "2.15.1",
  "2.16": "2.16.2",
  "2.17": "2.17.1",
  "2.18": "2.18.1",
  "2.19": "2.19.1",
  "2.20": "2.20.0",
  "2.21": "2.21.0",
}
ALLOW_UNCHECKED = "TPU_EMBEDDING_ALLOW_UNCHECKED_TF"


# `tpu_embedding.keras` was checked against Keras 3.15 (it reads Keras internals: symbolic
# tracing, saving); older Keras 3 releases were not run, and TF 2.15 comes with Keras 2.
KERAS_MINIMUM = (3, 15)


class UncheckedTensorFlow(ImportError):
  """The installed TensorFlow is not one the adapters to its internals were checked against."""


class UnsupportedKeras(ImportError):
  """The installed Keras is older than the Keras 3 that `tpu_embedding.keras` needs."""


def minor_version(version: str) -> str:
  """The minor version of a TF version string: 2.16.2 -> 2.16, 2.22.0rc1 -> 2.22."""
  return ".".join(version.split(".")[:2])


def supports_keras(version: str) -> bool:
  """Whether `tpu_embedding.keras` runs with the Keras (the `keras` package) of `version`."""
  return tuple(int(part) for part in version.split(".")[:2]) >= KERAS_MINIMUM


def require_keras(version: str) -> None:
  """Raises `UnsupportedKeras` unless `version` (of the `keras` package) is at least
  `KERAS_MINIMUM`: the tf-keras layers (`tpu_embedding.TPUEmbedding`) need no Keras 3."""
  if supports_keras(version):
    return
  minimum = ".".join(map(str, KERAS_MINIMUM))
  raise UnsupportedKeras(
    f"tpu_embedding.keras needs Keras {minimum} or later (Python 3.11+); this is Keras "
    f"{version}{' (TensorFlow 2.15 comes with Keras 2)' if version.startswith('2.') else ''}. "
    f"Install keras>={minimum} with TensorFlow 2.16 or later, or use the tf-keras layers "
    "(tpu_embedding.TPUEmbedding), which every supported TensorFlow runs."
  )


def require_checked(adapter: str, version: Optional[str] = None) -> None:
  """Raises `UncheckedTensorFlow` unless `version` (default: the installed TF's) is of a minor
  version `adapter` was checked against; if the user allowed unchecked versions, warns instead."""
  version = version or tf.__version__
  if minor_version(version) in CHECKED_AGAINST:
    return
  message = (
    f"{adapter} reads TensorFlow internals and was checked against TensorFlow "
    f"{', '.join(CHECKED_AGAINST)}; this is TensorFlow {version}. Install one of those (see "
    "docs/compatibility.md), or set "
    f"{ALLOW_UNCHECKED}=1 to run unchecked at your own risk."
  )
  if os.environ.get(ALLOW_UNCHECKED) == "1":
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return
  raise UncheckedTensorFlow(message)
