"""Tests for examples.data.movielens: the three sources, the split, and the input pipeline."""

import dataclasses
import time

import numpy as np
import pytest
import tensorflow as tf

from examples.data import movielens
from examples.data.movielens import MovieLens


def _pairs(data: MovieLens) -> set[tuple[int, int]]:
  return set(zip(data.user_ids.tolist(), data.movie_ids.tolist()))


@pytest.fixture(scope="module")
def synthetic() -> MovieLens:
  return movielens.load_movielens(seed=42)


@pytest.fixture(scope="module")
def split(synthetic: MovieLens) -> tuple[MovieLens, MovieLens]:
  return movielens.train_test_split(synthetic, test_fraction=0.2, seed=42)


# --- synthetic source -------------------------------------------------------------------------


def test_synthetic_has_the_shape_of_ml_100k(synthetic: MovieLens) -> None:
  assert synthetic.source == "synthetic"
  assert (synthetic.num_users, synthetic.num_movies, len(synthetic)) == (943, 1682, 100_000)
  assert synthetic.user_ids.dtype == np.int32 and synthetic.movie_ids.dtype == np.int32
  assert synthetic.ratings.dtype == np.float32 and synthetic.timestamps.dtype == np.int64
  assert set(np.unique(synthetic.user_ids)) == set(range(1, 944))
  assert synthetic.movie_ids.min() >= 1 and synthetic.movie_ids.max() <= 1682
  assert set(np.unique(synthetic.ratings)) == {1.0, 2.0, 3.0, 4.0, 5.0}
  assert sorted(synthetic.titles) == list(range(1, 1683))
  assert synthetic.titles[17].startswith("Synthetic Movie 17 (")
  assert len(_pairs(synthetic)) == len(synthetic)


def test_synthetic_is_deterministic_per_seed(synthetic: MovieLens) -> None:
  again = movielens.load_movielens("synthetic", seed=42)
  other = movielens.load_movielens("synthetic", seed=7)
  for field in ("user_ids", "movie_ids", "ratings", "timestamps"):
    np.testing.assert_array_equal(getattr(again, field), getattr(synthetic, field))
    assert not np.array_equal(getattr(other, field), getattr(synthetic, field))
  assert again.titles == synthetic.titles


def test_synthetic_popularity_and_activity_are_skewed(synthetic: MovieLens) -> None:
  per_movie = np.sort(np.bincount(synthetic.movie_ids, minlength=1683)[1:])[::-1]
  # Uniform popularity would give the top 10% of movies about 10% of the ratings; ml-100k gives
  # them about 40%, and so does the generator.
  assert per_movie[:168].sum() / len(synthetic) > 0.35
  per_user = np.bincount(synthetic.user_ids)[1:]
  assert per_user.min() >= 20 and per_user.max() > 5 * np.median(per_user)


def _als_rmse(
  train: MovieLens, test: MovieLens, rank: int, l2: float, iterations: int = 10
) -> float:
  """Test RMSE, on the [0, 1] label scale, of biases plus rank-`rank` factors fitted by ALS.

  Each half-step is a ridge regression per user (or movie) on [other side's factors, 1] against
  the residual after the global mean and the other side's bias; rank 0 fits biases only.
  """
  labels = movielens.rating_labels(train)
  mean = labels.mean()
  rng = np.random.default_rng(0)
  sides = [  # (ids of this side, ids of the other side, number of rows)
    (train.user_ids, train.movie_ids, train.num_users + 1),
    (train.movie_ids, train.user_ids, train.num_movies + 1),
  ]
  factors = [rng.normal(0.0, 0.1, (rows, rank)) for _, _, rows in sides]
  biases = [np.zeros(rows) for _, _, rows in sides]
  for _ in range(iterations):
    for side, (ids, other_ids, rows) in enumerate(sides):
      x = np.concatenate([factors[1 - side][other_ids], np.ones((len(ids), 1))], axis=1)
      target = labels - mean - biases[1 - side][other_ids]
      width = rank + 1
      products = [x[:, i] * x[:, j] for i in range(width) for j in range(width)]
      gram = np.stack([np.bincount(ids, p, rows) for p in products], axis=1)
      gram = gram.reshape(rows, width, width)
      rhs = np.stack([np.bincount(ids, x[:, i] * target, rows) for i in range(width)], axis=1)
      solution = np.linalg.solve(gram + l2 * np.eye(width), rhs[..., None])[..., 0]
      factors[side], biases[side] = solution[:, :rank], solution[:, rank]
  predicted = (
    mean
    + biases[0][test.user_ids]
    + biases[1][test.movie_ids]
    + np.sum(factors[0][test.user_ids] * factors[1][test.movie_ids], axis=1)
  )
  return float(np.sqrt(np.mean((movielens.rating_labels(test) - predicted) ** 2)))


