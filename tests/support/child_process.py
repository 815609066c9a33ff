"""Runs a Python script in a child process with this tree first on the path; finds what
TensorFlow's own logging printed in a child's output.

For inputs that once aborted the process (a failed CHECK in a kernel): an abort in the child fails
the test that started it instead of killing pytest.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(script: str, timeout: int) -> str:
  """The child's stdout, once it has exited cleanly; fails the test with its output otherwise."""
  child = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3"),
  )
  assert child.returncode == 0, (
    f"the child died ({child.returncode}):\n{child.stdout[-2000:]}{child.stderr[-3000:]}"
  )
  return child.stdout


# A line of TensorFlow's C++ logging ("I0000 00:00:1795473002.058656    6704 port.cc:153] ...")
# or absl's notice printed before it is set up.
TENSORFLOW_LOG_LINE = re.compile(r"^([IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]|WARNING: All log messages)")


def tensorflow_log_lines(output: str) -> list[str]:
  """The lines of `output` that TensorFlow's own logging printed."""
  return [line for line in output.splitlines() if TENSORFLOW_LOG_LINE.match(line)]
