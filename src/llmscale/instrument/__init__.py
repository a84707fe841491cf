"""Measurement instruments over torch: what the runtime reports about itself, measured.

A layer just above `llmscale.tensors`: instruments import torch, `llmscale.tensors` and the
config only, so the transforms (`parallel/`), the trainer and the benches can all use them.
"""
