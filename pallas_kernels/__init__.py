"""Pallas kernels for Kimi K3 with pure-JAX references."""