def test_synthetic_is_learnable_beyond_the_mean(split: tuple[MovieLens, MovieLens]) -> None:
  train, test = split
  baseline = movielens.mean_rating_rmse(train, test)
  biases_only = _als_rmse(train, test, rank=0, l2=5.0)
  factorized = _als_rmse(train, test, rank=8, l2=1.0)
  # Seen with seed 42: mean 0.264, biases 0.228, rank-8 factors 0.167 (noise floor about 0.144).
  assert 0.24 < baseline < 0.29
  assert biases_only < baseline - 0.02
  assert factorized < 0.75 * baseline
  assert factorized < biases_only - 0.04


# --- local ml-100k directory ------------------------------------------------------------------

_U_ITEM = (
  "1|Toy Story (1995)|01-Jan-1995||http://example/1|0|0|1\n"
  "2|GoldenEye (1995)|01-Jan-1995||http://example/2|0|1|0\n"
  "5|Café Society (1995)|01-Jan-1995||http://example/5|0|0|0\n"
)
_U_DATA = "196\t1\t3\t881250949\n186\t5\t1\t891717742\n\n22\t2\t5\t878887116\n"


def _write_ml_100k(directory, u_data: str | None = _U_DATA, u_item: str | None = _U_ITEM) -> str:
  if u_data is not None:
    (directory / "u.data").write_text(u_data, encoding="latin-1")
  if u_item is not None:
    (directory / "u.item").write_text(u_item, encoding="latin-1")
  return str(directory)


def test_local_directory_is_read_exactly(tmp_path) -> None:
  data = movielens.load_movielens(data_dir=_write_ml_100k(tmp_path))
  assert data.source == "local"
  np.testing.assert_array_equal(data.user_ids, np.array([196, 186, 22], np.int32))
  np.testing.assert_array_equal(data.movie_ids, np.array([1, 5, 2], np.int32))
  np.testing.assert_array_equal(data.ratings, np.array([3, 1, 5], np.float32))
  np.testing.assert_array_equal(
    data.timestamps, np.array([881250949, 891717742, 878887116], np.int64)
  )
  assert data.user_ids.dtype == np.int32 and data.ratings.dtype == np.float32
  assert data.timestamps.dtype == np.int64
  assert data.titles == {1: "Toy Story (1995)", 2: "GoldenEye (1995)", 5: "Café Society (1995)"}
  assert (data.num_users, data.num_movies) == (196, 5)


@pytest.mark.parametrize("missing", ["u.data", "u.item"])
def test_local_missing_file_is_named(tmp_path, missing: str) -> None:
  directory = _write_ml_100k(tmp_path, **{missing.replace(".", "_"): None})
  with pytest.raises(FileNotFoundError, match=rf"{missing} not found in {tmp_path}"):
    movielens.load_movielens("local", data_dir=directory)


_GOOD_LINE = "1\t1\t3\t881250949\n"


@pytest.mark.parametrize(
  "u_data, u_item, message",
  [
    (_GOOD_LINE + "1\t2 4 881250950\n", _U_ITEM, r"u\.data line 2: expected 4 tab-separated"),
    (
      _GOOD_LINE + "1\t2\t6\t881250950\n",
      _U_ITEM,
      r"u\.data line 2: rating must be between 1 and 5, got '6'",
    ),
    ("1\t1\tgood\t881250949\n", _U_ITEM, r"u\.data line 1: expected a numeric rating"),
    ("0\t1\t3\t1\n", _U_ITEM, r"u\.data line 1: user id must be a positive integer, got '0'"),
    ("1\t-2\t3\t1\n", _U_ITEM, r"u\.data line 1: movie id must be a positive integer, got '-2"),
    ("1\t3\t3\t1\n", _U_ITEM, r"u\.data line 1: movie id 3 has no entry in u\.item"),
    (_U_DATA, "1|Toy Story (1995)\nno title\n", r"u\.item line 2: expected '\|'-separated"),
    (_U_DATA, "x|Toy Story\n", r"u\.item line 1: movie id must be a positive integer, got 'x'"),
  ],
)
def test_local_bad_content_is_located(tmp_path, u_data: str, u_item: str, message: str) -> None:
  with pytest.raises(ValueError, match=message):
    movielens.load_movielens(data_dir=_write_ml_100k(tmp_path, u_data, u_item))


def test_source_arguments_are_checked(tmp_path) -> None:
  with pytest.raises(ValueError, match="needs data_dir"):
    movielens.load_movielens("local")
  with pytest.raises(ValueError, match="reads no files"):
    movielens.load_movielens("synthetic", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="Unknown MovieLens source 'kaggle'"):
    movielens.load_movielens("kaggle")


