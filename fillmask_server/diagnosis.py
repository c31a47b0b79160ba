"""Why a model cannot be loaded or served, as one line for the operator: the checks of ``--model`` that
need no torch (``check_source``), the reasons a loaded checkpoint cannot serve (``unservable``), and the
explanation of a library's failure (``explain_load_failure``, reading the warnings it gave just before:
``library_warnings``). Every such line ends as the text of a ``ModelLoadError``.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import re
import shlex
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """The model could not be loaded; ``str(error)`` is one line for the operator."""


def first_line(exc: BaseException) -> str:
    """What ``exc`` says, in one line of at most 200 characters. A first line that only introduces the
    rest takes the line that says it: one ending in ``:`` its next line (a validation error's reason), one
    opening a module's repr (``BertLayer(``) the words after the repr's last line."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    line = text[0] if text else type(exc).__name__
    if line.endswith(":") and len(text) > 1:
        line = f"{line} {text[1]}"
    elif line.endswith("(") and len(text) > 1 and text[-1].startswith(")"):
        line = f"{line[:-1]} {text[-1][1:].strip()}"
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
    """The libraries' warnings while the block runs, kept (in the list it gives) instead of printed:
    transformers' log records, Python's ``warnings`` (torch's about a pickle's protocol, with a path
    into torch), and the records of every other library's logger below ERROR (the ``kernels`` package
    a config.json's attention implementation wakes). This server's own records still show.

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

    class Others(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.name.partition(".")[0] == "fillmask_server" or record.levelno >= logging.ERROR:
                return True
            said.append(record.getMessage())
            return False

    library.handlers = [Keep(logging.WARNING)]
    library.setLevel(logging.WARNING)
    library.propagate = False
    others, shown_by = Others(), logging.getLogger().handlers[:]
    for handler in shown_by:
        handler.addFilter(others)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield said
            finally:
                said.extend(str(warning.message) for warning in caught)
    finally:
        library.handlers = handlers
        library.setLevel(level)
        library.propagate = propagates
        for handler in shown_by:
            handler.removeFilter(others)


_SHAPE_MISMATCH = re.compile(r"^(\S[^|\n]*?)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\((\[[^\]]*\])\)\s*vs\s*"
                             r"model:\s*torch\.Size\((\[[^\]]*\])\)", re.MULTILINE)


#: The weights with a row (or an entry) per vocabulary token: the input embeddings and the output layer.
_VOCABULARY_SIZED = re.compile(r"word_embeddings|embed_tokens|lm_head|decoder|predictions\.bias")


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
        rows_differ = mismatch[2].split(",")[0] != mismatch[3].split(",")[0]  # ("[1000, 32]": a row per token)
        changed = "a vocab_size" if _VOCABULARY_SIZED.search(mismatch[1]) and rows_differ else "a size in it"
        return (f"the checkpoint's {mismatch[1]} has the shape {mismatch[2]}, where its config.json makes it "
                f"{mismatch[3]}: the weights and config.json do not belong together ({changed} changed?); give "
                "--model a directory whose config.json was saved with its weights")
    return None


#: config.json's sizes that must be whole numbers above 0 for a model to be built (a layer count of 0
#: builds one: an encoder of no layers).
_SIZES = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "max_position_embeddings")
#: config.json's names for the activation function, by family.
_ACTIVATIONS = ("hidden_act", "hidden_activation", "activation")


def _config_cause(directory: Path, exc: BaseException) -> str | None:
    """What ``directory``'s config.json says that explains ``exc``, or None: it is not an object; it names
    Python code of its own (``auto_map``), or a ``model_type`` this version of transformers does not know
    (whose error the one-line cut would end mid-sentence); a size of 0 or less, an activation or a dtype
    unknown to the libraries, a pad_token_id beyond the vocabulary, cross-attention in an encoder (whose
    errors name no field)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    except RecursionError:  # (valid JSON, deeper than Python's parser goes)
        return f"its config.json nests its values too deeply to be read: {_DAMAGED}"
    if not isinstance(config, dict):
        return (f"its config.json holds {json.dumps(config)[:40]}, not an object of settings with a model_type; "
                "give --model a directory whose config.json was saved with its weights")
    if "auto_map" in config and ("custom code" in str(exc) or "trust_remote_code" in str(exc)):
        return ("its config.json names Python code of its own (auto_map), which this server never runs: it serves "
                "the architectures transformers implements; point --model at a checkpoint of one of those")
    model_type = config.get("model_type")
    if "model_type" in config and not isinstance(model_type, str):  # (transformers: "unhashable type: 'list'")
        return (f"its config.json's model_type is {_shown(model_type)}, not the name of a model type (such as "
                "\"bert\"): correct it in the config.json of --model's directory (as saved with its weights)")
    if isinstance(model_type, str):
        from transformers import CONFIG_MAPPING, __version__

        if model_type not in CONFIG_MAPPING:
            return (f"its config.json's model_type {model_type!r} is not one transformers {__version__} knows: check "
                    "the model_type in the config.json of --model's directory, or install a newer transformers "
                    "(pip install -U transformers)")
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:  # (before its fields: no value of them would do)
            return (f"its config.json's model_type {model_type!r} has no masked-language-model head, so it cannot "
                    "fill masks; point --model at a fill-mask model such as google-bert/bert-base-uncased")
    return _config_value_cause(config, exc)


def _same_number(value: float, said: str) -> bool:
    """Whether ``said`` (a number as torch printed it: "2", "1.5", "1e+308") is ``value``."""
    try:
        return float(said) == float(value)
    except (ValueError, OverflowError):  # (a whole number past a float's range)
        return False


def _heads_cause(config: dict[str, Any], error: str) -> str | None:
    """config.json's width and head count, where ``error`` is that the heads do not divide the width
    (transformers' "The hidden size (33) is not a multiple of the number of attention heads (2)", or
    DistilBERT's "config.n_heads 2 must divide config.dim 33 evenly"), or that a head has no width at all
    (more heads than the width: "0.0 cannot be raised to a negative power"); None otherwise."""
    pairs = []  # ((width's field, its value), (heads' field, its value)) as the error gives them
    if said := re.search(r"hidden size \((\d+)\) is not a multiple of the number of attention heads \((\d+)\)", error):
        pairs.append((("hidden_size", said[1]), ("num_attention_heads", said[2])))
    if named := re.search(r"config\.(\w+) (\d+) must divide config\.(\w+) (\d+) evenly", error):
        pairs.append(((named[3], named[4]), (named[1], named[2])))
    for (width, wide_said), (heads, many_said) in pairs:
        if str(config.get(width)) == wide_said and str(config.get(heads)) == many_said:
            return (f"its config.json's {width} {wide_said} is not a multiple of its {heads} {many_said} (each head "
                    "takes an equal share)")
    wide, many = config.get("hidden_size"), config.get("num_attention_heads")
    if "negative power" in error and type(wide) is int and type(many) is int and 0 < wide < many:
        return (f"its config.json's hidden_size {wide} is less than its num_attention_heads {many}, which leaves each "
                "head no width")
    return None


def _broken_rule(config: dict[str, Any], error: str) -> str | None:
    """What breaks a rule of transformers' configurations between fields, said of config.json (before the
    fix), or None: a ``layer_types`` list of another length than ``num_hidden_layers`` (an empty one
    failed as a ``rope_parameters`` transformers had rewritten from it), an entry of it transformers does
    not know, or another rule in its own words (without its backquotes)."""
    validation = "alidation error for " in error  # (huggingface_hub's strict dataclasses, field or class)
    layers, kinds = config.get("num_hidden_layers"), config.get("layer_types")
    if validation and type(layers) is int and isinstance(kinds, list) and len(kinds) != layers:
        return (f"its config.json's layer_types has {len(kinds)} entries, where num_hidden_layers is {layers} "
                "(one for each layer)")
    unknown = re.search(r"The `(\w+)` entries must be in \((.*?)\) but got (\[.*\])", error)
    if unknown and isinstance(config.get(unknown.group(1)), list):
        known = re.findall(r"'([^']*)'", unknown.group(2))
        stranger = next((kind for kind in config[unknown.group(1)] if kind not in known), None)
        if stranger is not None:
            return (f"its config.json's {unknown.group(1)} holds {_shown(stranger)}, not a kind of layer transformers "
                    f"knows (such as {' or '.join(map(repr, known[:2]))})")
    rule = re.search(r"Class validation error for validator '\w+':\s*\w+: (.+)", error)
    if rule:  # ("`num_hidden_layers` (3) must be equal to the number of `layer_types` (2)")
        return f"its config.json's settings do not agree: {rule.group(1).strip().replace('`', '').rstrip('.')[:160]}"
    return None


def _config_value_cause(config: dict[str, Any], exc: BaseException) -> str | None:
    """The field of ``config`` whose value explains ``exc`` (see ``_config_cause``), or None."""
    fix = "correct it in the config.json of --model's directory (as saved with its weights)"
    for key in _SIZES:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            return f"its config.json's {key} is {value}, where a model needs a whole number above 0; {fix}"
    for key in _ACTIVATIONS:  # (a KeyError of its name; DistilBERT's "function banana not found in ACT2FN")
        value = config.get(key)
        if isinstance(value, str) and ((isinstance(exc, KeyError) and exc.args[:1] == (value,))
                                       or f"function {value} not found" in str(exc)):
            return (f"its config.json's {key} {value!r} is not an activation function transformers "
                    f"knows (gelu, relu, silu, ...); {fix}")
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):  # (a bare KeyError: 'banana')
        try:
            path = _path_of(config, exc.args[0])
        except RecursionError:
            path = None
        if path is not None:
            return f"its config.json's {path} is {exc.args[0]!r}, a name transformers does not know; {fix}"
    zero = _zero_size(config) if "by zero" in str(exc) else None  # ("integer modulo by zero", "division by zero")
    if zero is not None:
        return f"its config.json's {zero} is 0, where a model needs a whole number above 0; {fix}"
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str) and value != "auto" and f"'{value}'" in str(exc):
            return f"its config.json's {key} {value!r} is not a torch dtype (float32, float16, bfloat16); {fix}"
    pad, rows = config.get("pad_token_id"), config.get("vocab_size")
    if type(pad) is int and pad < -1 and re.search(r"index -\d+ is out of bounds", str(exc)):
        return (f"its config.json's pad_token_id is {pad}: position ids counted from it fall outside the model's "
                "position table; make it the id of the tokenizer's pad token, in the config.json of --model's "
                "directory")
    if "adding_idx" in str(exc) and type(pad) is int and type(rows) is int \
            and not -rows <= pad < rows:  # (torch's "Padding_idx must be within num_embeddings" names neither)
        return (f"its config.json's pad_token_id {pad} is no token of its vocabulary (vocab_size {rows}): make it "
                "the id of the tokenizer's pad token, in the config.json of --model's directory")
    positions = config.get("max_position_embeddings")
    if "adding_idx" in str(exc) and type(pad) is int and type(positions) is int and not -positions <= pad < positions:
        return (f"its config.json's pad_token_id {pad} is beyond its position table (max_position_embeddings "
                f"{positions}), which counts position ids from it: make it the id of the tokenizer's pad token, in "
                "the config.json of --model's directory")
    if config.get("add_cross_attention") is True and "cross attention" in str(exc):
        return ("its config.json's add_cross_attention is true, which only a decoder (is_decoder true) can have; a "
                f"fill-mask checkpoint has it false: {fix}")
    dropout = re.search(r"dropout probability has to be between 0 and 1, but got (\S+)", str(exc))
    named = [key for key, value in config.items() if dropout and ("drop" in key or "prob" in key)
             and type(value) in (int, float) and not 0 <= value <= 1 and _same_number(value, dropout[1])]
    if named:  # (torch's words name no field; several fields of one value: the first)
        return (f"its config.json's {named[0]} is {config[named[0]]}, where a dropout probability is between 0 "
                f"and 1; {fix}")
    heads = _heads_cause(config, str(exc))
    if heads is not None:
        return f"{heads}; {fix}"
    broken = _broken_rule(config, str(exc))
    if broken is not None:
        return f"{broken}; {fix}"
    refused = re.search(r"Validation error for field '(\w+)'", str(exc))
    if refused:
        key = refused.group(1)
        wanted = _wanted_types(str(exc))
        takes = f", where transformers takes {wanted}" if wanted else ", which transformers refuses"
        if key in config:
            return f"its config.json's {key} is {_shown(config[key])}{_kind_note(config[key])}{takes}; {fix}"
        return f"its config.json leads transformers to a {key}{takes.replace(', where', ' where')}; {fix}"
    for key in _TEXT_OR_NULL:
        if key in config and config[key] is not None and not isinstance(config[key], str):
            return f"its config.json's {key} is {_shown(config[key])}{_kind_note(config[key])}, not text; {fix}"
    for key, (needed, words) in _NEEDED_IDS.items():
        if key in config and config[key] is None and re.search(words, str(exc)):
            return f"its config.json gives no {key}, where the model needs the id of its {needed}; {fix}"
    return None


