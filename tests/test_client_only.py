"""The client package installs and works alone (issue 18 item 1): a fresh venv with only ``clients/python``
installed (websockets and orjson, no torch), running the client's own tests and the ``fillmask-client``
command against a server running here, from the project's venv.

The venv is built without network access where possible: the client is built into a wheel here, and its
dependencies come from a wheel cache (``.pytest_cache``) filled once with ``pip download`` of the versions
this venv has, then installed with ``--no-index``: an undeclared dependency (torch, say) fails the install.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "python"
#: What the client's venv gets: the client's dependencies and its test extra's, at this venv's versions.
WHEELS = ["websockets", "orjson", "pytest", "pytest-asyncio"]


def test_server_depends_on_this_client_and_takes_the_wire_constants_from_it() -> None:
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert f"fillmask-client=={client['version']}" in server["dependencies"]  # released together
    import fillmask_client
    import fillmask_server

    assert (fillmask_client.__version__, fillmask_server.__version__) == (client["version"], server["version"])
    assert sorted(re.split(r"[<>=!~ ;]", r)[0] for r in client["dependencies"]) == ["orjson", "websockets"]
    from fillmask_client import wire
    from fillmask_server import protocol, session
    from fillmask_server import server as server_module

    assert protocol.OVERLOADED_REASONS is wire.OVERLOADED_REASONS  # one declaration, not two equal ones
    assert (protocol.PROTOCOL_VERSION, protocol.MAX_SAFE_INTEGER) == (wire.PROTOCOL_VERSION, wire.MAX_SAFE_INTEGER)
    assert (server_module.GOING_AWAY, session.POLICY_VIOLATION) == (wire.CLOSE_GOING_AWAY, wire.CLOSE_POLICY_VIOLATION)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would put this checkout (or the project's venv) on the path:
    conftest.py puts clients/python on PYTHONPATH, where an editable install leaves its metadata, and
    pip would take that for an installed client."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PYTHONNOUSERSITE": "1", **extra}


def pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=timeout, env=clean_env())


def wheel_cache(cache: Path) -> Path:
    """A folder of wheels for ``WHEELS`` (and what they need), downloaded once."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    stamp = cache / "pins.txt"
    if not stamp.exists() or stamp.read_text() != "\n".join(pins):
        downloaded = pip("download", "--only-binary=:all:", "--dest", str(cache), *pins)
        if downloaded.returncode != 0:
            pytest.skip(f"cannot fetch the client's dependencies to build its venv: {downloaded.stderr.strip()[-300:]}")
        stamp.write_text("\n".join(pins))
    return cache


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A fresh venv holding the client package (a regular install from a wheel), its test extra and nothing else."""
    # Without pytest's cache plugin (-p no:cacheprovider) the wheels are fetched for this run only.
    kept = getattr(request.config, "cache", None)
    cache = wheel_cache(Path(kept.mkdir("client-only-wheels")) if kept is not None
                        else tmp_path_factory.mktemp("client-only-wheels"))
    work = tmp_path_factory.mktemp("client-only")
    source = work / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    built = pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(work / "dist"), str(source))
    assert built.returncode == 0, built.stderr
    [wheel] = (work / "dist").glob("fillmask_client-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    installed = pip("--python", str(venv / "bin" / "python"), "install", "--no-index", "--find-links", str(cache),
                    f"{wheel}[test]")
    assert installed.returncode == 0, installed.stderr  # fails if the client declared anything else
    return venv


async def run(*command: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*command, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_client_alone_has_no_torch_and_passes_its_tests_against_a_live_server(
        client_venv: Path, server: Any, tmp_path: Path) -> None:
    python = str(client_venv / "bin" / "python")
    env = clean_env()
    code, out, err = await run(python, "-c", (
        "import importlib.metadata as m, importlib.util as u, json, fillmask_client\n"
        "print([name for name in ('torch', 'transformers', 'fillmask_server') if u.find_spec(name)])\n"
        "print(fillmask_client.__file__)\n"
        "print(json.dumps(sorted(r for r in m.requires('fillmask-client') if 'extra ==' not in r)))"),
        cwd=tmp_path, env=env)
    assert code == 0, err
    importable, location, requires = out.splitlines()
    assert importable == "[]"  # no torch, no transformers, no server package
    assert location.startswith(str(client_venv)), location  # the installed copy, not this checkout
    assert (Path(location).parent / "py.typed").is_file()  # PEP 561: mypy reads its hints (a newcomer's trial)
    assert [re.split(r"[<>=!~ ;]", r)[0] for r in json.loads(requires)] == ["orjson", "websockets"]

    code, out, err = await run(str(client_venv / "bin" / "pytest"), "-q", "-p", "no:cacheprovider",
                               "-c", str(CLIENT / "pyproject.toml"), "--rootdir", str(CLIENT), str(CLIENT / "tests"),
                               cwd=tmp_path, env=clean_env(FILLMASK_TEST_URL=server.url,
                                                           FILLMASK_TEST_CLIENT_PREFIX=str(client_venv)))
    assert code == 0, out + err
    assert "skipped" not in out, out  # every one of them ran, against the server

    code, out, err = await run(str(client_venv / "bin" / "fillmask-client"), "--url", server.url, "-k", "2",
                               "Paris is the [MASK] of France.", cwd=tmp_path, env=env)
    assert (code, err) == (0, ""), err
    assert out.startswith("Paris is the [MASK] of France.\n") and out.count("\n") == 4, out
