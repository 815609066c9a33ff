"""Tests of `tpu_embedding.preflight.progress`: the progress line and the bar drawn over a
report's batches."""

import io

from tpu_embedding.preflight import progress


def test_the_progress_line():
  assert progress.line(12, 30, "batches") == f"[{'#' * 12}{'.' * 18}] 12/30 batches"
  assert progress.line(7, None, "batches") == "7 batches"
  stream = io.StringIO()
  assert list(progress.progress(range(2), stream=stream)) == [0, 1]
  assert stream.getvalue() == "\r1 batches\r2 batches\r2 batches\n"
