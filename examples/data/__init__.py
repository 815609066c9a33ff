"""Data sets for the demos, benchmarks and notebooks (MovieLens 100K, drifting ratings)."""
