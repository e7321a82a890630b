"""Flax NNX modules of the Kimi K3 text tower, one component per file."""