# --- TFDS -------------------------------------------------------------------------------------


def test_tfds_unavailable_fails_fast_and_names_the_alternatives(tmp_path) -> None:
  # An empty TFDS data directory: the data set is not prepared, and the loader must not download.
  started = time.monotonic()
  with pytest.raises(RuntimeError) as raised:
    movielens.load_movielens("tfds", data_dir=str(tmp_path))
  assert time.monotonic() - started < 20
  message = str(raised.value)
  assert "tensorflow_datasets could not load MovieLens 100K" in message
  assert "source='local'" in message and "source='synthetic'" in message


def test_tfds_records_become_the_same_movielens() -> None:
  # What tfds.as_numpy yields for movielens/100k-ratings and movielens/100k-movies: strings come
  # as object arrays of bytes.
  ratings = {
    "user_id": np.array([b"196", b"22"], object),
    "movie_id": np.array([b"242", b"377"], object),
    "user_rating": np.array([3.0, 1.0], np.float32),
    "timestamp": np.array([881250949, 878887116], np.int64),
  }
  movies = {
    "movie_id": np.array([b"242", b"377", b"400"], object),
    "movie_title": np.array(
      [b"Kolya (1996)", b"Heavyweights (1994)", "Caf\u00e9 (1990)".encode()], object
    ),
  }
  data = movielens.from_tfds_arrays(ratings, movies)
  expected = MovieLens(
    user_ids=np.array([196, 22], np.int32),
    movie_ids=np.array([242, 377], np.int32),
    ratings=np.array([3.0, 1.0], np.float32),
    timestamps=np.array([881250949, 878887116], np.int64),
    titles={242: "Kolya (1996)", 377: "Heavyweights (1994)", 400: "Caf\u00e9 (1990)"},
    num_users=196,
    num_movies=400,
    source="tfds",
  )
  for field in dataclasses.fields(MovieLens):
    got, want = getattr(data, field.name), getattr(expected, field.name)
    if isinstance(want, np.ndarray):
      assert got.dtype == want.dtype
      np.testing.assert_array_equal(got, want)
    else:
      assert got == want


# --- split and pipeline -----------------------------------------------------------------------


def test_split_is_80_20_disjoint_and_deterministic(synthetic: MovieLens, split) -> None:
  train, test = split
  assert (len(train), len(test)) == (80_000, 20_000)
  assert (train.num_users, train.num_movies, train.titles) == (943, 1682, synthetic.titles)
  assert not _pairs(train) & _pairs(test)
  assert _pairs(train) | _pairs(test) == _pairs(synthetic)
  again, _ = movielens.train_test_split(synthetic, seed=42)
  other, _ = movielens.train_test_split(synthetic, seed=1)
  np.testing.assert_array_equal(again.ratings, train.ratings)
  np.testing.assert_array_equal(again.user_ids, train.user_ids)
  assert not np.array_equal(other.user_ids, train.user_ids)
  with pytest.raises(ValueError, match="test_fraction must be in"):
    movielens.train_test_split(synthetic, test_fraction=1.0)


def test_to_dataset_scales_labels_and_batches(split) -> None:
  _, test = split
  small = test.take(np.arange(10))
  batches = list(movielens.to_dataset(small, batch_size=4))
  assert [len(labels) for _, labels in batches] == [4, 4, 2]
  features, labels = batches[0]
  assert set(features) == {"user_id", "movie_id"}
  assert features["user_id"].dtype == tf.int32 and features["movie_id"].dtype == tf.int32
  assert labels.dtype == tf.float32
  np.testing.assert_array_equal(features["user_id"].numpy(), small.user_ids[:4])
  np.testing.assert_allclose(labels.numpy(), (small.ratings[:4] - 1.0) / 4.0)
  np.testing.assert_allclose(movielens.rating_labels(small), (small.ratings - 1) / 4)

  fixed = movielens.to_dataset(small, batch_size=4, shuffle_seed=3, drop_remainder=True)
  assert fixed.element_spec[1].shape == (4,)
  shuffled_ids = np.concatenate([f["user_id"].numpy() for f, _ in fixed])
  assert len(shuffled_ids) == 8 and set(shuffled_ids) <= set(small.user_ids)


def test_mean_rating_rmse_predicts_the_train_mean() -> None:
  def rated(ratings: list[float]) -> MovieLens:
    n = len(ratings)
    ones = np.ones(n, np.int32)
    stars = np.array(ratings, np.float32)
    return MovieLens(ones, ones, stars, np.zeros(n, np.int64), {1: "x"}, 1, 1, "local")

  # Train mean rating 3 -> label 0.5; test labels 0 and 1 are both 0.5 away.
  assert movielens.mean_rating_rmse(rated([1, 5, 3]), rated([1, 5])) == pytest.approx(0.5)
