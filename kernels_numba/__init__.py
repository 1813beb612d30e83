"""Numba CUDA kernels of metrale, one module per op family, each beside its NumPy reference.

Modules: bf16 (conversions, reductions, the SIMULATOR flag), embedding, rmsnorm, rope,
activation, kv_cache, attention, argmax. Layouts and contracts: docs/kernels.md.
Nothing is imported here so that importing the package stays cheap; import the module you need.
"""
