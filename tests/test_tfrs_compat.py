"""Code written for tf-recommenders works after changing only the import.

tf-recommenders 0.7.7 needs `tf.keras` to be Keras 2 (TF_USE_LEGACY_KERAS=1), which must be set
before TensorFlow is imported, so its own layer-test scenario runs in one subprocess
(tests/jobs/tfrs_compat_scenario.py): functional `tf.keras.Model` on sparse or ragged
`tf.keras.Input`s, three features on two tables, `experimental_distribute_dataset`, a
`tf.function` step with `strategy.run`, `tf.keras.optimizers.legacy` SGD/Adagrad/Adam, training
on and off; once with `from tpu_embedding import TPUEmbedding`, once with tf-recommenders' layer.

Expected values are worked out here by hand (first step) and with a NumPy transcription of the
update rules (second step), never read back from either implementation.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "jobs" / "tfrs_compat_scenario.py"
KEYS = ["watched", "favorited", "friends"]
BATCH = 4

# Both tables are filled row-major with 0..7 by the scenario's constant initializer.
VIDEO = np.arange(8.0).reshape(2, 4)  # sum combiner; features watched, favorited
USER = np.arange(8.0).reshape(4, 2)  # mean combiner; feature friends
BAGS = {
  "watched": [[0], [0, 1], [0, 1], [1]],
  "favorited": [[0, 1], [1], [0], [0, 1]],
  "friends": [[3], [0, 1, 2], [3], [0, 1, 2]],
}
TABLE = {"watched": "video", "favorited": "video", "friends": "user"}
COMBINER = {"video": "sum", "user": "mean"}

# First step, by hand: sums of video rows, means of user rows.
FIRST_ACTIVATIONS = {
  "watched": np.array([[0, 1, 2, 3], [4, 6, 8, 10], [4, 6, 8, 10], [4, 5, 6, 7]], float),
  "favorited": np.array([[4, 6, 8, 10], [4, 5, 6, 7], [0, 1, 2, 3], [4, 6, 8, 10]], float),
  "friends": np.array([[6, 7], [2, 3], [6, 7], [2, 3]], float),
}
# loss = sum over features of mean over the batch of |activation|^2:
# watched (14 + 216 + 216 + 126) / 4 = 143, favorited 143, friends (85 + 13 + 85 + 13) / 4 = 49.
FIRST_LOSS = 335.0


def lookup(tables, key):
  table = tables[TABLE[key]]
  rows = [table[bag].sum(0) for bag in BAGS[key]]
  if COMBINER[TABLE[key]] == "mean":
    rows = [row / len(bag) for row, bag in zip(rows, BAGS[key])]
  return np.stack(rows)


def row_gradients(tables):
  """d loss / d row, summed over every feature and occurrence (before the optimizer)."""
  grads = {name: np.zeros_like(t) for name, t in tables.items()}
  for key in KEYS:
    upstream = 2.0 * lookup(tables, key) / BATCH  # d mean_b |a_b|^2 / d a_b
    for b, bag in enumerate(BAGS[key]):
      scale = 1.0 / len(bag) if COMBINER[TABLE[key]] == "mean" else 1.0
      for row in bag:
        grads[TABLE[key]][row] += scale * upstream[b]
  return grads


def tpu_update(optimizer, table, g):
  """One step of the mid-level optimizer the layer translates the Keras one to (SPEC §2.3-2.6).

  Every row of both tables is touched here, so lazy and dense Adam coincide.
  """
  if optimizer == "sgd":
    return table - 0.1 * g
  if optimizer == "adagrad":
    return table - 0.1 * g / np.sqrt(10.0 + g * g)
  # adam(lr=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-8), sqrt outside: no bias correction.
  m, v = 0.1 * g, 0.001 * g * g
  return table - 0.1 * m / (np.sqrt(v) + 1e-8)


def second_activations(optimizer):
  tables = {"video": VIDEO, "user": USER}
  grads = row_gradients(tables)
  updated = {name: tpu_update(optimizer, tables[name], grads[name]) for name in tables}
  return {key: lookup(updated, key) for key in KEYS}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("tfrs_compat") / "report.json"
  env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
  proc = subprocess.run(
    [sys.executable, str(SCRIPT), str(out)],
    env=env,
    cwd=HERE.parent,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text())


def scenario(report, implementation, optimizer, training, sparse):
  for entry in report["scenarios"]:
    if (entry["implementation"], entry["optimizer"], entry["training"], entry["sparse"]) == (
      implementation,
      optimizer,
      training,
      sparse,
    ):
      assert "error" not in entry, entry["error"]
      return entry["steps"]
  raise AssertionError(f"scenario {implementation, optimizer, training, sparse} did not run")


def activations(step):
  return {key: np.array(step[key]) for key in KEYS}


OPTIMIZERS = ["sgd", "adagrad", "adam"]
CASES = [(o, t, s) for o in OPTIMIZERS for t in (True, False) for s in (True, False)]
IDS = [f"{o}-{'train' if t else 'eval'}-{'sparse' if s else 'ragged'}" for o, t, s in CASES]


def test_the_scenario_ran_with_keras_2(report):
  assert report["keras"].startswith("tf_keras")


@pytest.mark.parametrize("optimizer,training,sparse", CASES, ids=IDS)
def test_our_layer_runs_the_upstream_scenario(report, optimizer, training, sparse):
  first, second = scenario(report, "tpu_embedding", optimizer, training, sparse)
  assert first["loss"] == pytest.approx([FIRST_LOSS])
  for key, value in activations(first).items():
    np.testing.assert_allclose(value, FIRST_ACTIVATIONS[key], atol=1e-6, err_msg=key)
  # Second step: the update of the first step is visible when training, absent otherwise.
  expected = second_activations(optimizer) if training else FIRST_ACTIVATIONS
  for key, value in activations(second).items():
    np.testing.assert_allclose(value, expected[key], rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "ragged"])
def test_activations_before_training_are_identical_to_tfrs(report, optimizer, sparse):
  ours = scenario(report, "tpu_embedding", optimizer, True, sparse)[0]
  theirs = scenario(report, "tfrs", optimizer, True, sparse)[0]
  for key in KEYS:
    np.testing.assert_array_equal(np.array(ours[key]), np.array(theirs[key]), err_msg=key)
  assert ours["loss"] == theirs["loss"]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "ragged"])
def test_one_update_agrees_with_tfrs_where_keras_and_tpu_rules_coincide(report, optimizer, sparse):
  # Keras SGD is the TPU's SGD; legacy Adagrad differs only by epsilon=1e-7 outside the root
  # (relative effect < 1e-7 / sqrt(10)). Adam is left out on purpose: the TPU has no bias
  # correction, so the translated Adam steps differently (see tpu_embedding.optimizers).
  ours = scenario(report, "tpu_embedding", optimizer, True, sparse)[1]
  theirs = scenario(report, "tfrs", optimizer, True, sparse)[1]
  for key in KEYS:
    np.testing.assert_allclose(
      np.array(ours[key]), np.array(theirs[key]), rtol=1e-5, atol=1e-6, err_msg=key
    )
