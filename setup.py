"""Builds the engine's compiled kernels; all other metadata lives in setup.cfg.

The kernels are compiled against the TensorFlow the package will run under: the one installed
where it is being installed, found by asking the installing interpreter outside pip's isolated
build environment (`build_backend.installed_tensorflow`), so that a plain `pip install .` into an
environment holding TF 2.16 builds for 2.16. Only where that environment has no TensorFlow
(`python -m build`, or pip installing TF alongside) do they compile against the build
environment's, which the build backend then asks for (the newest supported TF); they then load
only under that TF. A machine without a C++ compiler still gets a working package: the engine
then runs on TF's own ops, slower, and says so once.
"""

import pathlib
import sys

import setuptools
from setuptools.command import build_ext

from build_backend import installed_tensorflow


class BuildTensorFlowKernels(build_ext.build_ext):
  """Compiles each extension as a TF op library with the installed TF's flags."""

  def build_extension(self, ext):
    version, compile_flags, link_flags = _target_tensorflow()
    print(f"compiling {ext.name} against TensorFlow {version}", file=sys.stderr)
    ext.include_dirs.append(".")  # "tpu_embedding/engine/cc/kernels.h"
    ext.extra_compile_args = compile_flags + [
      "-O3",
      "-g0",
      "-fno-math-errno",
      "-ffp-contract=off",
      "-Wno-deprecated-declarations",
    ]
    ext.extra_link_args = link_flags
    try:
      super().build_extension(ext)
      # The kernels load only under this TF (tpu_embedding/engine/native.py reads this record).
      _record(self.get_ext_fullpath(ext.name)).write_text(version + "\n")
    except Exception as e:  # any compiler or linker failure
      print(
        f"WARNING: could not compile {ext.name} ({e}); tpu_embedding will use TF ops, "
        "which are slower. Install a C++17 compiler and reinstall to get the kernels.",
        file=sys.stderr,
      )

  def copy_extensions_to_source(self):
    """--inplace and editable installs: each library's record goes beside it too."""
    super().copy_extensions_to_source()
    build_py = self.get_finalized_command("build_py")
    for ext in self.extensions:
      inplace, built = self._get_inplace_equivalent(build_py, ext)
      if _record(built).exists():
        self.copy_file(str(_record(built)), str(_record(inplace)))


def _target_tensorflow() -> tuple[str, list[str], list[str]]:
  """(version, compile flags, link flags) of the TF of the environment being installed into, or
  where it has none, of the build environment's own TF (this process's)."""
  installed = installed_tensorflow()
  if installed is not None:
    return installed
  import tensorflow as tf

  return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def _record(library: str) -> pathlib.Path:
  """Where the TF version a kernel library was built against is recorded: beside it."""
  return pathlib.Path(library).with_name("_kernels_tf_version.txt")


setuptools.setup(
  ext_modules=[
    setuptools.Extension(
      "tpu_embedding.engine._kernels",
      sources=[
        "tpu_embedding/engine/cc/apply_rows.cc",
        "tpu_embedding/engine/cc/lookup.cc",
        "tpu_embedding/engine/cc/managed_ids.cc",
        "tpu_embedding/engine/cc/reset_rows.cc",
      ],
      depends=["tpu_embedding/engine/cc/kernels.h"],
      language="c++",
    ),
  ],
  cmdclass={"build_ext": BuildTensorFlowKernels},
)
