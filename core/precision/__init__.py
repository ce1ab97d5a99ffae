"""Precision per op: int8 quantization as measured per op, calibration data, accuracy metrics,
and the budgeted search that decides which ops run in reduced precision."""
