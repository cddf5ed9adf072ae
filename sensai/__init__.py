"""sensai: class-parallel inference for convolutional networks (sensAI, MLSys 2021)."""

__version__ = "0.1.0"
