"""Runs a Python script in a child process with this tree first on the path.

For inputs that once aborted the process (a failed CHECK in a kernel): an abort in the child fails
the test that started it instead of killing pytest.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
