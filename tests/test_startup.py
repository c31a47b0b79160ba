"""Start-up that talks (issue 18 item 3): the lines before ``ready:``, torch-free checks first, device errors.

A wrong ``--model`` must fail before torch is imported. That is checked without a clock: the server
runs in a subprocess whose import system refuses torch and transformers, so any import of them turns
the one-line error into an ImportError traceback; a control run shows the refusal bites.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fillmask_server.diagnosis import ModelLoadError, check_source
from fillmask_server.loading import load_model
from fillmask_server.startup import LOG_FORMAT, LogTimes, StartupLines

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

# Runs ws_server.py as ``python ws_server.py ARGS`` would, with torch and transformers unimportable.
WITHOUT_TORCH = """
import runpy, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} was imported")
        return None

sys.meta_path.insert(0, NoTorch())
sys.argv = ["ws_server.py", *sys.argv[1:]]
runpy.run_path("ws_server.py", run_name="__main__")
"""


def run_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("/nonexistent", "no such directory"),
        ("{empty}", "has no config.json"),
        ("{file}", "is a file, not a directory"),
        ("google-bert/bert-base-uncased", "not in the local cache"),  # HF_HUB_OFFLINE=1, nothing cached
        ("m" * 400, "File name too long"),  # is_dir raised OSError: a traceback, before
    ],
)
def test_a_wrong_model_fails_with_one_line_before_torch_is_imported(tmp_path: Path, model: str,
                                                                     expected: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a model")
    env_cache = {"HF_HOME": str(tmp_path / "hf")}  # an empty cache, whatever this machine has cached
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "--model",
                             model.format(empty=tmp_path / "empty", file=tmp_path / "file"), "--port", "0"],
                            cwd=ROOT, env={**ENV, **env_cache}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load model") and expected in lines[0], lines
    assert "--model" in lines[0] and result.stdout == ""


def test_a_cached_hub_model_with_the_hub_out_of_reach_is_told_where_it_is(tmp_path: Path) -> None:
    """A model-bringer's trial: with the network down and ``HF_HUB_OFFLINE`` unset, a model in the local
    Hugging Face cache was refused with no word of the cache (the pipeline retried for minutes)."""
    repo = tmp_path / "hf" / "hub" / "models--myorg--mybert"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = {**ENV, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://hub.invalid"}
    said: dict[str, str] = {}
    for model in ("myorg/mybert", "myorg/other"):
        result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "--model", model, "--port", "0"], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
        said[model] = result.stderr
    assert "cannot be reached" in said["myorg/mybert"] and "set HF_HUB_OFFLINE=1" in said["myorg/mybert"]
    assert "cannot be reached" in said["myorg/other"] and "HF_HUB_OFFLINE" not in said["myorg/other"]


def fake_package(where: Path, name: str, version_file: str, line: str) -> None:
    """A package ``name`` in ``where`` whose ``version_file`` holds ``line`` (what the start-up check
    reads of the copy an import would find first, when ``where`` comes first on the path)."""
    (where / name).mkdir(parents=True)
    (where / name / version_file).write_text(f"{line}\n")


def test_a_library_older_than_the_server_works_with_is_named_before_torch_is_imported(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A trial of the declared floors: pyproject.toml said transformers>=4.45, on which every load failed
    with "unexpected keyword argument 'dtype'"; 4.56 and 4.57 served some families wrongly or not at
    all, and 5.0 to 5.2 failed on ESM and on some tokenizers' decoding. Here the first transformers and
    torch on the process's path are 4.57.6 and 2.5.1 (a source tree on PYTHONPATH, say)."""
    fake_package(tmp_path, "transformers", "__init__.py", '__version__ = "4.57.6"')
    fake_package(tmp_path, "torch", "version.py", "__version__ = '2.5.1+cpu'")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "--model", str(tiny_model_dir), "--port", "0"],
                            cwd=ROOT, env={**ENV, "PYTHONPATH": path}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "error: this server needs transformers>=5.3, torch>=2.6 (pyproject.toml), and this Python has "
        f"transformers 4.57.6 and torch 2.5.1+cpu: install them with {shlex.quote(sys.executable)} -m pip install "
        "'transformers>=5.3' 'torch>=2.6'"]


