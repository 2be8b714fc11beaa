"""Cryosleep: snapshot and restore running distributed PyTorch jobs without changing their code."""

__version__ = "0.1.0"

__all__ = ["__version__"]