#: The errors a library raises in Python's own words, which name no file or field ("'list' object has no
#: attribute 'items'", "list index out of range").
PYTHONS_OWN_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError)
#: config.json's fields that are text or null (transformers' errors for others: "'int' object has no
#: attribute 'startswith'", "list index out of range").
_TEXT_OR_NULL = ("attn_implementation", "_attn_implementation", "dtype", "torch_dtype")
#: How a reader of config.json calls the types in transformers' validation errors.
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true or false",
               "NoneType": "null", "list": "a list", "dict": "an object", "tuple": "a list"}


def _path_of(config: Any, text: str, path: str = "") -> str | None:
    """Where in ``config`` (config.json's settings, nested) the value ``text`` is, as dotted keys
    (``rope_parameters.full_attention.rope_type``), or None."""
    if isinstance(config, dict):
        for key, value in config.items():
            found = _path_of(value, text, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    return path if config == text and path else None


def _zero_size(config: dict[str, Any]) -> str | None:
    """The first field of ``config`` that is 0 where a default configuration of its ``model_type`` has a
    whole number above 0 (a count of heads, groups or layers something is divided by), or None."""
    defaults = _default_config(config.get("model_type"))
    if defaults is None:
        return None
    for key, value in config.items():
        try:
            default = getattr(defaults, key, None)
        except Exception:  # (a property that fails on the defaults)
            continue
        if value == 0 and type(value) is int and type(default) is int and default > 0 and not key.startswith("_") \
                and not key.endswith("_id"):  # (a token id of 0 is an id, not a count)
            return key
    return None


def _default_config(model_type: Any) -> Any:
    """A default configuration of ``model_type`` (config.json's), to compare a field with; None for a type
    transformers does not know, or whose configuration class needs arguments."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    try:
        return CONFIG_MAPPING[model_type]()
    except Exception:
        return None


def _wanted_types(error: str) -> str:
    """The types a transformers validation error says a field takes, in a reader's words ("a whole number
    or null"), or "" where the error names none this knows."""
    listed = re.search(r"doesn't match any type in \((.*?)\)\.", error)
    names = re.findall(r"<class '(\w+)'>|\b(list|dict|tuple)\[(\w+)?", listed.group(1)) if listed else []
    words = [_TYPE_WORDS.get(simple, "") if simple else "a list of texts" if (generic, inner) == ("list", "str")
             else _TYPE_WORDS.get(generic, "") for simple, generic, inner in names]
    if not listed:
        expected = re.search(r"expected (\w+)", error)
        words = [_TYPE_WORDS.get(expected.group(1), "")] if expected else []
    covered = {"a whole number": "a number", "a list": "a list of texts"}  # (a word another one in the list covers)
    words = [word for word in dict.fromkeys(words) if word and covered.get(word) not in words]
    return " or ".join(words)


def mistyped_config_field(config: dict[str, Any]) -> str | None:
    """The first field of ``config`` (a config.json's settings) whose value is not of a type its
    ``model_type``'s configuration takes, named with what it takes, or None. For an error in Python's
    own words ("'>' not supported between instances of 'str' and 'int'"), which names no field.

    A field is held to the configuration class's annotation (``eos_token_id``: a whole number, a list
    of them, or null); one without an annotation to the type of its default (a whole number where the
    default is one, a number where it is a float, ...), unless the default is null or a method. A
    value of null, an annotation this does not read, and a field starting with ``_`` pass."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    annotations: dict[str, Any] = {}
    for cls in reversed(CONFIG_MAPPING[model_type].__mro__):
        annotations.update({key: _annotation(hint) for key, hint in getattr(cls, "__annotations__", {}).items()})
    defaults = _default_config(model_type)
    for key, value in config.items():
        if value is None or key.startswith("_"):
            continue
        if key in annotations:
            fits, wanted = _fits(value, annotations[key])
        else:
            try:
                default = getattr(defaults, key, None)
            except Exception:  # (a property that fails on the defaults)
                continue
            if default is None or callable(default):
                continue
            kind, wanted = _value_kind(value), _value_kind(default)
            fits = kind == wanted or (wanted == "a number" and kind == "a whole number")
        if not fits and wanted:
            return (f"its config.json's {key} is {_shown(value)}{_kind_note(value)}, where a model of type "
                    f"{model_type!r} takes {wanted}; correct it in the config.json of --model's directory (as "
                    "saved with its weights)")
    return None


def _annotation(hint: Any) -> Any:
    """A class attribute's annotation as a type: a string one (a module with ``from __future__ import
    annotations``, as transformers' base configuration is) read with the builtin types only; None where
    it names anything else (which ``_fits`` then passes)."""
    if not isinstance(hint, str):
        return hint
    import typing

    names = {"int": int, "float": float, "str": str, "bool": bool, "None": None, "list": list, "dict": dict,
             "tuple": tuple, "Literal": typing.Literal, "Any": typing.Any}
    try:
        return eval(hint, {"__builtins__": {}}, names)  # (the library's own annotation, as typing.get_type_hints does)
    except Exception:
        return None


#: The token ids a model may compute with, by what they name and the words its failure has without one:
#: RoBERTa's position ids (``input_ids.ne(padding_idx)``), ESM's token dropout (``input_ids == mask_id``).
_NEEDED_IDS = {"pad_token_id": ("pad token", r"ne\(\) received an invalid combination.*NoneType"),
               "mask_token_id": ("mask token", r"'bool' object has no attribute")}


def _fits(value: Any, annotation: Any) -> tuple[bool, str]:
    """Whether a JSON ``value`` is of a type ``annotation`` allows, and what it allows in a reader's words
    ("a whole number or a list of whole numbers or null"); (True, "") for an annotation this does not
    read (a class, a string)."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        checked = [_fits(value, arg) for arg in args]
        if any(fits for fits, _ in checked):
            return True, ""
        words = [word for _, word in checked]
        return (False, " or ".join(dict.fromkeys(words))) if all(words) else (True, "")
    if origin is typing.Literal:
        return value in args, " or ".join(json.dumps(arg) for arg in args)
    if origin in (list, tuple) or annotation in (list, tuple):
        inner = _fits(0, args[0])[1] if args and args[0] is not Ellipsis else ""
        items = all(_fits(item, args[0])[0] for item in value) if inner and isinstance(value, list) else True
        plural = {"a whole number": "whole numbers", "a number": "numbers", "text": "texts"}.get(inner)
        return isinstance(value, list) and items, f"a list of {plural}" if plural else "a list"
    if origin is dict or annotation is dict:
        return isinstance(value, dict), "an object"
    simple = {type(None): (value is None, "null"), bool: (isinstance(value, bool), "true or false"),
              int: (isinstance(value, int) and not isinstance(value, bool), "a whole number"),
              float: (isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
              str: (isinstance(value, str), "text")}
    return simple.get(annotation, (True, ""))


def _value_kind(value: Any) -> str:
    """``value``'s kind as config.json writes it, with whole numbers apart from other numbers."""
    return _TYPE_WORDS.get(type(value).__name__, type(value).__name__)


def _kind_note(value: Any) -> str:
    """`` (a JSON string)`` and the like after a value shown, where its JSON type is worth saying (not
    for null, true or false)."""
    return "" if value is None or isinstance(value, bool) else f" ({_json_kind(value)})"


def _shown(value: Any) -> str:
    """``value`` as JSON, cut to a few words."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


#: The JSON files of a checkpoint's directory that transformers reads besides config.json (whose own
#: errors name it).
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "generation_config.json", "model.safetensors.index.json")
_DAMAGED = "it is cut short or damaged: copy the checkpoint into --model's directory again"


def _damaged_file(directory: Path, exc: BaseException) -> str | None:
    """The file of ``directory`` that is damaged, named with what is wrong with it, or None: a JSON file
    that starts with a byte-order mark or is not JSON, a safetensors file whose header the library cannot
    read (its error names no file), a pickle of weights torch's safe loader refuses (its advice is about
    a ``torch.load`` call the operator never made), a vocabulary file the tokenizer needs and the
    directory lacks."""
    for name in ("config.json", *_JSON_FILES) if re.search(r"JSON|BOM", str(exc)) else ():
        # (The libraries read these as text, where a byte-order mark is not JSON; json.loads takes bytes.)
        if not (directory / name).is_file():  # (a FIFO would block the read)
            continue
        with contextlib.suppress(OSError), open(directory / name, "rb") as file:
            if file.read(3) == codecs.BOM_UTF8:
                return (f"its {name} starts with a UTF-8 byte-order mark, which the libraries refuse as not JSON: "
                        "save it as UTF-8 without one")
    for name in _JSON_FILES:
        path = directory / name
        if path.is_file():
            try:
                json.loads(path.read_bytes())
            except (OSError, ValueError) as damaged:
                return f"its {name} is not valid JSON ({first_line(damaged)}): {_DAMAGED}"
            except RecursionError:
                return f"its {name} nests its values too deeply to be read: {_DAMAGED}"
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        if not path.is_file():  # (a link to nothing or a directory: transformers says there is no such file)
            continue
        try:
            with safe_open(str(path), "pt"):
                pass
        except Exception as damaged:  # (safetensors' own error type, or an OSError)
            return f"its {path.name} cannot be read ({first_line(damaged)}): {_DAMAGED}"
    if "Weights only load failed" in str(exc):
        pickles = ", ".join(sorted(path.name for path in directory.glob("*.bin"))) or "weights file"
        return (f"its {pickles} cannot be loaded safely: torch's weights-only loader refuses it (it holds more than "
                "tensors, or is damaged), and the server never runs a pickle's code; save the weights as "
                "model.safetensors where the file is trusted (save_pretrained), or use a checkpoint with them")
    if isinstance(exc, TypeError) and "NoneType" in str(exc):
        missing = _missing_vocabulary_files(directory)
        if missing:
            return (f"its tokenizer needs {' and '.join(missing)}, which the directory does not hold: add the "
                    "tokenizer files the model was trained with")
    return None


#: The tokenizer's JSON files, each an object of settings (tokenizer.json: the tokenizers library's own).
_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json")
_RESAVE = ("save the tokenizer again with save_pretrained, or copy the checkpoint into --model's directory "
           "again")


def _misshapen_file(directory: Path, exc: BaseException) -> str | None:
    """The tokenizer file of ``directory`` that is JSON of the wrong shape, named with what is wrong, or
    None. Only for an error in Python's own words (a ``TypeError``, ``AttributeError`` or ``KeyError``,
    which names no file: "'list' object has no attribute 'get'"; or a ``ValueError`` in the libraries'
    words that name no file): a file that is not a JSON object, a tokenizer.json without the model or the
    added tokens the tokenizers library saves, a tokenizer_class or a special token (``*_token``) that is
    not text, a setting of another kind (``_tokenizer_setting_problem``)."""
    if not isinstance(exc, (TypeError, AttributeError, KeyError, ValueError)):
        return None
    for name in _TOKENIZER_FILES:
        path = directory / name
        if not path.is_file():  # (a FIFO would block the read)
            continue
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):  # (_damaged_file names it)
            continue
        if not isinstance(data, dict):
            return f"its {name} holds {_json_kind(data)}, not an object of settings: {_RESAVE}"
        missing = [key for key in ("model", "added_tokens") if key not in data] if name == "tokenizer.json" else []
        if missing:
            return (f"its tokenizer.json has no {' and no '.join(missing)}, so it is not a tokenizer as the tokenizers "
                    f"library saves one: {_RESAVE}")
        value = data.get("tokenizer_class")
        if value is not None and not isinstance(value, str):
            return (f"its {name}'s tokenizer_class is {json.dumps(value)[:40]}, not the name of a tokenizer class "
                    f"(such as \"BertTokenizer\"): correct it, or {_RESAVE}")
        for key, value in data.items():
            if key.endswith("_token") and not key.startswith(_FLAG_PREFIXES) and not _token_text(value):
                return (f"its {name}'s {key} is {json.dumps(value)[:40]}, not a token's text (a string, or an object "
                        f"whose content is one): correct it, or {_RESAVE}")
            wrong = _tokenizer_setting_problem(key, value) if name != "tokenizer.json" else None
            if wrong is not None:
                return f"its {name}'s {key} is {_shown(value)}, {wrong}: correct it, or {_RESAVE}"
    return None


#: The tokenizers library's names for the parts of a tokenizer.json (in its errors), by the part's key.
_TOKENIZER_PARTS = {"ModelUntagged": "model", "NormalizerUntagged": "normalizer",
                    "PreTokenizerUntagged": "pre_tokenizer", "PostProcessorUntagged": "post_processor",
                    "DecoderUntagged": "decoder", "TruncationParams": "truncation", "PaddingParams": "padding",
                    "tokenizer version": "version", "PyVocab": "model's vocab", "tuple of size 2": "model's vocab"}


def _unread_tokenizer_part(directory: Path, exc: BaseException) -> str | None:
    """The part of ``directory``'s tokenizer.json (valid JSON) that the tokenizers library could not
    read, named with where it is, or None. Its errors name a Rust type and a place, never the file
    ("data did not match any variant of untagged enum ModelUntagged at line 1 column 1033"); an added
    token without its id or content fails in transformers' words (a bare ``KeyError``)."""
    text = str(exc)
    place = re.search(r"at line (\d+) column (\d+)", text)
    part = next((key for words, key in _TOKENIZER_PARTS.items() if words in text), None)
    if isinstance(exc, KeyError) and exc.args in (("id",), ("content",)):
        try:
            tokens = json.loads((directory / "tokenizer.json").read_bytes()).get("added_tokens")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        if isinstance(tokens, list) and any(not isinstance(token, dict) or exc.args[0] not in token
                                            for token in tokens):
            return (f"its tokenizer.json has an added token without its {exc.args[0]}: {_RESAVE}")
        return None
    if (place is None and part is None) or not (directory / "tokenizer.json").is_file():
        return None
    where = f" (line {place.group(1)}, column {place.group(2)})" if place else ""
    import tokenizers

    return (f"the {part or 'part'} in its tokenizer.json{where} is not one the tokenizers library "
            f"{tokenizers.__version__} reads (damaged, or written by a newer release): {_RESAVE}, or pip install -U "
            "tokenizers")


