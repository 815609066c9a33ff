"""One child process without this package, for the tests that reload exports as a serving
process would: it starts (and imports TensorFlow) once, then runs each script sent to it.

The packages it is given cannot be imported in it (`tpu_embedding`, and `tf_keras` where a
serving process must not need it either): an import raises `ImportError`, so a SavedModel that
needed them fails to load there, and `sys.modules` stays free of them for the scripts to check.
(A SavedModel holding a Keras optimizer's slots needs Keras to load: TF revives the optimizer
through it.) Each script runs in a fresh namespace; what it prints is
returned. A script that raises fails the test that sent it; a child that dies or hangs fails it
too, and the next script gets a new child.
"""

import json
import os
import select
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = """
import contextlib, importlib.abc, io, json, sys, traceback

class Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in sys.argv[1:]:
      raise ImportError(f"{name} is not importable in this serving process")
    return None

sys.meta_path.insert(0, Refuse())
import tensorflow as tf  # once, for every script
replies = sys.stdout
for line in sys.stdin:
  printed = io.StringIO()
  try:
    with contextlib.redirect_stdout(printed):
      exec(compile(json.loads(line), "<script>", "exec"), {"__name__": "__main__"})
    reply = {"printed": printed.getvalue()}
  except BaseException:
    reply = {"printed": printed.getvalue(), "error": traceback.format_exc()}
  replies.write(json.dumps(reply) + "\\n")
  replies.flush()
"""


class TensorFlowOnly:
  """The child: `run(script)` returns what the script printed."""

  def __init__(self, refused: tuple[str, ...] = ("tpu_embedding", "tf_keras")) -> None:
    self._refused = refused
    self._child = None

  def _started(self) -> subprocess.Popen:
    if self._child is None or self._child.poll() is not None:
      self._child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *self._refused],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=""),
      )
    return self._child

  def run(self, script: str, timeout: float = 120) -> str:
    child = self._started()
    child.stdin.write(json.dumps(script) + "\n")
    child.stdin.flush()
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    line = child.stdout.readline() if ready else ""
    if not line:
      self.close()
      raise AssertionError(f"the serving child died or hung ({timeout} s) running:\n{script}")
    reply = json.loads(line)
    assert "error" not in reply, f"{reply['printed'][-2000:]}{reply.get('error', '')[-3000:]}"
    return reply["printed"]

  def close(self) -> None:
    if self._child is not None:
      self._child.kill()
      self._child.wait()
      self._child = None
