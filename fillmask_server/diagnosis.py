"""Why a model cannot be loaded or served, as one line for the operator: the checks of ``--model`` that
need no torch (``check_source``), the reasons a loaded checkpoint cannot serve (``unservable``), and the
explanation of a library's failure (``explain_load_failure``, reading the warnings it gave just before:
``library_warnings``). Every such line ends as the text of a ``ModelLoadError``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """The model could not be loaded; ``str(error)`` is one line for the operator."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


#: The releases of each library the server works with, as pyproject.toml declares them (a trial tried
#: older ones: transformers before 5.3 fails to load some families, to decode for some tokenizers, or
#: to load at all; transformers 5.3 wants torch 2.4 and its newer releases 2.6; websockets before 17.4
#: takes a message in any number of fragments, against protocol.md §1).
WORKS_WITH = {"transformers": ">=5.3", "torch": ">=2.6", "websockets": ">=17.4,<18"}
#: The file of each package that holds its version string, read without importing the package.
_VERSION_FILES = {"transformers": "__init__.py", "torch": "version.py", "websockets": "version.py"}
_VERSION_LINE = re.compile(r"""^(?:__version__|tag)\b[^\n]*?=\s*["']([^"']+)["']""", re.MULTILINE)


def installed_version(name: str) -> str | None:
    """The version of the copy of ``name`` that an import would find first on ``sys.path`` (read from
    its version file, so that stale metadata left beside it, or a source tree on ``PYTHONPATH``, is
    not what is judged); its distribution's metadata where no such file is found (an editable
    install's finder); None when neither is there."""
    from importlib import metadata

    for entry in sys.path:
        path = Path(entry or ".") / name / _VERSION_FILES.get(name, "__init__.py")
        try:
            found = _VERSION_LINE.search(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if found:
            return found[1]
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def not_working_with(installed: dict[str, str | None]) -> str | None:
    """One line naming each library of ``installed`` (name -> version, None: not installed) outside
    ``WORKS_WITH``, and the command that installs what the server works with; None when every one is
    within it (or its version cannot be read: pip's rules judge, through ``packaging``). Pre-releases
    of a floor are older than it, as pip counts them."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # (packaging comes with transformers and torch: without it, neither is here)
        return _line({name: None for name, version in installed.items() if version is None})

    def outside(version: str | None, spec: str) -> bool:
        if version is None:
            return True
        try:
            return not SpecifierSet(spec).contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False

    return _line({name: version for name, version in installed.items()
                  if name in WORKS_WITH and outside(version, WORKS_WITH[name])})


def _line(wrong: dict[str, str | None]) -> str | None:
    if not wrong:
        return None
    said = [f"{name} {version}" if version is not None else f"{name} (not installed)"
            for name, version in wrong.items()]
    wanted = " ".join(shlex.quote(f"{name}{WORKS_WITH[name]}") for name in wrong)
    needs = ", ".join(f"{name}{WORKS_WITH[name]}" for name in wrong)
    return (f"this server needs {needs} (pyproject.toml), and this Python has {' and '.join(said)}: install them "
            f"with {shlex.quote(sys.executable)} -m pip install {wanted}")


def check_libraries(*names: str) -> None:
    """``not_working_with`` for the libraries ``names`` as installed now, as ``ModelLoadError``. Reads
    files only: nothing is imported, so it runs before torch is."""
    line = not_working_with({name: installed_version(name) for name in names})
    if line:
        raise ModelLoadError(line)


_HINT = ("point --model at a local directory holding config.json, the weights and the tokenizer files "
         f"(make an offline test model with: {shlex.quote(sys.executable)} -m fillmask_server.checkpoint tiny "
         "models/tiny)")


def check_source(name: str) -> str:
    """The checks of ``--model`` that need no torch, or raise ``ModelLoadError``: a local directory must
    hold config.json; a path-like name must be a directory; any other name is a Hub model id, which
    needs the Hub in reach, or (offline) a copy in the local cache. Returns the name to load: a
    directory's with ``~`` expanded (a value no shell expanded, from an environment variable or a
    container's argument, which transformers would take for a Hub id), else ``name``."""
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            unreadable = _unreadable(path)
            if unreadable is not None:
                raise ModelLoadError(f"cannot load model from directory {name!r}: {unreadable}")
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"cannot load model from directory {name!r}: it has no config.json; {_HINT}")
            return os.path.expanduser(name)
        exists = path.exists()
    except PermissionError:  # (a directory on its way this process may not search)
        raise ModelLoadError(f"cannot load model {name!r}: this process (uid {os.getuid()}) may not reach it (a "
                             "directory on its path is not readable by it): make them readable (chmod a+rx), or "
                             "run it as their owner") from None
    except OSError as exc:  # (a name too long for the system, a loop of links: what is_dir raises beyond "none")
        raise ModelLoadError(f"cannot load model {name!r}: {exc.strerror}; {_HINT}") from None
    if exists:
        raise ModelLoadError(f"cannot load model {name!r}: it is a file, not a directory; {_HINT}")
    if name.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(f"cannot load model {name!r}: no such directory; {_HINT}")
    if not _hub_reachable():
        cached = ("; it is in the local Hugging Face cache: set HF_HUB_OFFLINE=1 to load it from there"
                  if _in_hub_cache(name) else f"; {_HINT}")
        raise ModelLoadError(f"cannot load model {name!r}: it is not a local directory and the Hugging Face Hub "
                             f"cannot be reached from here{cached}")
    if not _in_hub_cache_if_offline(name):
        raise ModelLoadError(f"cannot load model {name!r}: it is not a local directory, and with the Hugging Face "
                             f"Hub off (HF_HUB_OFFLINE) it is not in the local cache either; {_HINT}")
    return name


