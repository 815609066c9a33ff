"""Builds the engine's compiled kernels; all other metadata lives in setup.cfg.

The kernels are compiled against the TensorFlow installed in the build environment (pyproject's
build requirements, or the target environment with `pip install --no-build-isolation`). A
machine without a C++ compiler still gets a working package: the engine then runs on TF's own
ops, slower, and says so once.
"""

import sys

import setuptools
from setuptools.command import build_ext


class BuildTensorFlowKernels(build_ext.build_ext):
  """Compiles each extension as a TF op library with the installed TF's flags."""

  def build_extension(self, ext):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

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
    except Exception as e:  # pylint: disable=broad-except  (any compiler or linker failure)
      print(
        f"WARNING: could not compile {ext.name} ({e}); tpu_embedding will use TF ops, "
        "which are slower. Install a C++17 compiler and reinstall to get the kernels.",
        file=sys.stderr,
      )


setuptools.setup(
  ext_modules=[
    setuptools.Extension(
      "tpu_embedding.engine._kernels",
      sources=["tpu_embedding/engine/cc/apply_rows.cc", "tpu_embedding/engine/cc/lookup.cc"],
      depends=["tpu_embedding/engine/cc/kernels.h"],
      language="c++",
    ),
  ],
  cmdclass={"build_ext": BuildTensorFlowKernels},
)
