"""Graphs, models and tasks: reading an ONNX file, a built-in zoo model or a real model from a
pinned wheel; the activations fused into an op; grouping identical ops into tuning tasks."""
