"""Which dtype for which table: what each low-precision table changes in a model's outputs.

`export_for_serving(table_dtype=...)` trades each table's bytes for error in the served outputs;
how much error depends on the model and its data. `serving_error_by_dtype` measures it on a
sample of the user's requests, one table and one dtype at a time, through the very lookups an
export with that table at that dtype would serve, so that a user can pick per table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tpu_embedding import quantization, serving, tf_internals
from tpu_embedding.engine.lookup import reading_tables


@dataclasses.dataclass(frozen=True)
class OutputError:
  """|output with one table lowered - output with every table float32| over a sample's outputs."""

  max_abs: float
  mean_abs: float


def serving_error_by_dtype(
  model: tf.Module,
  signature: Any,
  sample: Mapping[str, Any],
  dtypes: Sequence[str] = tuple(quantization.FORMATS),
) -> dict[str, dict[str, OutputError]]:
  """{table: {dtype: OutputError}} for each table `signature` reads, each dtype of `dtypes`.

  Args:
    model: the model to export (as for `export_for_serving`).
    signature: a `tf.function` with an input_signature, as given to `export_for_serving`.
    sample: keyword arguments of `signature`: a sample of the requests to serve.
    dtypes: the low-precision dtypes to measure ("float16", "bfloat16", "int8", "int4").

  Every output of the signature counts, each value once. Nothing of `model` is changed; each
  (table, dtype) is a trace of `signature` and a lowered copy of that table, made and dropped.
  """
  formats = {dtype: quantization.format_of(dtype, "dtypes") for dtype in dtypes}
  formats = {dtype: format for dtype, format in formats.items() if format is not None}
  reference = _outputs(signature, sample, {})
  report: dict[str, dict[str, OutputError]] = {}
  for layer in serving.embedding_layers(model):
    for table, entries in sorted(layer.variables_by_table.items()):
      values = tf.convert_to_tensor(entries["parameters"])
      for dtype, format in formats.items():
        lowered = quantization.LowPrecisionTable(table, values, format)
        outputs = _outputs(signature, sample, {table: lowered})
        if outputs is None:
          break  # the signature does not read this table
        difference = np.abs(outputs - reference)
        report.setdefault(table, {})[dtype] = OutputError(
          float(difference.max()), float(difference.mean())
        )
  return report


def _outputs(signature: Any, sample: Mapping[str, Any], tables: Mapping[str, Any]) -> Any:
  """The signature's outputs (all values, float64) traced to read `tables`; None if the trace
  reads none of them. Traced as inference, not as an export: an export's managed-id lookups
  read hash tables filled only when it is saved."""
  function = tf_internals.untraced_copy(signature)
  with reading_tables(tables):
    outputs = function(**sample)
  read = {v.ref() for v in function.get_concrete_function().variables}
  if tables and not any(v.ref() in read for t in tables.values() for v in t.variables):
    return None
  flat = [np.asarray(o, np.float64).ravel() for o in tf.nest.flatten(outputs)]
  return np.concatenate(flat)
