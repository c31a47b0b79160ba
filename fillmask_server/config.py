"""Server configuration: one dataclass, filled from CLI flags, each with an environment variable.

Precedence: a flag on the command line beats its environment variable, which beats the default.
Every option is listed by ``--help`` with its default and its variable name.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from dataclasses import dataclass, fields

ENV_PREFIX = "FILLMASK_"
DEFAULT_MODEL = "google-bert/bert-base-uncased"


@dataclass(frozen=True)
class Config:
    """Everything the server needs to know, validated once at start-up."""

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8765
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue: int = 1024
    max_wait_ms: float = 0.0
    max_text_chars: int = 2000
    max_masks: int = 8
    max_top_k: int = 100
    max_targets: int = 100
    max_frame_bytes: int = 65536
    device: str = "auto"
    dtype: str = "float32"
    torch_threads: int = 0
    shutdown_timeout: float = 30.0
    log_level: str = "info"


_HELP: dict[str, str] = {
    "model": "fill-mask model: a Hugging Face model id or a local directory",
    "host": "address to listen on (0.0.0.0 for all interfaces)",
    "port": "TCP port for WebSocket and HTTP (0 picks a free port)",
    "max_batch_size": "most requests in one model batch",
    "max_batch_tokens": "most padded tokens (rows x longest row) in one model batch",
    "max_queue": "most requests waiting for the model; beyond it requests are answered 503",
    "max_wait_ms": "wait at most this long (from the oldest queued request) for a fuller batch; 0 = never wait",
    "max_text_chars": "longest text accepted, in characters",
    "max_masks": "most mask tokens in one text",
    "max_top_k": "largest top_k a request may ask for",
    "max_targets": "most targets in one request",
    "max_frame_bytes": "largest WebSocket frame; larger ones close the connection with 1009",
    "device": "auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps",
    "dtype": "float32 (exact, default), bfloat16 or float16 (faster where the hardware has them), int8 (dynamic "
             "quantisation, CPU); the fast modes give scores that differ from float32 in later digits",
    "torch_threads": "torch intra-op threads; 0 = all cores",
    "shutdown_timeout": "seconds to let accepted requests finish after SIGTERM/SIGINT",
    "log_level": "debug, info, warning or error",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("float32", "bfloat16", "float16", "int8"),
    "log_level": ("debug", "info", "warning", "error"),
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help text without breaking model ids such as google-bert/bert-base-uncased at hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ws_server.py",
        description="WebSocket fill-mask inference server with dynamic batching.",
        formatter_class=_HelpFormatter,
    )
    for f in fields(Config):
        kind = type(f.default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=kind,
            default=argparse.SUPPRESS,
            choices=_CHOICES.get(f.name),
            help=f"{_HELP[f.name]} [env {env_name(f.name)}] (default: {f.default})",
        )
    return parser


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Flags over environment over defaults; exits with a one-line usage error on bad values."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    values: dict[str, object] = {}
    for f in fields(Config):
        if f.name in args:
            values[f.name] = args[f.name]
            continue
        raw = environ.get(env_name(f.name))
        if raw is None or raw == "":
            continue
        kind = type(f.default)
        try:
            value = kind(raw)
        except ValueError:
            parser.error(f"{env_name(f.name)}={raw!r} is not a valid {kind.__name__}")
        choices = _CHOICES.get(f.name)
        if choices and value not in choices:
            parser.error(f"{env_name(f.name)}={raw!r} must be one of {', '.join(choices)}")
        values[f.name] = value
    config = Config(**values)  # type: ignore[arg-type]
    problem = validate(config)
    if problem:
        parser.error(problem)
    return config


def validate(config: Config) -> str | None:
    """Return a one-line description of the first nonsensical value, or None."""
    positive = ("max_batch_size", "max_batch_tokens", "max_queue", "max_text_chars", "max_masks",
                "max_top_k", "max_targets", "max_frame_bytes")
    for name in positive:
        if getattr(config, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if config.max_wait_ms < 0:
        return "--max-wait-ms must not be negative"
    if config.shutdown_timeout < 0:
        return "--shutdown-timeout must not be negative"
    if config.torch_threads < 0:
        return "--torch-threads must not be negative"
    if not 0 <= config.port <= 65535:
        return "--port must be between 0 and 65535"
    return None
