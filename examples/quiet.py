"""TensorFlow's start-up messages kept out of the examples' output unless the user wants them.

Importing TensorFlow prints lines that say nothing about the example (CUDA probes on a machine
without a GPU, CPU-feature and oneDNN notices), some of them before TensorFlow's own log level
applies, and graph optimizers warn later about the layer's input checks. The examples import
TensorFlow inside `tensorflow_start_up(...)`; `--verbose`, or a TF_CPP_MIN_LOG_LEVEL the user
set, shows everything as TensorFlow prints it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator

LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"


@contextlib.contextmanager
def tensorflow_start_up(verbose: bool) -> Iterator[None]:
  """Unless `verbose` or the user set TensorFlow's log level, turns TensorFlow's C++ logging off
  for this process (and the processes it starts) and drops what the imports inside the block
  write to stderr (shown if they fail)."""
  if verbose or LOG_LEVEL in os.environ:
    yield
    return
  os.environ[LOG_LEVEL] = "3"
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    except BaseException:
      sys.stderr.flush()
      captured.seek(0)
      os.write(saved, captured.read())
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
