"""The package's build backend: setuptools's, asking for TensorFlow only where a build needs it.

The kernels are compiled against the TensorFlow of the environment being installed into (see
setup.py), so pip's isolated build environment needs no TensorFlow of its own: `pip install .`
into an environment holding TF 2.16 builds for 2.16 and downloads no other TensorFlow. Only a
wheel built where that environment has none (`python -m build`, or pip filling a fresh
environment) gets TensorFlow in its build environment, the newest supported one, which pip then
also picks for the fresh environment. An sdist never needs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403 (every other hook as setuptools has it)

# What a wheel built without a target TensorFlow compiles against: the newest supported (the
# pin of constraints.txt); its kernels load only under this version (engine/native.py).
NEWEST_TENSORFLOW = "tensorflow==2.21.0"

_PROBE = (
  "import json, tensorflow as tf; print(json.dumps([tf.__version__, "
  "tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))"
)


def installed_tensorflow() -> Optional[tuple[str, list[str], list[str]]]:
  """(version, compile flags, link flags) of the TensorFlow of the environment being installed
  into, or None where it has none.

  pip runs the build with that environment's interpreter but puts its own build environment
  first through PYTHONPATH; `-I` ignores PYTHONPATH, so the child sees only the target's
  packages. (`python -m build` runs it in a fresh environment of its own: no TensorFlow.)"""
  child = subprocess.run(
    [sys.executable, "-I", "-c", _PROBE], capture_output=True, text=True, check=False
  )
  if child.returncode != 0:
    return None
  version, compile_flags, link_flags = json.loads(child.stdout.strip().splitlines()[-1])
  return version, compile_flags, link_flags


def tensorflow_to_build_with() -> list[str]:
  """What a wheel's build environment needs beyond pyproject's: a TensorFlow where the target
  has none."""
  return [] if installed_tensorflow() else [NEWEST_TENSORFLOW]


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
  return build_meta.get_requires_for_build_wheel(config_settings) + tensorflow_to_build_with()


def get_requires_for_build_editable(config_settings=None) -> list[str]:
  requires = build_meta.get_requires_for_build_editable(config_settings)
  return requires + tensorflow_to_build_with()
