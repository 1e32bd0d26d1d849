"""Triton kernels of engine and trainer, each beside the plain-PyTorch computation it is tested against."""
