"""Flax NNX models annotated with logical axis names only (see models/axes.py)."""
