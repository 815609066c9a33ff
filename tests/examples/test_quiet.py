"""`examples.quiet`: TensorFlow's start-up messages dropped unless asked for, never an error's."""

import os
import subprocess
import sys

import pytest

from child_process import ROOT

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

SCRIPT = """
import os, sys
from examples import quiet
with quiet.tensorflow_start_up(verbose={verbose}):
  os.write(2, b"native start-up message\\n")
  print("python start-up message", file=sys.stderr)
  if {fail}:
    raise ImportError("a broken installation")
print(os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
print("the example's own error", file=sys.stderr)
"""


def _run(verbose: bool, fail: bool = False, log_level=None) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  if log_level is not None:
    env["TF_CPP_MIN_LOG_LEVEL"] = log_level
  return subprocess.run(
    [sys.executable, "-c", SCRIPT.format(verbose=verbose, fail=fail)],
    capture_output=True,
    text=True,
    timeout=60,
    cwd=ROOT,
    env=env,
  )


def test_start_up_messages_are_dropped_and_later_ones_kept():
  result = _run(verbose=False)
  assert result.returncode == 0, result.stderr
  assert result.stderr == "the example's own error\n"
  assert result.stdout == "3\n"  # TensorFlow's C++ log level for the rest of the run


@pytest.mark.parametrize("verbose, log_level", [(True, None), (False, "1")])
def test_verbose_or_a_log_level_the_user_set_shows_everything(verbose, log_level):
  result = _run(verbose=verbose, log_level=log_level)
  assert result.returncode == 0, result.stderr
  assert result.stderr == (
    "native start-up message\npython start-up message\nthe example's own error\n"
  )
  assert result.stdout == f"{log_level}\n"


def test_a_failing_import_shows_what_it_printed_and_its_error():
  result = _run(verbose=False, fail=True)
  assert result.returncode == 1
  assert result.stderr.startswith("native start-up message\npython start-up message\n")
  assert "ImportError: a broken installation" in result.stderr
  assert result.stdout == ""
