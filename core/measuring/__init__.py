"""Measuring kernels: the protocol every library shares, the contained child process a candidate
runs in, the machine-wide measuring lock, the device description, and the per-library tuning
loop that asks a search backend for configs and measures them."""