#: The prefixes of a tokenizer setting that is a flag: true, false (or null).
_FLAG_PREFIXES = ("do_", "add_", "strip_", "trim_", "tokenize_", "clean_up_", "split_", "keep_", "remove_",
                  "use_", "legacy")


def _tokenizer_setting_problem(key: str, value: Any) -> str | None:
    """What is wrong with a tokenizer_config.json (or special_tokens_map.json) setting, in a few words
    after "its KEY is VALUE, ...", or None: a flag that is not true or false, a side not "right" or
    "left", a list of special tokens or input names that is not one, added tokens not by id."""
    if key.startswith(_FLAG_PREFIXES) and value is not None and not isinstance(value, bool):
        return "where the tokenizers take true or false"
    if key in ("padding_side", "truncation_side") and value not in ("right", "left"):
        return "where the tokenizers take \"right\" or \"left\""
    if key in ("additional_special_tokens", "extra_special_tokens"):
        tokens = value.values() if key == "extra_special_tokens" and isinstance(value, dict) else value
        if not isinstance(tokens, (list, type({}.values()))) \
                or not all(token is not None and _token_text(token) for token in tokens):
            return "not a list of tokens' texts"
    if key == "model_input_names" and not (isinstance(value, list) and "input_ids" in value
                                           and all(isinstance(item, str) for item in value)):
        return "not a list of the model's input names with \"input_ids\" (such as [\"input_ids\", \"attention_mask\"])"
    if key == "added_tokens_decoder" and not (isinstance(value, dict) and all(
            re.fullmatch(r"\d+", str(token_id)) and isinstance(token, dict) and isinstance(token.get("content"), str)
            for token_id, token in value.items())):
        return "not an object of added tokens by their ids (\"5\": {\"content\": \"<x>\", ...})"
    return None


