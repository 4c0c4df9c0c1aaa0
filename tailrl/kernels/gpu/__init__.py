"""The GPU backend: Triton kernels for RoPE with the K/V write, row attention through block
tables and RMS norm (``backend.py``). Triton ships inside CUDA builds of torch; it is imported
only when this backend is used."""
