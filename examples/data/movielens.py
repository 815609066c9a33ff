"""MovieLens 100K ratings from TFDS, a local ml-100k directory, or a synthetic stand-in.

The synthetic source exists so that examples and tests run offline and still learn something: it
has the shape of ml-100k and a planted low-rank structure that a model with embeddings can find.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow as tf

SOURCES = ("tfds", "local", "synthetic")

NUM_USERS = 943
NUM_MOVIES = 1682
NUM_RATINGS = 100_000

# Synthetic generator. Item popularity follows a Zipf-Mandelbrot law, (rank + offset)^-exponent,
# whose offset flattens the head so the most popular movie gets ~550 ratings as in ml-100k instead
# of being rated by every user. User activity follows a milder power law over ranks, on top of the
# 20 ratings every ml-100k user has.
_ITEM_ZIPF_OFFSET = 30.0
_ITEM_ZIPF_EXPONENT = 1.0
_USER_ACTIVITY_EXPONENT = 0.35
_MIN_RATINGS_PER_USER = 20
# Rating = global mean + user bias + item bias + <user factors, item factors> + noise, rounded and
# clipped to 1..5. The factor scale gives the dot product a standard deviation of about 0.8 stars,
# larger than either bias, so embeddings have something to learn beyond per-id offsets.
_LATENT_DIM = 8
_GLOBAL_MEAN = 3.6
_USER_BIAS_STD = 0.4
_ITEM_BIAS_STD = 0.5
_FACTOR_STD = (0.8**2 / _LATENT_DIM) ** 0.25
_NOISE_STD = 0.5
# The time span of the real ml-100k ratings (Sep 1997 to Apr 1998), in Unix seconds.
_FIRST_TIMESTAMP = 874_724_710
_LAST_TIMESTAMP = 893_286_638


@dataclasses.dataclass(frozen=True)
class MovieLens:
  """Ratings as parallel arrays; ids are 1-based as in ml-100k, so row 0 of a table is unused."""

  user_ids: np.ndarray  # int32 [N]
  movie_ids: np.ndarray  # int32 [N]
  ratings: np.ndarray  # float32 [N], 1..5
  timestamps: np.ndarray  # int64 [N]
  titles: dict[int, str]  # movie id -> title
  num_users: int  # largest user id: an embedding table needs num_users + 1 rows
  num_movies: int  # largest movie id
  source: str  # 'tfds' | 'local' | 'synthetic'

  def __len__(self) -> int:
    return len(self.ratings)

  def take(self, rows: np.ndarray) -> "MovieLens":
    """The ratings at `rows` (indices into the arrays), with the same ids, titles and source."""
    return dataclasses.replace(
      self,
      user_ids=self.user_ids[rows],
      movie_ids=self.movie_ids[rows],
      ratings=self.ratings[rows],
      timestamps=self.timestamps[rows],
    )


def load_movielens(
  source: str | None = None, data_dir: str | os.PathLike | None = None, seed: int = 42
) -> MovieLens:
  """Loads MovieLens 100K.

  Args:
    source: 'tfds', 'local' or 'synthetic'; by default 'local' when `data_dir` is given, else
      'synthetic', so that nothing reaches for the network unless asked to.
    data_dir: for 'local', the ml-100k directory holding u.data and u.item; for 'tfds', the TFDS
      data directory (None: TFDS's default).
    seed: seeds the synthetic source; the others ignore it.
  """
  if source is None:
    source = "synthetic" if data_dir is None else "local"
  if source == "tfds":
    return _load_tfds(data_dir)
  if source == "local":
    if data_dir is None:
      raise ValueError(
        "source='local' needs data_dir, the ml-100k directory with u.data and u.item."
      )
    return _load_local(os.fspath(data_dir))
  if source == "synthetic":
    if data_dir is not None:
      raise ValueError(f"source='synthetic' reads no files, but data_dir={data_dir!r} was given.")
    return _synthetic(seed)
  raise ValueError(f"Unknown MovieLens source {source!r}; expected one of {SOURCES}.")


def train_test_split(
  data: MovieLens, test_fraction: float = 0.2, seed: int = 42
) -> tuple[MovieLens, MovieLens]:
  """Random split of the rows; both halves keep the full id ranges, so tables size the same."""
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
  order = np.random.default_rng(seed).permutation(len(data))
  num_test = int(round(len(data) * test_fraction))
  return data.take(order[num_test:]), data.take(order[:num_test])


def rating_labels(data: MovieLens) -> np.ndarray:
  """Ratings mapped from 1..5 to [0, 1], the scale models train on (sigmoid outputs fit it)."""
  return ((data.ratings - 1.0) / 4.0).astype(np.float32)


def to_dataset(
  data: MovieLens,
  batch_size: int,
  *,
  shuffle_seed: int | None = None,
  drop_remainder: bool = False,
) -> tf.data.Dataset:
  """Batches of ({'user_id', 'movie_id'}, label in [0, 1]).

  Shuffles (anew each epoch) only when `shuffle_seed` is given, so evaluation order stays fixed.
  `drop_remainder` gives every batch the same static shape, which TPU training requires.
  """
  features = {"user_id": data.user_ids, "movie_id": data.movie_ids}
  dataset = tf.data.Dataset.from_tensor_slices((features, rating_labels(data)))
  if shuffle_seed is not None:
    dataset = dataset.shuffle(len(data), seed=shuffle_seed, reshuffle_each_iteration=True)
  return dataset.batch(batch_size, drop_remainder=drop_remainder)


def mean_rating_rmse(train: MovieLens, test: MovieLens) -> float:
  """RMSE on the [0, 1] label scale of predicting the train mean: the bar any model must clear."""
  mean = rating_labels(train).mean(dtype=np.float64)
  return float(np.sqrt(np.mean((rating_labels(test) - mean) ** 2)))


def _load_tfds(data_dir: str | os.PathLike | None) -> MovieLens:
  """Reads an already prepared TFDS copy and never downloads.

  A download attempt without network can stall for a long time; preparing the data set is left
  to the user as an explicit step, and every failure becomes one error that names the remedies.
  """
  try:
    import tensorflow_datasets as tfds  # Optional dependency: only this source needs it.

    arrays = []
    for name in ("movielens/100k-ratings", "movielens/100k-movies"):
      builder = tfds.builder(name, data_dir=None if data_dir is None else os.fspath(data_dir))
      if not builder.is_prepared():
        raise FileNotFoundError(f"{name} is not prepared in {builder.data_dir}")
      arrays.append(tfds.as_numpy(builder.as_dataset(split="train", batch_size=-1)))
  except Exception as err:
    raise RuntimeError(
      f"tensorflow_datasets could not load MovieLens 100K ({err}). This loader does not "
      "download; with network access, first run "
      "tfds.builder('movielens/100k-ratings').download_and_prepare() and the same for "
      "'movielens/100k-movies'. Otherwise use "
      "source='local' with data_dir pointing at an ml-100k directory (u.data, u.item), or "
      "source='synthetic'."
    ) from err
  return from_tfds_arrays(*arrays)


def from_tfds_arrays(ratings: dict[str, np.ndarray], movies: dict[str, np.ndarray]) -> MovieLens:
  """MovieLens from TFDS's `movielens/100k-ratings` and `-movies` as NumPy arrays (a prepared copy
  read with `batch_size=-1`). TFDS stores ids as byte strings: parsed to the files' integer ids."""
  user_ids = ratings["user_id"].astype(np.int32)
  movie_ids = ratings["movie_id"].astype(np.int32)
  titles = {
    int(movie_id): title.decode("utf-8", errors="replace")
    for movie_id, title in zip(movies["movie_id"], movies["movie_title"])
  }
  return MovieLens(
    user_ids=user_ids,
    movie_ids=movie_ids,
    ratings=ratings["user_rating"].astype(np.float32),
    timestamps=ratings["timestamp"].astype(np.int64),
    titles=titles,
    num_users=int(user_ids.max()),
    num_movies=max(int(movie_ids.max()), max(titles)),
    source="tfds",
  )