def _in_hub_cache_if_offline(name: str) -> bool:
    """Online: True (the Hub decides). Offline: whether the local cache holds the model's config."""
    from huggingface_hub import constants

    return not constants.HF_HUB_OFFLINE or _in_hub_cache(name, invalid=True)


def _in_hub_cache(name: str, invalid: bool = False) -> bool:
    """Whether the local Hugging Face cache holds the model's config (``invalid`` for a name that is
    not a valid repo id: from_pretrained will say so)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:
        return invalid


def device_problem(exc: BaseException) -> str:
    """Why torch cannot put a tensor on a device, in the operator's terms."""
    if isinstance(exc, NotImplementedError):  # a backend this torch build does not include
        return "this build of torch does not support it"
    line = first_line(exc)
    if line.startswith("Expected one of"):  # torch's list of every device type it has a name for
        return "torch knows no device of that name (cpu, cuda, cuda:N, mps, xpu, ...)"
    if "not compiled with CUDA" in line:
        return f"this build of torch has no CUDA support ({line})"
    return line


@contextmanager
def library_warnings() -> Iterator[list[str]]:
    """transformers' warnings while the block runs, kept (in the list it gives) instead of printed.

    Start-up keeps the library quiet, but some of its failures say only "look at the above report"
    or name a fallback's problem (tiktoken) instead of the cause, which it gave as a warning just
    before (a checkpoint audit's find): ``explain_load_failure`` reads them."""
    import transformers

    library = transformers.utils.logging.get_logger()  # the library's root logger
    said: list[str] = []
    handlers, level, shown = library.handlers[:], library.level, library.getEffectiveLevel()
    propagates = library.propagate  # (transformers lets it propagate where the environment says CI=true)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            if record.levelno >= shown:  # what the library says at the level it was left at still shows
                for handler in handlers:
                    handler.handle(record)

    library.handlers = [Keep(logging.WARNING)]
    library.setLevel(logging.WARNING)
    library.propagate = False
    try:
        yield said
    finally:
        library.handlers = handlers
        library.setLevel(level)
        library.propagate = propagates


_SHAPE_MISMATCH = re.compile(r"^(\S+)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\((\[[^\]]*\])\)\s*vs\s*"
                             r"model:\s*torch\.Size\((\[[^\]]*\])\)", re.MULTILINE)


def _warned_cause(said: Sequence[str]) -> str | None:
    """The cause of a load failure that transformers gave as a warning (``library_warnings``), if it is
    one this knows to read: a tokenizer that needs the sentencepiece package, or a weight whose shape
    is not the one config.json makes."""
    text = "\n".join(said)
    if "SentencePiece library but it was not found" in text:
        return ("its tokenizer is a sentencepiece model, and the sentencepiece package is not installed: install "
                "it (pip install sentencepiece), or give --model a directory with the tokenizer as tokenizer.json")
    mismatch = _SHAPE_MISMATCH.search(text)
    if mismatch:
        return (f"the checkpoint's {mismatch[1]} has the shape {mismatch[2]}, where its config.json makes it "
                f"{mismatch[3]}: the weights and config.json do not belong together (a vocab_size changed?); give "
                "--model a directory whose config.json was saved with its weights")
    return None


