"""dtrain: check a set of machines, run PyTorch DDP on all of them, watch it, ship the model."""

__version__ = "0.1.0"
