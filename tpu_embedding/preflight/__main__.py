"""`python -m tpu_embedding.preflight`: the pre-flight report for a config, its data and a TPU
topology, as markdown on stdout (or --output) and a plot (--plot, needs matplotlib).

  python -m tpu_embedding.preflight --config my_model.config --data my_model.data:batches \\
    --topology v5p-8 --batch-size 4096 --plot preflight.png
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from tpu_embedding.preflight import report as report_lib
from tpu_embedding.preflight import sources

GIB = 2**30


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m tpu_embedding.preflight", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--config",
    required=True,
    help="package.module[:name] holding the feature config (and optionally `optimizer`), or a "
    "saved model config (.keras or .json of a tpu_embedding.keras layer)",
  )
  parser.add_argument(
    "--data",
    required=True,
    help="a .csv or .tfrecord file (batched by --batch-size), or package.module:function giving "
    "the global batches (a tf.data.Dataset or an iterable of feature dicts)",
  )
  parser.add_argument("--topology", required=True, help="a Cloud TPU name: v4-8, v5p-8, v6e-8")
  parser.add_argument("--batch-size", type=int, required=True, help="the global batch size")
  parser.add_argument(
    "--optimizer", help="the layer's optimizer for tables without one (sgd, adagrad, adam, ftrl)"
  )
  parser.add_argument(
    "--dense-gib", type=float, default=0.0, help="HBM per chip to keep for the dense model"
  )
  parser.add_argument("--no-stacking", action="store_true", help="disable_table_stacking")
  parser.add_argument("--plot", help="write the plot to this PNG file (needs matplotlib)")
  parser.add_argument("--output", help="write the markdown here instead of stdout")
  return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse(argv)
  try:
    if args.plot:
      report_lib.require_matplotlib()  # before any work: a missing plotter changes nothing
    model = sources.load_config(args.config)
    if args.optimizer:
      model = sources.ModelConfig(model.feature_config, args.optimizer, model.source)
    batches, total = sources.load_batches(args.data, model.feature_config, args.batch_size)
    report = report_lib.build_report(
      model,
      batches,
      topology=args.topology,
      batch_size=args.batch_size,
      dense_bytes_per_chip=int(args.dense_gib * GIB),
      stacking=not args.no_stacking,
      total=total,
    )
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  text = report_lib.markdown(report)
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(text)
  else:
    sys.stdout.write(text)
  if args.plot:
    report_lib.write_plot(report, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
