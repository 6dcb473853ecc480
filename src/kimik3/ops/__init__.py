"""Numerical ops (kernels and their references). Imports only torch (and triton where present)."""
