"""Numerical kernels: torch reference paths (CPU serving) and Triton kernels (GPU)."""
