"""Demos, their data and a local-cluster launcher: run from the repository root
(`python -m examples.movielens_ranking`); not part of the installed package."""