def _config_cause(directory: Path, exc: BaseException) -> str | None:
    """What ``directory``'s config.json says that explains ``exc``, or None: it names Python code of its
    own (``auto_map``), or a ``model_type`` this version of transformers does not know (whose error
    the one-line cut would end mid-sentence)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if "auto_map" in config and ("custom code" in str(exc) or "trust_remote_code" in str(exc)):
        return ("its config.json names Python code of its own (auto_map), which this server never runs: it serves "
                "the architectures transformers implements; point --model at a checkpoint of one of those")
    model_type = config.get("model_type")
    if isinstance(model_type, str):
        from transformers import CONFIG_MAPPING, __version__

        if model_type not in CONFIG_MAPPING:
            return (f"its config.json's model_type {model_type!r} is not one transformers {__version__} knows: check "
                    "the model_type in the config.json of --model's directory, or install a newer transformers "
                    "(pip install -U transformers)")
    return None


def _unreadable(directory: Path) -> str | None:
    """What in ``directory`` this process may not read, or None. (The safetensors library reports a file
    it may not open as not found: an operator's container user, other than the weights' owner, was told
    model.safetensors did not exist.)"""
    files: list[str] = []
    if os.access(directory, os.R_OK | os.X_OK):
        try:  # (os.path.isfile and os.access never raise: a link into a directory it may not search is False)
            files = sorted(path.name for path in directory.iterdir()
                           if os.path.isfile(path) and not os.access(path, os.R_OK))
        except OSError:
            files = ["the directory"]
        if not files:
            return None
        names = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    else:
        names = "the directory"
    return (f"this process (uid {os.getuid()}) may not read {names}: make the files readable by it (chmod a+r; "
            "a+rx for the directory), or run it as their owner")


def explain_load_failure(name: str, exc: BaseException, said: Sequence[str] = ()) -> str:
    path = Path(name).expanduser()
    if os.path.isdir(path):
        unreadable = _unreadable(path) if isinstance(exc, OSError) else None  # (only what failed to open)
        if unreadable is not None:
            return f"cannot load model from directory {name!r}: {unreadable}"
        if not (path / "config.json").is_file():
            return f"cannot load model from directory {name!r}: it has no config.json; {_HINT}"
        cause = _warned_cause(said) or _config_cause(path, exc)
        if cause is not None:
            return f"cannot load model from directory {name!r}: {cause}"
        cause = first_line(exc)
        if cause.endswith(".") and not cause.endswith("..."):  # transformers' full stop (not a cut's "...")
            cause = cause[:-1]  # before "; ..." (one dot only: "directory .." names the directory ".")
        return (f"cannot load model from directory {name!r}: {cause}; check the files --model names "
                "(incomplete, or written for another model or version of transformers?)")
    return (f"cannot load model {name!r}: it is not a local directory and could not be fetched from the "
            f"Hugging Face Hub (offline, or no such model); {_HINT}")


def _hub_reachable() -> bool:
    """False when the Hub is surely out of reach: offline mode, or its host name does not resolve.

    Without this check an offline machine spends most of a minute in the Hub client's retries before
    failing. A model already in the local cache still loads in offline mode, so offline mode only
    skips the probe.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True  # from_pretrained looks in the cache only, and fails fast if it is not there
    host = urlparse(constants.ENDPOINT).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def unservable(tokenizer: Any, model: Any, missing: list[str]) -> str | None:
    """Why a loaded checkpoint cannot be served (the end of a one-line ``ModelLoadError``), or None.

    - Weights of the model missing from the checkpoint (an encoder saved without its MLM head): the
      library fills them with random values, and predictions would be noise that changes with every
      start. Missing biases alone are only logged (some checkpoints leave a tied bias out).
    - The mask or padding token's id beyond the model's token embeddings (a tokenizer given a new
      special token, the model not resized): every request, or every padded batch, would fail.
    - A tokenizer of special tokens only (transformers 5 makes one when the directory has no tokenizer
      files): every word would be the unknown token.
    """
    weights = [key for key in missing if key.endswith(".weight")]
    if weights:
        return (f"has no weights for {weights[0]}" + (f" and {len(weights) - 1} more" if len(weights) > 1 else "")
                + " in its checkpoint (an encoder saved without its masked-language-model head?): they would "
                "be random, and so would its predictions; use a checkpoint saved with its fill-mask head")
    if missing:
        log.warning("the checkpoint has no %s (and %d more); they start at the library's initial values",
                    missing[0], len(missing) - 1)
    if set(tokenizer.get_vocab()) <= set(tokenizer.all_special_tokens):
        return (f"has a tokenizer of {len(tokenizer)} special tokens and no others (are its tokenizer files "
                "missing?): every word would be unknown to it; add the tokenizer files the model was trained with")
    rows = embedding_rows(model)
    for role in ("mask", "pad"):
        token, token_id = getattr(tokenizer, f"{role}_token", None), getattr(tokenizer, f"{role}_token_id", None)
        if rows is not None and isinstance(token_id, int) and not 0 <= token_id < rows:
            return (f"has a tokenizer whose {role} token {token!r} is id {token_id}, but the model has token "
                    f"embeddings for ids 0 to {rows - 1} only; resize the model's embeddings to its tokenizer "
                    "(resize_token_embeddings) or use the tokenizer it was trained with")
    return None


def embedding_rows(model: Any) -> int | None:
    """How many token ids the model has input embeddings for, or None where it cannot tell.

    ``get_input_embeddings()`` is an ``nn.Embedding`` for most models, but not for all that serve fill-mask:
    I-BERT's is a ``QuantEmbedding`` (a module with a ``weight``), Perceiver's a bare ``Parameter``, and a
    model may have none at all (``NotImplementedError``). The table's rows are the first dimension of its
    weight either way."""
    try:
        table = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    rows = getattr(table, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    weight = getattr(table, "weight", table)
    shape = getattr(weight, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 2 else None