def test_the_start_up_floors_are_pyproject_toml_s(tmp_path: Path) -> None:
    """The releases ``check_libraries`` accepts are the ones pip accepts, read from the copy an import
    finds first (a trial's review: stale metadata beside a newer copy was judged instead)."""
    import tomllib

    from fillmask_server.diagnosis import WORKS_WITH, installed_version, not_working_with

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = {m[1]: m[2] for m in (re.match(r"([\w-]+)([<>=!~].*)", d) for d in declared) if m}
    assert {name: specs[name] for name in WORKS_WITH} == WORKS_WITH
    assert not_working_with({"transformers": "5.3.0", "torch": "2.13.0+cpu", "websockets": "17.4"}) is None
    assert not_working_with({"transformers": "5.25.0.dev0", "websockets": "17.10", "orjson": "1.0"}) is None
    assert not_working_with({"transformers": "not a version"}) is None  # (unreadable: pip's rules can't judge)
    line = not_working_with({"transformers": "5.3.0rc1", "websockets": "18.0", "torch": None})
    assert line == ("this server needs transformers>=5.3, websockets>=17.4,<18, torch>=2.6 (pyproject.toml), and "
                    "this Python has transformers 5.3.0rc1 and websockets 18.0 and torch (not installed): install "
                    f"them with {shlex.quote(sys.executable)} -m pip install 'transformers>=5.3' "
                    "'websockets>=17.4,<18' 'torch>=2.6'")
    import torch
    import transformers
    import websockets.version

    assert installed_version("transformers") == transformers.__version__
    assert installed_version("torch") == torch.__version__
    assert installed_version("websockets") == websockets.version.tag
    assert installed_version("no-such-package-here") is None


def test_a_port_in_use_fails_before_torch_is_imported(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_without_torch("--model", str(tiny_model_dir), "--port", str(taken.getsockname()[1]))
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot listen on 127.0.0.1:") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(("host", "expected"), [
    ("nosuch.invalid", "the host name does not resolve"),  # .invalid never resolves (RFC 6761)
    ("192.0.2.1", "no interface of this machine has that address"),  # TEST-NET-1 (RFC 5737): never assigned
])
def test_a_host_that_cannot_be_listened_on_is_named_before_torch_is_imported(tiny_model_dir: Path, host: str,
                                                                             expected: str) -> None:
    """Port 0 too: the address is checked by binding a free port on it, before the model loads; and the
    line names --host, not the port, which was never the problem."""
    result = run_without_torch("--model", str(tiny_model_dir), "--host", host, "--port", "0")
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: cannot listen on {host}:0: {expected}") and "--host" in lines[0]
    assert "another server" not in lines[0]


def test_the_torch_refusal_bites_once_the_checks_pass(tiny_model_dir: Path) -> None:
    """The control: a good model and a free port get as far as importing torch, which the harness refuses."""
    result = run_without_torch("--model", str(tiny_model_dir), "--port", "0", "--device", "cpu")
    assert result.returncode != 0 and "was imported" in result.stderr
    assert result.stderr.startswith(f"loading {tiny_model_dir} on cpu, float32…\n")  # said before torch
    # --log-level warning: no progress lines (an operator's trial saw them at every level)
    quiet = run_without_torch("--model", str(tiny_model_dir), "--port", "0", "--device", "cpu",
                              "--log-level", "warning")
    assert quiet.returncode != 0 and "was imported" in quiet.stderr
    assert not any(line.startswith("loading ") for line in quiet.stderr.splitlines())  # (not loading.py's path)


def test_device_errors_name_the_device_not_the_dtype(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as bad_name:
        load_model(str(tiny_model_dir), device="gpu")
    message = str(bad_name.value)
    assert message.startswith("cannot use --device gpu: ") and "dtype" not in message and "\n" not in message
    assert "cpu always works" in message
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError) as no_cuda:
            load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16")
        message = str(no_cuda.value)
        assert message.startswith("cannot use --device cuda: ") and "dtype" not in message
        assert "CUDA" in message or "NVIDIA" in message or "GPU" in message


