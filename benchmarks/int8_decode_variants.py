"""int8 serving lookup: other graphs for the decode, each against the float32 gather (issue 47).

The serving benchmark's model (benchmarks/serving_latency.py, default case: tables 100,000 and
20,000 rows x 32) is exported once at float32 and once at int8 per variant of
`quantization.Rowwise`'s decode (patched in that export's own process; the float32 export and
the loading process never see the patch). All exports are then loaded in one fresh process that
imports only TensorFlow and called in turn, call by call, on the same fresh uniform ids at batch
1, 64 and 1024; it prints each export's p50 and its ratio to float32's, and whether each int8
export gives the same bits as the current one (its whole decoded tables, through its own decode,
and its scores of one request of 1024).

Variants (int8 only; per table, after the gather of the fused rows [n, words + 2]):
  current      split, bitcast, reshape, cast, multiply, add (the shipped decode)
  slices       three strided slices instead of the split
  pair         split into words and a [n, 2] pair, scale and bias sliced from the pair
  late_reshape multiply and add on [n, words, 4] codes with [n, 1, 1] scale and bias, then reshape
  all_bytes    cast every byte of the fused row (scale and bias bytes too), slice the codes after
  separate     codes uint8 [rows, dim] and (scale, bias) [rows, 2] in two variables, two gathers
  xla          the current decode inside a tf.function(jit_compile=True) (XLA contracts the
               multiply-add into a fused multiply-add: not the same bits)

Usage: python benchmarks/int8_decode_variants.py [--seconds S] [--variants a,b,...]
(S seconds of calls per batch size, default 20.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("current", "slices", "pair", "late_reshape", "all_bytes", "separate", "xla")


def _words(rows):
  return rows.shape[1] - 2


def _trim(values, dim):
  """The first `dim` columns (the code bytes are padded to a multiple of 4), as the shipped decode
  does: no op where there is no padding."""
  return values if values.shape[1] == dim else values[:, :dim]


def _slices(self, parts, dim):
  rows = parts["rows"]
  w = _words(rows)
  codes = _trim(tf.reshape(tf.bitcast(rows[:, :w], tf.uint8), [-1, 4 * w]), dim)
  return tf.cast(codes, tf.float32) * rows[:, w : w + 1] + rows[:, w + 1 :]


def _pair(self, parts, dim):
  rows = parts["rows"]
  w = _words(rows)
  words, scale_bias = tf.split(rows, [w, 2], axis=1)
  codes = _trim(tf.reshape(tf.bitcast(words, tf.uint8), [-1, 4 * w]), dim)
  return tf.cast(codes, tf.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def _late_reshape(self, parts, dim):
  rows = tf.expand_dims(parts["rows"], 2)
  w = rows.shape[1] - 2
  words, scale, bias = tf.split(rows, [w, 1, 1], axis=1)
  codes = tf.bitcast(words[:, :, 0], tf.uint8)
  return _trim(tf.reshape(tf.cast(codes, tf.float32) * scale + bias, [-1, 4 * w]), dim)


def _all_bytes(self, parts, dim):
  rows = parts["rows"]
  w = _words(rows)
  values = tf.cast(tf.reshape(tf.bitcast(rows, tf.uint8), [-1, 4 * w + 8]), tf.float32)
  return values[:, :dim] * rows[:, w : w + 1] + rows[:, w + 1 :]


def _xla(self, parts, dim):
  decode = tf.function(
    lambda rows: SHIPPED["decode"](self, {"rows": rows}, dim), autograph=False, jit_compile=True
  )
  return decode(parts["rows"])


def _separate_encode(self, values):
  fused = SHIPPED["encode"](self, values)["rows"]
  w = _words(fused)
  codes = _trim(tf.reshape(tf.bitcast(fused[:, :w], tf.uint8), [-1, 4 * w]), values.shape[1])
  return {"codes": codes, "scale_bias": fused[:, w:]}


def _separate_decode(self, parts, dim):
  scale, bias = tf.split(parts["scale_bias"], 2, axis=1)
  return tf.cast(parts["codes"], tf.float32) * scale + bias


def _separate_stored(self, parts, dim):
  scale, bias = tf.split(parts["scale_bias"], 2, axis=1)
  return {"codes": parts["codes"], "scale": scale, "bias": bias}


DECODES = {
  "slices": _slices,
  "pair": _pair,
  "late_reshape": _late_reshape,
  "all_bytes": _all_bytes,
  "xla": _xla,
  "separate": _separate_decode,
}
# The shipped encode and decode, which some variants call (set by use_variant).
SHIPPED: dict = {}


def use_variant(variant: str) -> None:
  """Replaces Rowwise's decode (and for `separate` its stored variables) by `variant`'s."""
  from tpu_embedding import quantization

  SHIPPED.update(encode=quantization.Rowwise.encode, decode=quantization.Rowwise.decode)
  if variant == "separate":
    quantization.Rowwise.encode = _separate_encode
    quantization.Rowwise.stored = _separate_stored
  if variant != "current":
    quantization.Rowwise.decode = DECODES[variant]


def _export(variant: str, dtype: str, directory: str) -> None:
  sys.path.insert(0, HERE)
  import serving_latency

  if dtype == "int8":
    use_variant(variant)
  serving_latency.export_model("tpu_embedding", dtype, directory, "small")


def _measure(directories: list[str], seconds: float, out: str) -> None:
  import numpy as np

  sys.path.insert(0, HERE)
  import serving_latency

  loaded = [tf.saved_model.load(d) for d in directories]
  serves = [model.signatures["serving_default"] for model in loaded]
  rng = np.random.default_rng(0)
  request = serving_latency.make_request(rng, "small", "uniform", 1024)
  scores = [serve(**request)["score"].numpy() for serve in serves]
  # The int8 exports' decoded tables (each through its own decode) and scores, bit for bit.
  tables = [
    [model.embedding_tables[t]().numpy().view(np.int32) for t in ("user", "movie")]
    for model in loaded[1:]
  ]
  results = {
    "same_bits_as_current": [
      bool(all(np.array_equal(a, b) for a, b in zip(tables[0], t)))
      and bool(np.array_equal(scores[1], s))
      for t, s in zip(tables, scores[1:])
    ]
  }
  for batch in serving_latency.BATCH_SIZES:
    for serve in serves:
      for _ in range(30):  # warm up
        serve(**serving_latency.make_request(rng, "small", "uniform", batch))["score"].numpy()
    times = [[] for _ in serves]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
      call = len(times[0])
      request = serving_latency.make_request(rng, "small", "uniform", batch)
      for turn in range(len(serves)):
        which = (call + turn) % len(serves)  # who goes first changes every call
        start = time.perf_counter()
        serves[which](**request)["score"].numpy()
        times[which].append(time.perf_counter() - start)
    results[batch] = {"calls": len(times[0]), "p50_ms": [float(np.median(t)) * 1e3 for t in times]}
  results["tensorflow_only"] = not [m for m in sys.modules if m.startswith("tpu_embedding")]
  with open(out, "w") as f:
    json.dump(results, f)


def _run(args: list[str]) -> None:
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="3",
    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
  )
  subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, check=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seconds", type=float, default=20.0)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  args = parser.parse_args()
  variants = args.variants.split(",")
  load_at_start = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as work:
    names = ["float32", *(f"int8 {v}" for v in variants)]
    exports = [os.path.join(work, n.replace(" ", "_")) for n in names]
    _run(["_export", "current", "float32", exports[0]])
    for variant, directory in zip(variants, exports[1:]):
      _run(["_export", variant, "int8", directory])
    out = os.path.join(work, "measured.json")
    _run(["_measure", ",".join(exports), str(args.seconds), out])
    with open(out) as f:
      results = json.load(f)
  lines = [
    "| export | same bits as int8 current | p50 ms at batch 1 / 64 / 1024 | x float32 |",
    "|---|---|---|---|",
  ]
  batches = [b for b in results if b.isdigit()]
  for i, name in enumerate(names):
    p50 = [results[b]["p50_ms"][i] for b in batches]
    base = [results[b]["p50_ms"][0] for b in batches]
    same = "" if i == 0 else str(results["same_bits_as_current"][i - 1])  # no float32 entry
    lines.append(
      f"| {name} | {same} | {' / '.join(f'{p:.3f}' for p in p50)} | "
      f"{' / '.join(f'{p / b:.3f}' for p, b in zip(p50, base))} |"
    )
  calls = ", ".join(f"{results[b]['calls']} at {b}" for b in batches)
  print("\n".join(lines))
  print(
    f"\nCalls per export: {calls}; loaded with TensorFlow only: {results['tensorflow_only']}; "
    f"load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
    f"({os.cpu_count()} CPUs)."
  )


if __name__ == "__main__":
  if sys.argv[1:2] == ["_export"]:
    _export(*sys.argv[2:5])
  elif sys.argv[1:2] == ["_measure"]:
    _measure(sys.argv[2].split(","), float(sys.argv[3]), sys.argv[4])
  else:
    main()
