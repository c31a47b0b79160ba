"""The code holds to its own rules: ``ruff`` finds nothing in the repository, and ``mypy`` finds nothing
in the server (``fillmask_server`` and ``ws_server.py``, as ``pyproject.toml``'s ``[tool.mypy]`` says).

Both were conventions only: a session found 220 mypy errors in the server (with torch's and
transformers' annotations read), type hints that said ``None`` could not happen where it could
(``Optional`` values used without a check the checker could see), a walrus that rebound a ``str`` name
to a ``float``, a parameter typed ``dict`` that took ``os.environ``. Each version is pinned in the test
extra, so a new release's checks cannot fail a fresh machine's run on code that did not change. torch,
transformers and tokenizers are checked as ``Any`` (their annotations change between releases; the
server's use of them is the tests' business). The check is mypy's strict mode, as the client's is (an
``Any`` returned where a ``float`` was promised, say), less the two checks that would only flag
subclassing and decorating those ``Any`` libraries.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cache), "RUFF_CACHE_DIR": str(cache / "ruff")})


def test_ruff_finds_nothing(tmp_path: Path) -> None:
    checked = _run("ruff", "check", "--no-fix", ".", cache=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_mypy_finds_nothing_in_the_server(tmp_path: Path) -> None:
    checked = _run("mypy", "--cache-dir", str(tmp_path / "mypy"), cache=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    modules = len(list((ROOT / "fillmask_server").rglob("*.py"))) + 1  # (and ws_server.py)
    assert f"no issues found in {modules} source files" in checked.stdout  # every one, as the config says
    import tomllib

    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy["strict"] is True  # as the client package is checked (tests/test_client.py)