def _json_kind(value: Any) -> str:
    """``value``'s JSON type, as a reader of the file calls it: "a JSON array", "a JSON number", ..."""
    kinds = ((bool, "true or false"), (list, "a JSON array"), (str, "a JSON string"), ((int, float), "a JSON number"),
             (dict, "a JSON object"))
    return next((kind for types, kind in kinds if isinstance(value, types)), "null")


def _token_text(value: Any) -> bool:
    """Whether ``value`` is a special token as the tokenizer files write one: text, an added token's
    object with text as its content, or null (none)."""
    return value is None or isinstance(value, str) or (isinstance(value, dict)
                                                        and isinstance(value.get("content"), str))


def _missing_vocabulary_files(directory: Path) -> list[str]:
    """The files the tokenizer class that tokenizer_config.json names reads (``vocab_files_names``), and
    that ``directory`` lacks."""
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError, RecursionError):
        return []
    import transformers

    tokenizer = getattr(transformers, named, None) if isinstance(named, str) and named.isidentifier() else None
    files = getattr(tokenizer, "vocab_files_names", None)
    if not isinstance(files, dict):
        return []
    return [name for name in files.values() if isinstance(name, str) and not (directory / name).exists()]


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
        cause = (_warned_cause(said) or _too_deep(path, exc) or _config_cause(path, exc) or _damaged_file(path, exc)
                 or _misshapen_file(path, exc) or _unread_tokenizer_part(path, exc)
                 or _unknown_tokenizer_class(path, exc) or _unknown_template_token(path, exc)
                 or _mistyped_config_file(path, exc))
        if cause is not None:
            return f"cannot load model from directory {name!r}: {cause}"
        cause = first_line(exc)
        if cause.endswith(".") and not cause.endswith("..."):  # transformers' full stop (not a cut's "...")
            cause = cause[:-1]  # before "; ..." (one dot only: "directory .." names the directory ".")
        return (f"cannot load model from directory {name!r}: {cause}; check the files --model names "
                "(incomplete, or written for another model or version of transformers?)")
    return (f"cannot load model {name!r}: it is not a local directory and could not be fetched from the "
            f"Hugging Face Hub (offline, or no such model); {_HINT}")


