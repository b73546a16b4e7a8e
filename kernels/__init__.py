"""Numba CPU kernels (and their numpy references) for llamatune."""
