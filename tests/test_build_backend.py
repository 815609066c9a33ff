"""The build backend asks for a TensorFlow to build with only where the target has none.

(Where it has one, the probe imports TensorFlow in a child: `.ci/fresh_install` covers that.)"""

import pathlib
import sys
import venv

import build_backend

ROOT = pathlib.Path(__file__).parents[1]


def test_a_target_without_tensorflow_gets_the_newest_supported_to_build_with(tmp_path, monkeypatch):
  venv.create(tmp_path / "bare", with_pip=False)  # what `python -m build` runs the hooks in
  monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "bin" / "python"))
  assert build_backend.installed_tensorflow() is None
  assert build_backend.tensorflow_to_build_with() == [build_backend.NEWEST_TENSORFLOW]


def test_the_newest_supported_tensorflow_is_the_one_make_installs():
  pins = (ROOT / "constraints.txt").read_text().splitlines()
  assert build_backend.NEWEST_TENSORFLOW in pins
