"""Builds the engine's compiled kernels; all other metadata lives in setup.cfg.

The kernels are compiled against the TensorFlow installed in the build environment (pyproject's
build requirements, or the target environment with `pip install --no-build-isolation`). A
machine without a C++ compiler still gets a working package: the engine then runs on TF's own
ops, slower, and says so once.
"""

import pathlib
import sys

import setuptools
from setuptools.command import build_ext


class BuildTensorFlowKernels(build_ext.build_ext):
  """Compiles each extension as a TF op library with the installed TF's flags."""

  def build_extension(self, ext):
    import tensorflow as tf

    ext.include_dirs.append(".")  # "tpu_embedding/engine/cc/kernels.h"
    ext.extra_compile_args = tf.sysconfig.get_compile_flags() + [
      "-O3",
      "-g0",
      "-fno-math-errno",
      "-ffp-contract=off",
      "-Wno-deprecated-declarations",
    ]
    ext.extra_link_args = tf.sysconfig.get_link_flags()
    try:
      super().build_extension(ext)
      # The kernels load only under this TF (tpu_embedding/engine/native.py reads this record).
      _record(self.get_ext_fullpath(ext.name)).write_text(tf.__version__ + "\n")
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
      ],
      depends=["tpu_embedding/engine/cc/kernels.h"],
      language="c++",
    ),
  ],
  cmdclass={"build_ext": BuildTensorFlowKernels},
)
