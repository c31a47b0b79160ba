"""The client package's version: clients/python/pyproject.toml's (tests/test_client_only.py checks)."""

__version__ = "0.1.0"
