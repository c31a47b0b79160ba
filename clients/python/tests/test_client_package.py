"""The client on its own: it imports without the server's packages and works against a live server."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

import fillmask_client
from fillmask_client import FillMaskClient, RequestError, SyncFillMaskClient
from fillmask_client.cli import main
from fillmask_client.state import ConnState
from fillmask_client.wire import OVERLOADED_REASONS, RETRYABLE_REASONS, SERVER_GONE_REASONS

TEXT = "Paris is the [MASK] of France."
MODULES = ["async_client", "cli", "connection", "errors", "frames", "pool", "retry", "state", "sync_client", "wire"]


def test_every_module_imports_without_the_server_or_torch() -> None:
    for name in MODULES:
        importlib.import_module(f"fillmask_client.{name}")
    assert not {"torch", "transformers", "fillmask_server"} & set(sys.modules)


def test_each_overloaded_reason_is_handled_one_way() -> None:
    assert RETRYABLE_REASONS | SERVER_GONE_REASONS | {"deadline_exceeded"} == set(OVERLOADED_REASONS)
    assert not RETRYABLE_REASONS & SERVER_GONE_REASONS


async def test_async_client_fills_masks_and_reports_errors(server_url: str) -> None:
    async with FillMaskClient(server_url) as client:
        predictions = await client.fill_mask(TEXT.replace("[MASK]", client.mask_token), top_k=3)
        assert len(predictions) == 3
        assert all(set(p) == {"score", "token", "token_str", "sequence"} for p in predictions)  # type: ignore[arg-type]
        many = await client.fill_mask_many([TEXT.replace("[MASK]", client.mask_token)] * 5, top_k=1)
        assert len(many) == 5
        with pytest.raises(RequestError) as refused:
            await client.fill_mask("no mask here")
        assert refused.value.code == "no_mask"
        assert client._pool.slots[0].conn is not None and client._pool.slots[0].conn.state is ConnState.OPEN


def test_sync_client_from_plain_code(server_url: str) -> None:
    with SyncFillMaskClient(server_url) as client:
        assert len(client.fill_mask(TEXT.replace("[MASK]", client.mask_token), top_k=2)) == 2


def test_command_line_prints_a_table_and_json(server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", server_url, "-k", "2", TEXT]) == 0
    out = capsys.readouterr().out
    assert out.startswith(TEXT + "\n") and "rank  token" in out
    done = subprocess.run([sys.executable, "-m", "fillmask_client", "--url", server_url, "--json", "-k", "1", TEXT],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONWARNINGS": "error"})
    assert done.returncode == 0, done.stderr
    frame = json.loads(done.stdout)
    assert frame["type"] == "result" and len(frame["predictions"]) == 1


def test_package_is_the_installed_one_when_asked() -> None:
    expected = os.environ.get("FILLMASK_TEST_CLIENT_PREFIX")
    if not expected:
        pytest.skip("FILLMASK_TEST_CLIENT_PREFIX names where the client should be installed")
    assert fillmask_client.__file__.startswith(expected), fillmask_client.__file__
