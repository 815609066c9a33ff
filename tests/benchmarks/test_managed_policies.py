"""The MovieLens splits of the policies' benchmark: the "-seen" test set keeps only the ratings
whose user and movie both rate in training."""

import numpy as np

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