def unnormalised(model_config: Any) -> str | None:
    """config.json's epsilon of a layer norm (``layer_norm_eps``, ModernBERT's ``norm_eps``, ...) that is
    0 or less, named, or None: a norm divides by the root of its variance plus it, which is not a
    number where the sum is 0 or less (scores that are not numbers, blamed on the weights)."""
    for key, value in model_config.to_dict().items():
        if (key == "eps" or key.endswith("_eps")) and type(value) in (int, float) and value <= 0:
            return (f"its config.json's {key} is {value}, where a layer norm takes a small number above 0 (such as "
                    "1e-12) to add to the variance it divides by")
    return None


def explain_batch_failure(name: str, failure: str, model_config: Any) -> str:
    """The one line for a model that loaded and then failed on the start-up batch (``failure``: what it
    raised, in the library's words): a config.json field to blame where one explains it (a size of 0
    something was divided by, a pad_token_id whose position ids fall off the table, a field of another
    type than its configuration takes), else the library's words."""
    settings = model_config.to_dict()
    cause = _config_value_cause(settings, RuntimeError(failure)) or mistyped_config_field(settings)
    if cause is not None:
        return f"model {name!r} fails on a batch of two short texts with a mask: {cause}"
    return (f"model {name!r} fails on a batch of two short texts with a mask ({failure}); it cannot serve requests: "
            "check that its tokenizer and its weights belong together")


