"""The CPU/GPU embedding engine: what the layers and backends use of it is named here.

`EmbeddingEngine` holds, looks up and trains the tables (see `engine.engine`);
`serving_lookup` reads given tables without training. The modules behind them are the engine's
own business.
"""

from tpu_embedding.engine.engine import EmbeddingEngine
from tpu_embedding.engine.lookup import serving_lookup

__all__ = ["EmbeddingEngine", "serving_lookup"]