def test_load_model_reports_its_stages_in_order(tiny_model_dir: Path) -> None:
    """``progress`` hears the head line first (``auto`` is said as such: resolving it needs torch), then
    each stage as it starts."""
    heard: list[str] = []
    load_model(str(tiny_model_dir), device="auto", progress=heard.append)
    assert heard == [f"loading {tiny_model_dir} on cuda or cpu (auto), float32", "torch import and device check",
                     "tokenizer and weights", "forward pass traced and checked"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Captured:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_startup_lines_say_the_head_at_once_and_only_stages_over_the_threshold() -> None:
    clock, out = FakeClock(), Captured()
    lines = StartupLines(out, threshold_s=1.0, clock=clock)  # type: ignore[arg-type]
    lines("loading m on cpu, float32")
    assert out.text == "loading m on cpu, float32…\n"  # before any stage has run
    clock.now += 0.3
    lines("tokenizer and weights")
    clock.now += 2.5
    lines("forward pass traced and checked")
    assert out.text.endswith("\n  tokenizer and weights: 2.5 s\n")  # written once it ended
    clock.now += 0.4  # quick: silent
    lines.done()
    lines.done()  # nothing left to end
    assert out.text.splitlines() == ["loading m on cpu, float32…", "  tokenizer and weights: 2.5 s"]


def test_a_slow_last_stage_is_written_when_loading_is_done() -> None:
    clock, out = FakeClock(), Captured()
    lines = StartupLines(out, threshold_s=1.0, clock=clock)  # type: ignore[arg-type]
    lines("loading m on cuda, bfloat16")
    lines("forward pass traced and checked")
    clock.now += 12.0
    lines.done()
    assert out.text.splitlines() == ["loading m on cuda, bfloat16…", "  forward pass traced and checked: 12.0 s"]


def test_log_lines_carry_an_iso_time_with_its_utc_offset() -> None:
    """Logging's default time (``2026-12-05 01:53:49,181``) has no zone: replicas' lines could not be
    put in order across zones."""
    record = logging.LogRecord("fillmask_server", logging.INFO, __file__, 1, "ready", None, None)
    record.created = 1_780_000_000.25
    line = LogTimes(LOG_FORMAT).format(record)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.250[+-]\d\d:\d\d INFO fillmask_server: ready", line), line


@pytest.mark.parametrize(("soft", "hard", "after"), [(256, 4096, 4096), (256, 256, 256)],
                         ids=["raised-to-the-hard-limit", "a-hard-limit-too-low-is-named"])
def test_the_open_files_limit_is_raised_or_named(soft: int, hard: int, after: int) -> None:
    """Each connection and handshake holds a file descriptor, and a soft limit of 1,024 is reached before
    --max-connections (1,000) and the rest: out of them, accepts failed (a helper's audit). The server
    raises the soft limit to the hard one, and names a hard limit that is too low."""
    import resource

    top = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = hard if top == resource.RLIM_INFINITY else min(hard, top)  # (never above this process's own)
    after = min(after, hard)
    if soft > hard:
        pytest.skip(f"this process may open only {hard} files")
    code = ("import resource\nfrom fillmask_server.startup import raise_open_files_limit\n"
            "print(raise_open_files_limit(1000))\nprint(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    line, limit = done.stdout.splitlines()
    assert int(limit) == after, done
    if after < 1000 + 64:
        assert line.startswith(f"warning: this process may open {after} files (ulimit -n), and --max-connections "
                               "1000 needs about 1064"), line
    else:
        assert line == "None"


def test_outside_its_environment_the_server_says_so_in_one_line() -> None:
    """A newcomer's find: ``python ws_server.py`` with an interpreter that lacks the project's packages
    (here ``fillmask_client`` made unimportable) printed a ten-line traceback."""
    missing = 'raise ModuleNotFoundError(f"No module named {name!r}", name=name)'
    without_client = WITHOUT_TORCH.replace('("torch", "transformers")', '("fillmask_client",)').replace(
        'raise ImportError(f"{name} was imported")', missing)
    result = subprocess.run([sys.executable, "-c", without_client, "--model", "models/tiny"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: No module named 'fillmask_client'") and ".venv/bin/python" in lines[0]


def test_a_load_failure_quoted_from_transformers_reads_as_one_sentence(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A newcomer's find: a directory with config.json alone said "... found in directory X.; check the
    files ...": transformers' sentence kept its full stop before the server's own clause. Only that
    stop goes: not a directory named ".", nor the "..." of a line cut short."""
    from transformers import AutoModelForMaskedLM

    from fillmask_server.diagnosis import explain_load_failure

    monkeypatch.chdir(tmp_path)  # (a short name: transformers' line is cut at 200 characters)
    Path("m").mkdir()
    Path("m", "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(OSError) as raised:  # transformers' own failure, in its own words
        AutoModelForMaskedLM.from_pretrained("m")
    said = explain_load_failure("m", raised.value)
    assert said.startswith("cannot load model from directory 'm': ") and "\n" not in said, said
    assert "m; check the files --model names" in said and ".;" not in said, said
    here = explain_load_failure("m", OSError("no file named model.safetensors found in directory .."))
    assert "found in directory .; check the files" in here, here
    cut = explain_load_failure("m", OSError("x" * 300))
    assert "x...; check the files" in cut, cut


def test_weights_this_process_may_not_read_are_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's find: run as the Dockerfile's user (uid 10001) on a mounted checkpoint whose
    model.safetensors is 0600 (as transformers saves it), the server said the file did not exist (the
    safetensors library reports it so) and to check the files. Root may read everything, and the suite
    may run as root, so ``os.access`` says here what it would say to that user."""
    import os

    from fillmask_server.diagnosis import explain_load_failure

    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    failure = FileNotFoundError(f"No such file or directory: {tmp_path / 'model.safetensors'}")
    assert "may not read" not in explain_load_failure(str(tmp_path), failure)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "model.safetensors"
                        and real_access(path, mode))
    said = explain_load_failure(str(tmp_path), failure)
    assert said == (f"cannot load model from directory {str(tmp_path)!r}: this process (uid {os.getuid()}) may not "
                    "read model.safetensors: make the files readable by it (chmod a+r; a+rx for the directory), "
                    "or run it as their owner")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    assert "may not read the directory: " in explain_load_failure(str(tmp_path), failure)
    # Found before any loading, by the checks that need no torch (a review's find: a directory it may not
    # read, or a path through one, gave a traceback there).
    with pytest.raises(ModelLoadError, match=r"may not read the directory: make the files readable"):
        check_source(str(tmp_path))
    monkeypatch.setattr(Path, "is_dir", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(ModelLoadError, match=r"may not reach it \(a directory on its path is not readable by it\)"):
        check_source(str(tmp_path / "below"))
