"""The CPU/GPU embedding engine: what the layers and backends use of it is named here.

`EmbeddingEngine` holds, looks up and trains the tables (see `engine.engine`);
`serving_lookup` reads given tables without training; `joint_step` makes several engines' updates
of one layer call pass all their `check_finite` checks before any of them writes; `build_once`
makes a build safe when two threads make an object's first calls. The modules
behind them are the engine's own business.
"""

from tpu_embedding.engine.builds import build_once
from tpu_embedding.engine.engine import EmbeddingEngine
from tpu_embedding.engine.finite import joint_step
from tpu_embedding.engine.lookup import serving_lookup

__all__ = ["EmbeddingEngine", "build_once", "joint_step", "serving_lookup"]