def _load_local(data_dir: str) -> MovieLens:
  titles = _read_titles(data_dir)
  user_ids, movie_ids, ratings, timestamps = _read_ratings(data_dir, titles)
  return MovieLens(
    user_ids=np.array(user_ids, np.int32),
    movie_ids=np.array(movie_ids, np.int32),
    ratings=np.array(ratings, np.float32),
    timestamps=np.array(timestamps, np.int64),
    titles=titles,
    num_users=max(user_ids),
    num_movies=max(max(movie_ids), max(titles)),
    source="local",
  )


def _lines(data_dir: str, name: str) -> list[str]:
  path = os.path.join(data_dir, name)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"MovieLens file {name} not found in {data_dir} ({path}).")
  with open(path, encoding="latin-1") as f:
    return f.read().splitlines()


def _positive_id(text: str, what: str, where: str) -> int:
  if not text.strip().isdigit() or int(text) < 1:
    raise ValueError(f"{where}: {what} must be a positive integer, got {text!r}.")
  return int(text)


def _read_titles(data_dir: str) -> dict[int, str]:
  titles = {}
  for number, line in enumerate(_lines(data_dir, "u.item"), start=1):
    if not line.strip():
      continue
    where = f"u.item line {number}"
    fields = line.split("|")
    if len(fields) < 2:
      raise ValueError(
        f"{where}: expected '|'-separated fields 'movie id|title|...', got {line!r}."
      )
    titles[_positive_id(fields[0], "movie id", where)] = fields[1]
  if not titles:
    raise ValueError(f"u.item in {data_dir} lists no movies.")
  return titles


