"""The adapters to TF's internals refuse a TensorFlow they were not checked against.

Run by the version matrix (.ci/matrix) under every supported TF: the first test fails on any TF
whose minor version the adapters do not list, before a moved internal could fail elsewhere.
"""

import importlib.metadata

import pytest
import tensorflow as tf

from tpu_embedding import tf_versions

from child_process import run_python

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

ADAPTERS = ("tpu_embedding.tf_internals", "tpu_embedding.tf_mid_level", "tpu_embedding.tf_restore")


def test_the_installed_tensorflow_is_one_the_adapters_were_checked_against():
  minor = tf_versions.minor_version(tf.__version__)
  assert minor in tf_versions.CHECKED_AGAINST, (
    f"TF {tf.__version__} is not in tf_versions.CHECKED_AGAINST "
    f"{sorted(tf_versions.CHECKED_AGAINST)}: run the version matrix on it, fix what moved in "
    "tf_internals / tf_mid_level / tf_restore, then add it."
  )


@pytest.mark.parametrize(
  "version, minor", [("2.16.2", "2.16"), ("2.22.0rc1", "2.22"), ("2.15.0.post1", "2.15")]
)
def test_minor_version(version, minor):
  assert tf_versions.minor_version(version) == minor


def test_an_unchecked_version_is_refused_naming_it_and_the_checked_ones(monkeypatch):
  monkeypatch.delenv(tf_versions.ALLOW_UNCHECKED, raising=False)
  with pytest.raises(tf_versions.UncheckedTensorFlow) as refused:
    tf_versions.require_checked("tpu_embedding.tf_internals", "2.22.0")
  message = str(refused.value)
  assert "tpu_embedding.tf_internals" in message and "TensorFlow 2.22.0" in message
  assert ", ".join(tf_versions.CHECKED_AGAINST) in message


def test_every_checked_minor_version_and_its_patch_releases_pass(monkeypatch):
  monkeypatch.delenv(tf_versions.ALLOW_UNCHECKED, raising=False)
  for minor, release in tf_versions.CHECKED_AGAINST.items():
    assert tf_versions.minor_version(release) == minor
    tf_versions.require_checked("adapter", release)
    tf_versions.require_checked("adapter", f"{minor}.9")


def test_the_user_may_run_an_unchecked_version_with_a_warning(monkeypatch):
  monkeypatch.setenv(tf_versions.ALLOW_UNCHECKED, "1")
  with pytest.warns(RuntimeWarning, match="checked against TensorFlow"):
    tf_versions.require_checked("adapter", "2.99.0")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_importing_an_adapter_under_an_unchecked_tensorflow_fails(adapter):
  # A fresh interpreter whose TensorFlow reports a version no adapter was checked against.
  out = run_python(
    "import os\n"
    f"os.environ.pop({tf_versions.ALLOW_UNCHECKED!r}, None)\n"
    "import tensorflow as tf\n"
    "tf.__version__ = '2.99.0'\n"
    "from tpu_embedding import tf_versions\n"
    "try:\n"
    f"  import {adapter}\n"
    "except tf_versions.UncheckedTensorFlow as e:\n"
    "  print('REFUSED', e)\n",
    timeout=180,
  )
  assert out.startswith("REFUSED ") and "2.99.0" in out, out


@pytest.mark.parametrize(
  "version, supported",
  [("2.15.0", False), ("3.14.2", False), ("3.15.1", True), ("3.16.0", True), ("4.0.0", True)],
)
def test_the_keras_layers_need_keras_3_15(version, supported):
  assert tf_versions.supports_keras(version) == supported
  if supported:
    tf_versions.require_keras(version)
    return
  with pytest.raises(tf_versions.UnsupportedKeras) as refused:
    tf_versions.require_keras(version)
  assert f"this is Keras {version}" in str(refused.value)
  assert "needs Keras 3.15 or later" in str(refused.value)
  assert "tpu_embedding.TPUEmbedding" in str(refused.value)  # what to use instead


@pytest.mark.parametrize("reported", [None, "2.15.0"])
def test_importing_the_keras_layers_under_an_older_keras_fails(reported):
  # In a fresh interpreter: the installed Keras (TF 2.15's is Keras 2), or one that reports 2.15.
  out = run_python(
    "import keras\n"
    + (f"keras.__version__ = {reported!r}\n" if reported else "")
    + "from tpu_embedding import tf_versions\n"
    "try:\n"
    "  import tpu_embedding.keras\n"
    "  print('IMPORTED', keras.__version__)\n"
    "except tf_versions.UnsupportedKeras as e:\n"
    "  print('REFUSED', e)\n",
    timeout=180,
  )
  version = reported or importlib.metadata.version("keras")
  if tf_versions.supports_keras(version):
    assert out.startswith("IMPORTED "), out
  else:
    assert out.startswith("REFUSED ") and f"this is Keras {version}" in out, out
