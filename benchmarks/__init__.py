"""Side-by-side benchmarks: `python -m benchmarks all [--quick]` (see benchmarks/__main__.py)."""
