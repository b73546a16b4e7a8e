"""Numba CPU kernels (and their numpy references) for llamatune.

The threading policy they rely on (numba's OpenMP layer with a short spin, short OpenBLAS spin)
is set in llamatune/__init__.py, which always runs before this package.
"""
