"""The client package's own tests: they need only the client and a running server, named by URL.

    FILLMASK_TEST_URL=ws://127.0.0.1:8765/ pytest clients/python/tests

tests/test_client_only.py (the server's suite) runs them in a fresh venv that holds only this package,
against a server it starts. Without ``FILLMASK_TEST_URL`` the tests that need a server are skipped.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def server_url() -> str:
    """The WebSocket URL of a running fill-mask server (its model: any BERT-like fill-mask model)."""
    url = os.environ.get("FILLMASK_TEST_URL")
    if not url:
        pytest.skip("set FILLMASK_TEST_URL to a running server's ws:// URL")
    return url
