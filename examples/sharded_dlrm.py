"""A DLRM-shaped model whose tables are row-sharded over parameter servers, end to end.

    python -m examples.sharded_dlrm --ps 2 --workers 2

starts the ps and worker tasks as local processes (`LocalCluster`: free ports, one TF_CONFIG per
process, in a private network that only loopback reaches, all stopped at the end), then runs
the coordinator (`dlrm.py`) as its own process in that network: a `ParameterServerStrategy`
whose `variable_partitioner` shards every embedding table (and its optimizer slots) by rows over
the ps tasks trains on synthetic clicks, writes a checkpoint, restores it into an unsharded
model and exports that one for CPU serving. The coordinator ends before the tasks are stopped.

On a real cluster, run `python -m examples.local_cluster` on every ps and worker
machine with that machine's TF_CONFIG, and this script with `--cluster '<the cluster spec as
JSON>'` on the coordinator (see docs/sharded-tables.md, and docs/cluster-security.md for what
such a cluster exposes).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from examples import quiet
from examples.local_cluster import ExposedClusterError, LocalCluster

# Every task is a process on this machine: more than this many per job only share its cores.
MAX_LOCAL_TASKS = 8


def _count(low: int, high: Optional[int] = None):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < low or (high is not None and value > high):
      bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
      raise argparse.ArgumentTypeError(f"expected a whole number {bounds}, got {text!r}")
    return value

  return parse


def _cluster_spec(text: str) -> dict[str, list[str]]:
  try:
    spec = json.loads(text)
  except json.JSONDecodeError as error:
    raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
  if not (
    isinstance(spec, dict)
    and all(isinstance(spec.get(job), list) and spec[job] for job in ("ps", "worker"))
  ):
    raise argparse.ArgumentTypeError(
      f'expected {{"ps": ["host:port", ...], "worker": ["host:port", ...]}}, got {text!r}'
    )
  return spec


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  local = f"(local cluster, 1 to {MAX_LOCAL_TASKS})"
  parser.add_argument("--ps", type=_count(1, MAX_LOCAL_TASKS), default=2, help=f"ps tasks {local}")
  parser.add_argument(
    "--workers", type=_count(1, MAX_LOCAL_TASKS), default=2, help=f"worker tasks {local}"
  )
  parser.add_argument("--cluster", type=_cluster_spec, help="a running cluster's spec as JSON")
  parser.add_argument(
    "--allow_exposed_ports",
    action="store_true",
    help="where the local cluster cannot get a private network, let its tasks listen on "
    "every interface of this machine (unauthenticated) instead of refusing to start",
  )
  parser.add_argument("--tables", type=_count(1), default=3)
  parser.add_argument("--vocabulary", type=_count(1), default=100_000)
  parser.add_argument("--batch", type=_count(1), default=256)
  parser.add_argument("--steps", type=_count(1), default=40)
  parser.add_argument("--output_dir", default=None, help="default: a new temporary directory")
  parser.add_argument("--timeout", type=_count(1), default=600, help="seconds before giving up")
  parser.add_argument("--verbose", action="store_true", help="show TensorFlow's own messages")
  args = parser.parse_args(argv)
  args.output_dir = args.output_dir or tempfile.mkdtemp(prefix="sharded_dlrm_")
  return args


def _timeout(seconds: int) -> None:
  def expire(signum, frame):
    raise TimeoutError(f"The example did not finish in {seconds} s (--timeout).")

  signal.signal(signal.SIGALRM, expire)
  signal.alarm(seconds)


def coordinator_command(spec: dict[str, list[str]], args: argparse.Namespace) -> list[str]:
  """This script, as a real cluster's coordinator runs it, with the same settings."""
  command = [sys.executable, "-m", "examples.sharded_dlrm", "--cluster"]
  command.append(json.dumps(spec))
  for name in ("tables", "vocabulary", "batch", "steps", "output_dir", "timeout"):
    command += [f"--{name}", str(getattr(args, name))]
  if args.verbose:
    command.append("--verbose")
  return command


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = parse_args(argv)
  _timeout(args.timeout)
  if args.cluster:
    with quiet.tensorflow_start_up(verbose=args.verbose):
      from examples import dlrm

    dlrm.run_on_cluster(args.cluster, args)
    return
  cluster = LocalCluster(
    num_ps=args.ps,
    num_workers=args.workers,
    allow_exposed=args.allow_exposed_ports,
    verbose=args.verbose,
  )
  try:
    with cluster:
      print(f"cluster {cluster.network}: {json.dumps(cluster.spec)}", flush=True)
      coordinator = subprocess.run(cluster.command(coordinator_command(cluster.spec, args)))
  except ExposedClusterError as error:
    sys.exit(f"{error}\nRefusing to start. To go on anyway: --allow_exposed_ports.")
  sys.exit(coordinator.returncode)


if __name__ == "__main__":
  main(sys.argv[1:])