def _too_deep(directory: Path, exc: BaseException) -> str | None:
    """For a ``RecursionError`` (the libraries walk a JSON file's values recursively): the JSON file of
    ``directory`` that nests its values deepest, if deeper than any checkpoint's, named; else None."""
    if not isinstance(exc, RecursionError):
        return None
    depths = {}
    for name in ("config.json", *_JSON_FILES):
        path = directory / name
        try:
            text = path.read_text(errors="replace") if path.is_file() else ""
        except OSError:
            continue
        depth = deepest = 0
        for bracket in re.sub(r"[^\[\]{}]", "", text):  # (inside strings too: a bound, not a parse)
            depth += 1 if bracket in "[{" else -1
            deepest = max(deepest, depth)
        depths[name] = deepest
    worst = max(depths, key=depths.__getitem__, default=None)
    if worst is None or depths[worst] < 100:
        return None
    return f"its {worst} nests its values {depths[worst]} levels deep, deeper than the libraries read: {_DAMAGED}"


def _mistyped_config_file(directory: Path, exc: BaseException) -> str | None:
    """``mistyped_config_field`` of ``directory``'s config.json, for an error in Python's own words only
    (after every check that names a file), or None."""
    if not isinstance(exc, PYTHONS_OWN_ERRORS):
        return None
    try:
        config = json.loads((directory / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return mistyped_config_field(config) if isinstance(config, dict) else None


def explain_set_up_failure(name: str, exc: BaseException, model_config: Any) -> str:
    """The one line for a model whose files loaded but whose tokenizer or model then fails as the server
    sets it up (its traced forward pass, its first text): the tokenizer file or config.json field to
    blame where one is of the wrong kind or a special token the tokenizer needs is null, else the
    library's own first line. (A null special token is blamed only for an error that speaks of None, and
    a config.json field only for an error in Python's own words.)"""
    path = Path(name).expanduser()
    cause = _misshapen_file(path, exc) if path.is_dir() else None
    if cause is None and path.is_dir() and "None" in str(exc):  # ("type of None unknown")
        cause = _nulled_special_token(path)
    if cause is None and path.is_dir() and isinstance(exc, RecursionError):
        cause = _unknown_unk_token(path)
    settings = model_config.to_dict()
    cause = cause or _config_value_cause(settings, exc)  # (a size of 0: "list assignment index out of range")
    if cause is None and isinstance(exc, PYTHONS_OWN_ERRORS):
        cause = mistyped_config_field(settings)
    if cause is not None:
        return f"model {name!r} cannot be set up to serve: {cause}"
    return (f"model {name!r} fails as it is set up to serve ({first_line(exc)}); check that its tokenizer and its "
            "weights belong together")


def _foreign_special_token(directory: Path, keys: Sequence[str]) -> tuple[str, str, str] | None:
    """The first special token of ``keys`` (``unk_token``, ``cls_token``, ...) that ``directory``'s
    tokenizer files set to a text its vocabulary (tokenizer.json's, or vocab.txt's) does not hold, as
    (file, key, the text as JSON), or None (also where no vocabulary can be read)."""
    vocabulary: set[str] = set()
    with contextlib.suppress(OSError, ValueError, RecursionError, AttributeError, TypeError, KeyError, IndexError):
        data = json.loads((directory / "tokenizer.json").read_bytes())
        vocab = data["model"]["vocab"]
        vocabulary |= set(vocab) if isinstance(vocab, dict) else {piece[0] for piece in vocab}
        vocabulary |= {token["content"] for token in data.get("added_tokens") or ()}
    with contextlib.suppress(OSError, UnicodeDecodeError):
        vocabulary |= set((directory / "vocab.txt").read_text().splitlines())
    for name in ("tokenizer_config.json", "special_tokens_map.json") if vocabulary else ():
        settings: Any = {}
        with contextlib.suppress(OSError, ValueError, RecursionError):
            settings = json.loads((directory / name).read_bytes())
        for key in keys if isinstance(settings, dict) else ():
            value = settings.get(key)
            token = value.get("content") if isinstance(value, dict) else value
            if isinstance(token, str) and token not in vocabulary:
                return name, key, json.dumps(token)[:40]
    return None


def _unknown_unk_token(directory: Path) -> str | None:
    """The unknown token, named, where the vocabulary does not hold it (``_foreign_special_token``), or
    None: transformers looks for the id of an unknown word as the id of that token, which is itself
    unknown, and so on without end (a ``RecursionError``)."""
    found = _foreign_special_token(directory, ("unk_token",))
    if found is None:
        return None
    name, key, token = found
    return (f"its {name}'s {key} is {token}, which is no token of its vocabulary: the tokenizer looks for the id of "
            f"an unknown word in vain; make it the unknown token its vocabulary has, or {_RESAVE}")


def _unknown_tokenizer_class(directory: Path, exc: BaseException) -> str | None:
    """For a tokenizer transformers could not build ("Couldn't instantiate the backend tokenizer", where
    the directory has no tokenizer.json to fall back on): a ``tokenizer_class`` in tokenizer_config.json
    that transformers has no class of, named, or None."""
    if "Couldn't instantiate the backend tokenizer" not in str(exc):
        return None
    with contextlib.suppress(OSError, ValueError, RecursionError, AttributeError):
        named = json.loads((directory / "tokenizer_config.json").read_bytes()).get("tokenizer_class")
        import transformers

        if isinstance(named, str) and not (named.isidentifier() and hasattr(transformers, named)):
            return (f"its tokenizer_config.json's tokenizer_class is {json.dumps(named)[:40]}, not a tokenizer class "
                    f"transformers {transformers.__version__} has (such as \"BertTokenizer\"): correct it, or "
                    f"{_RESAVE}")
    return None


def _unknown_template_token(directory: Path, exc: BaseException) -> str | None:
    """For the tokenizers library's refusal of a template whose special token has no id ("Expected
    Union[Tuple[str, int], ...]", ALBERT's): the token every text gets (cls, sep, bos, eos) that the
    vocabulary does not hold, named, or None."""
    found = _foreign_special_token(directory, ("cls_token", "sep_token", "bos_token", "eos_token")) \
        if "Tuple[str, int]" in str(exc) else None
    if found is None:
        return None
    name, key, token = found
    return (f"its {name}'s {key} is {token}, which is no token of its vocabulary, and the tokenizer puts it in every "
            f"text; make it the one its vocabulary has, or {_RESAVE}")


def _nulled_special_token(directory: Path) -> str | None:
    """A special token that a tokenizer puts in every text (cls, sep, bos, eos) set to null in
    ``directory``'s tokenizer files, named, or None."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        try:
            data = json.loads(path.read_bytes()) if path.is_file() else None
        except (OSError, ValueError, RecursionError):
            continue
        for key in ("cls_token", "sep_token", "bos_token", "eos_token"):
            if isinstance(data, dict) and key in data and data[key] is None:
                return (f"its {name}'s {key} is null, and its tokenizer fails on a text without one: give it the "
                        f"token the model was trained with, or {_RESAVE}")
    return None


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


#: The weights of a masked-language-model head, by the names the families give them (BERT's
#: ``cls.predictions``, RoBERTa's ``lm_head``, DeBERTa's ``lm_predictions``, DistilBERT's ``vocab_*``,
#: ELECTRA's ``generator_*``, XLM's ``pred_layer``): not a classifier's, a pooler's or ELECTRA's
#: discriminator's (a checkpoint of another task: no fill-mask head at all).
_MLM_HEAD = re.compile(r"(?:^|\.)(?:predictions|lm_head|lm_predictions|vocab_transform|vocab_projector|"
                       r"vocab_layer_norm|generator_lm_head|generator_predictions|pred_layer)\.")


def _output_weight(model: Any) -> str | None:
    """The name of the weight of ``model``'s output layer (the one tied to the word embeddings), or None."""
    try:
        output = model.get_output_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    return next((f"{name}.weight" for name, module in model.named_modules() if module is output and name), None)


_NUMBERED = re.compile(r"^(.*?)\.(\d+)\.")


def _missing_weights_cause(model: Any, missing: list[str]) -> str:
    """What in config.json most likely asks for the ``missing`` weights, said as a fact or a question:

    - every weight of the last entries of one numbered list of layers, and nothing else (of
      ``bert.encoder.layer``, entries 2 on): the count config.json gives (its field of that value whose
      last word is the list's, as ``num_hidden_layers`` for ``layer``, ``num_hidden_groups`` for
      ``albert_layer_groups``) and the checkpoint's;
    - else, half or more of the model's weights: another model's weights, or another ``model_type``;
    - else a setting that adds weights (DeBERTa's ``share_att_key``, ESM's ``emb_layer_norm_before``)."""
    weights = [name for name, _ in model.named_parameters() if name.endswith(".weight")]
    numbered = [match for match in map(_NUMBERED.match, missing) if match]
    if len(numbered) == len(missing) and len({match[1] for match in numbered}) == 1:
        layers = numbered[0][1]
        entries = [int(match[2]) for match in map(_NUMBERED.match, weights) if match and match[1] == layers]
        lost = {int(match[2]) for match in numbered}
        count, held = len(set(entries)), len(set(entries) - lost)
        if lost == set(range(held, count)) and sum(entry in lost for entry in entries) == len(missing):
            word = layers.rpartition(".")[2].rpartition("_")[2].rstrip("s")
            fields = [key for key, value in model.config.to_dict().items()
                      if type(value) is int and value == count and key.rpartition("_")[2].rstrip("s") == word]
            asks = f"its {fields[0]} is {count}" if len(fields) == 1 else f"it asks for {count} of {layers}"
            return f"{asks}, and the checkpoint holds {held}"
    if 2 * len(missing) >= len(weights):
        return "its model_type changed, or the weights are another model's?"
    return "a setting in it that adds weights changed?"


def unservable(tokenizer: Any, model: Any, missing: list[str], unexpected: Sequence[str] = ()) -> str | None:
    """Why a loaded checkpoint cannot be served (the end of a one-line ``ModelLoadError``), or None.

    - Weights of the model missing from the checkpoint (an encoder saved without its MLM head): the
      library fills them with random values, and predictions would be noise that changes with every
      start. Missing biases alone are only logged (some checkpoints leave a tied bias out). Of the
      head's weights: the output layer alone, where config.json's ``tie_word_embeddings`` is false (a
      checkpoint saved tied holds it once, as the word embeddings); weights the checkpoint holds
      (``unexpected``) outside the encoder, a head of another kind than config.json builds (a setting
      that picks it changed: DeBERTa's ``legacy``); else no head at all.
    - The mask or padding token's id beyond the model's token embeddings (a tokenizer given a new
      special token, the model not resized): every request, or every padded batch, would fail.
    - A tokenizer of special tokens only (transformers 5 makes one when the directory has no tokenizer
      files): every word would be the unknown token.
    """
    weights = [key for key in missing if key.endswith(".weight")]
    if weights:
        named = f"has no weights for {weights[0]}" + (f" and {len(weights) - 1} more" if len(weights) > 1 else "")
        encoder = getattr(model, "base_model_prefix", "")
        if not encoder or not any(key.startswith(f"{encoder}.") for key in weights):  # the head's alone
            if weights == [_output_weight(model)] and getattr(model.config, "tie_word_embeddings", None) is False:
                return (f"{named} in its checkpoint: its config.json's tie_word_embeddings is false, so the model "
                        "wants an output layer of its own, which the checkpoint does not hold (saved tied to its word "
                        "embeddings?): set tie_word_embeddings to true in its config.json, or give --model a "
                        "directory whose config.json was saved with its weights")
            other = [key for key in unexpected if key.endswith(".weight") and encoder
                     and not key.startswith(f"{encoder}.") and _MLM_HEAD.search(key)]
            if other:
                held = other[0] + (f" and {len(other) - 1} more" if len(other) > 1 else "")
                return (f"{named} in its checkpoint, which holds other head weights ({held}): config.json builds "
                        "another kind of head than the one saved (a setting that picks it changed?); give --model a "
                        "directory whose config.json was saved with its weights")
            return (f"{named} in its checkpoint (an encoder saved without its masked-language-model head?): they "
                    "would be random, and so would its predictions; use a checkpoint saved with its fill-mask head")
        return (f"{named} in its checkpoint: they would be random, and so would its predictions; its config.json "
                f"asks for weights the checkpoint does not hold ({_missing_weights_cause(model, weights)}): give "
                "--model a directory whose config.json was saved with its weights")
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
                    f"embeddings for ids 0 to {rows - 1} only; {_RESIZE}")
    if rows is None:
        return None
    try:  # the tokens the tokenizer puts in every text (its start and end), as around a lone mask
        every = list(tokenizer(tokenizer.mask_token)["input_ids"])
    except Exception:  # (a tokenizer that fails here fails the load's own first texts, which say why)
        every = []
    beyond = next((token_id for token_id in every if isinstance(token_id, int) and not 0 <= token_id < rows), None)
    if beyond is not None:
        return (f"has a tokenizer that puts the token {tokenizer.convert_ids_to_tokens(beyond)!r} (id {beyond}) in "
                f"every text, but the model has token embeddings for ids 0 to {rows - 1} only; {_RESIZE}")
    return None


#: What to do about a token beyond the model's token embeddings.
_RESIZE = ("resize the model's embeddings to its tokenizer (resize_token_embeddings) or use the tokenizer it was "
           "trained with")


def not_numbers(model: Any, dtype: str) -> str | None:
    """Why the model's weights cannot serve: one of them holds NaN or infinite values (every answer would
    be scores that are not numbers), named; or None. Asked before the model's own checks run batches,
    whose warnings about padding and tracing such weights would draw first. In a reduced ``dtype`` a
    weight beyond its range is infinite too (float16 ends at 65,504)."""
    import torch

    for name, weight in model.named_parameters():
        if weight.is_floating_point() and not bool(torch.isfinite(weight).all()):
            if dtype in ("float16", "bfloat16"):
                return (f"has weights that are not numbers in {dtype}, in {name} (beyond its range, or NaN in the "
                        "checkpoint): use --dtype float32, or bfloat16 for float16")
            return (f"has weights that are not numbers (NaN or infinite values) in {name}: its answers would be "
                    "scores that are not numbers; use a checkpoint whose weights are all numbers")
    return None


#: A weight of one of an encoder's layers (``encoder.layer.3.``, ``layers.3.``).
_LAYER_WEIGHT = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def unused(model: Any, unexpected: list[str]) -> None:
    """Log the weights the checkpoint holds and config.json leaves out of the model, where the model
    served is then another than the one saved (as the pipeline's is): whole layers beyond the model's
    (its ``num_hidden_layers`` lowered: a smaller model), and other weights of the encoder (a setting
    that used them changed: DeBERTa's ``relative_attention``, ``share_att_key``). Weights outside the
    encoder (a pre-training head) and its pooler are left unused by the norm, and not logged."""
    names = [name for name, _ in model.named_parameters()]
    layers: dict[str, int] = {}
    inside: list[str] = []
    encoder = getattr(model, "base_model_prefix", "")
    for key in unexpected:
        found = _LAYER_WEIGHT.search(key)
        if found and not any(name.startswith(key[:found.end(0)]) for name in names):
            layers[key[:found.end(1)]] = int(found[1])
        elif encoder and key.startswith(f"{encoder}.") and ".pooler." not in key:
            inside.append(key)
    if layers:
        named = sorted(layers, key=layers.__getitem__)
        which = named[0] if len(named) == 1 else f"{named[0]} to {named[-1]}"
        log.warning("the checkpoint holds weights of %d layer(s) that its config.json leaves out (%s): the model "
                    "served has fewer layers than the one saved (a num_hidden_layers lowered?)", len(named), which)
    if inside:
        log.warning("the checkpoint holds weights that its config.json leaves unused (%s%s): the model served is not "
                    "the one saved (a setting that uses them changed?)", inside[0],
                    f" and {len(inside) - 1} more" if len(inside) > 1 else "")


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
