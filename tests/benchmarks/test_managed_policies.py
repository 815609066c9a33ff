"""The MovieLens splits of the managed-id benchmarks, on a hand-made MovieLens whose movie id
names its row."""

import numpy as np
import pytest

from benchmarks import managed_policies as mp
from examples.data.movielens import MovieLens


def test_seen_split_keeps_the_test_ratings_of_known_users_and_movies():
  data = MovieLens(
    user_ids=np.array([1, 2, 1, 3, 2, 1], np.int32),
    movie_ids=np.array([7, 8, 8, 7, 9, 8], np.int32),
    ratings=np.arange(1, 7, dtype=np.float32) % 5 + 1,
    timestamps=np.array([10, 20, 30, 40, 50, 60], np.int64),
    titles={7: "a", 8: "b", 9: "c"},
    num_users=3,
    num_movies=9,
    source="local",
  )
  # Time order: the first 80 % (4 ratings) train; the last two test: (2, 9) and (1, 8).
  train, test, steps = mp.movielens_split(data, "time", 0)
  assert test.user_ids.tolist() == [2, 1] and test.movie_ids.tolist() == [9, 8]
  seen_train, seen, seen_steps = mp.movielens_split(data, "time-seen", 0)
  assert seen.user_ids.tolist() == [1] and seen.movie_ids.tolist() == [8]  # movie 9 is new
  assert seen_train.user_ids.tolist() == train.user_ids.tolist()
  assert [s.tolist() for s in seen_steps] == [s.tolist() for s in steps]


# (user, timestamp) per row; row 6 ties rows 1 and 2 at 10, and comes after them.
RATINGS = [(1, 30), (2, 10), (1, 10), (1, 20), (1, 40), (1, 50), (2, 10), (3, 5)]
RATINGS += [(4, 200 - row) for row in range(8, 18)]  # user 4: ten ratings, newest first


def _movielens() -> MovieLens:
  users, times = (np.array(column) for column in zip(*RATINGS))
  rows = np.arange(len(RATINGS))
  return MovieLens(
    user_ids=users.astype(np.int32),
    movie_ids=(rows + 1).astype(np.int32),
    ratings=np.full(len(rows), 3.0, np.float32),
    timestamps=times.astype(np.int64),
    titles={},
    num_users=4,
    num_movies=len(rows),
    source="synthetic",
  )


def test_user_time_tests_each_users_latest_fifth_and_trains_in_time_order():
  train, test, steps = mp.movielens_split(_movielens(), "user_time", seed=3)
  # User 1: 5 ratings, 1 tested (row 5); user 2: 2, its later tie (row 6); user 3: its only one;
  # user 4: 10 ratings, the 2 newest (rows 9, 8).
  assert (test.movie_ids - 1).tolist() == [7, 6, 5, 9, 8]
  assert (train.movie_ids - 1).tolist() == [1, 2, 3, 0, 4, 17, 16, 15, 14, 13, 12, 11, 10]
  assert np.all(np.diff(train.timestamps) >= 0)
  # Every epoch feeds the training rows in that (time) order.
  fed = np.concatenate(steps)
  assert fed.tolist() == list(range(len(train))) * mp.EPOCHS


def test_user_time_does_not_depend_on_the_seed():
  first, second = (mp.movielens_split(_movielens(), "user_time", seed) for seed in (0, 1))
  assert first[0].movie_ids.tolist() == second[0].movie_ids.tolist()
  assert first[1].movie_ids.tolist() == second[1].movie_ids.tolist()


def test_an_unknown_split_is_refused():
  with pytest.raises(ValueError, match="user_time"):
    mp.movielens_split(_movielens(), "per_user", 0)


def test_quality_takes_the_splits_from_the_command_line(monkeypatch):
  from benchmarks import __main__ as cli

  calls = []
  monkeypatch.setattr(mp, "main", lambda *args: calls.append(args))
  cli._managed(["managed", "--quality", "--seeds", "2", "--splits", "user_time"])
  cli._managed(["managed", "--quality", "--movielens-only"])
  assert calls == [
    (2, "managed-quality", True, ("user_time",)),
    (5, "managed-quality", False, ("time", "random")),
  ]
