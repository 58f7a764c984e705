"""Imported at start-up by every process whose PYTHONPATH names this folder (launch.FLOAT64;
tests/forked.py runs it in a forked rank): the scripts then build their models and data in
float64, where N processes train like one with the whole batch to 1e-9 (in float32 the
rounding of a 6-image mean against a mean of 3-image means grows to 1e-2 over a few steps)."""

import torch

torch.set_default_dtype(torch.float64)