def _read_ratings(
  data_dir: str, titles: dict[int, str]
) -> tuple[list[int], list[int], list[float], list[int]]:
  user_ids, movie_ids, ratings, timestamps = [], [], [], []
  for number, line in enumerate(_lines(data_dir, "u.data"), start=1):
    if not line.strip():
      continue
    where = f"u.data line {number}"
    fields = line.split("\t")
    if len(fields) != 4:
      raise ValueError(
        f"{where}: expected 4 tab-separated fields 'user id, movie id, rating, timestamp', "
        f"got {line!r}."
      )
    user_id = _positive_id(fields[0], "user id", where)
    movie_id = _positive_id(fields[1], "movie id", where)
    try:
      rating, timestamp = float(fields[2]), int(fields[3])
    except ValueError:
      raise ValueError(
        f"{where}: expected a numeric rating and an integer timestamp, got {line!r}."
      ) from None
    if not 1.0 <= rating <= 5.0:
      raise ValueError(f"{where}: rating must be between 1 and 5, got {fields[2]!r}.")
    if movie_id not in titles:
      raise ValueError(f"{where}: movie id {movie_id} has no entry in u.item.")
    user_ids.append(user_id)
    movie_ids.append(movie_id)
    ratings.append(rating)
    timestamps.append(timestamp)
  if not ratings:
    raise ValueError(f"u.data in {data_dir} holds no ratings.")
  return user_ids, movie_ids, ratings, timestamps


def _power_law_counts(total: int, num: int, exponent: float) -> np.ndarray:
  """Splits `total` over `num` ranks in proportion to rank^-exponent, summing exactly."""
  weight = np.arange(1, num + 1, dtype=np.float64) ** -exponent
  share = total * weight / weight.sum()
  counts = np.floor(share).astype(np.int64)
  counts[np.argsort(counts - share)[: total - counts.sum()]] += 1
  return counts


def _synthetic(seed: int) -> MovieLens:
  """ml-100k's shape with a planted latent-factor model (see the constants above)."""
  rng = np.random.default_rng(seed)

  # Who rates how much: a fixed activity profile, dealt to users in random order.
  extra = _power_law_counts(
    NUM_RATINGS - NUM_USERS * _MIN_RATINGS_PER_USER, NUM_USERS, _USER_ACTIVITY_EXPONENT
  )
  per_user = _MIN_RATINGS_PER_USER + extra[rng.permutation(NUM_USERS)]

  # What each user rates: distinct movies drawn by popularity without replacement (the Gumbel
  # top-k trick: the k largest of log-weight + Gumbel noise are such a draw), so no user rates a
  # movie twice.
  popularity_rank = rng.permutation(NUM_MOVIES) + 1
  log_weight = -_ITEM_ZIPF_EXPONENT * np.log(popularity_rank + _ITEM_ZIPF_OFFSET)
  keys = log_weight + rng.gumbel(size=(NUM_USERS, NUM_MOVIES))
  by_key = np.argsort(-keys, axis=1)
  chosen = np.arange(NUM_MOVIES) < per_user[:, None]
  users = np.repeat(np.arange(NUM_USERS), per_user)
  movies = by_key[chosen]

  # How they rate it.
  user_bias = rng.normal(0.0, _USER_BIAS_STD, NUM_USERS)
  item_bias = rng.normal(0.0, _ITEM_BIAS_STD, NUM_MOVIES)
  user_factors = rng.normal(0.0, _FACTOR_STD, (NUM_USERS, _LATENT_DIM))
  item_factors = rng.normal(0.0, _FACTOR_STD, (NUM_MOVIES, _LATENT_DIM))
  score = (
    _GLOBAL_MEAN
    + user_bias[users]
    + item_bias[movies]
    + np.einsum("nd,nd->n", user_factors[users], item_factors[movies])
    + rng.normal(0.0, _NOISE_STD, NUM_RATINGS)
  )
  ratings = np.clip(np.rint(score), 1, 5)
  timestamps = rng.integers(_FIRST_TIMESTAMP, _LAST_TIMESTAMP + 1, NUM_RATINGS)
  years = rng.integers(1920, 1999, NUM_MOVIES)

  order = rng.permutation(NUM_RATINGS)  # ml-100k's u.data is not grouped by user either.
  return MovieLens(
    user_ids=(users[order] + 1).astype(np.int32),
    movie_ids=(movies[order] + 1).astype(np.int32),
    ratings=ratings[order].astype(np.float32),
    timestamps=timestamps[order].astype(np.int64),
    titles={i + 1: f"Synthetic Movie {i + 1} ({years[i]})" for i in range(NUM_MOVIES)},
    num_users=NUM_USERS,
    num_movies=NUM_MOVIES,
    source="synthetic",
  )
