"""The package version: written into every checkpoint (train.py) and printed by `l2l --version`."""
__version__ = "0.1.0"  # as pyproject.toml's [project] version
