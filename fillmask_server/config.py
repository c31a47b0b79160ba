"""Server configuration: one dataclass, filled from CLI flags, each with an environment variable.

Precedence: a flag on the command line beats its environment variable, which beats the default.
Every option is listed by ``--help`` with its default and its variable name.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import os
import re
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from fillmask_client.wire import MAX_SAFE_INTEGER

from . import __version__
from .access import HostPolicy, OriginPolicy, ProxyPolicy, tls_context
from .batching import DEFAULT_BATCH_ROWS, DEFAULT_BATCH_TOKENS
from .cpus import usable_cpus

ENV_PREFIX = "FILLMASK_"
DEFAULT_MODEL = "google-bert/bert-base-uncased"


@dataclass(frozen=True)
class Config:
    """Everything the server needs to know, validated once at start-up."""

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8765
    max_batch_size: int = DEFAULT_BATCH_ROWS
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS
    max_queue: int = 1024
    max_wait_ms: float = 0.0
    anticipate_ms: float = 0.0
    max_length_ratio: float = 0.0
    max_batch_ms: float = 0.0
    max_missed_batches: int = 2
    max_text_chars: int = 2000
    max_masks: int = 8
    max_top_k: int = 100
    max_targets: int = 100
    max_frame_bytes: int = 65536
    max_result_bytes: int = 1_048_576
    max_answer_bytes: int = 268_435_456
    device: str = "auto"
    dtype: str = "float32"
    torch_threads: int = 0
    forward_parts: int = 0
    calibration_s: float = 2.0
    quiet_lone: str = "auto"
    forward: str = "traced"
    projection: str = "auto"
    shutdown_timeout: float = 30.0
    drain_delay: float = 0.0
    log_level: str = "info"
    gil_switch_ms: float = 0.0
    max_connections: int = 1000
    max_inflight_per_connection: int = 256
    max_send_buffer_bytes: int = 1_048_576
    send_timeout: float = 30.0
    allowed_origins: str = "same-origin,localhost"
    allowed_hosts: str = "localhost,ip"
    forwarded_allow_ips: str = ""
    token: str = ""
    certfile: str = ""
    keyfile: str = ""


_HELP: dict[str, str] = {
    "model": "fill-mask model: a Hugging Face model id or a local directory",
    "host": "address to listen on (0.0.0.0: every IPv4 interface; '' (empty, as a flag: an empty variable counts "
            "as unset): every interface, IPv4 and IPv6; :: is IPv6 only)",
    "port": "TCP port for WebSocket and HTTP (0 picks a free port)",
    "max_batch_size": "most requests in one model batch; 0 = automatic: 64, scaled up at start-up by the "
                      "calibration's cost model (up to 8x) while a batch of the default caps spends more than 5%% of "
                      "its time on per-batch overhead (a GPU's kernel launches, say), or with --max-batch-ms set, "
                      "while it takes less than that; never below 64",
    "max_batch_tokens": "most tokens one model batch occupies, padding included (rows x widest row); 0 = "
                        "automatic: 8192, scaled as --max-batch-size 0 is",
    "max_queue": "most requests waiting for the model; beyond it requests are answered 503, and from half of it "
                 "on a connection holding its fair share is answered 429",
    "max_wait_ms": "wait at most this long (from the oldest queued request) for a fuller batch, and a request "
                   "with a deadline_ms at most half its time; 0 = never wait",
    "anticipate_ms": "after sending answers, wait at most this long (and at most 30%% of the last batch's time) for "
                     "the requests those clients are likely to send back, before starting a batch that is not full; "
                     "an idle server never waits; 0 = off. Only for clients that send again as soon as an answer "
                     "comes: with arrivals that do not follow answers it lengthens the tail",
    "max_length_ratio": "a fixed band: in one batch, the longest text at most this many times the shortest (in "
                        "tokens); a request that has missed --max-missed-batches widens it; 0 = automatic: the "
                        "measured cost model cuts each round of requests into the batches of neighbouring lengths "
                        "that take the least time in all (padding against per-batch overhead), each at most 3x wide",
    "max_batch_ms": "most predicted time of one batch (forward pass and decoding, from the measured cost model), so "
                    "that a light request never waits behind one long batch; 0 = automatic: 20 times the measured "
                    "per-batch overhead (at most 5%% of throughput lost to overhead), but never below 5 ms nor "
                    "below a full batch of plain requests as long as the longest waiting; also at most half the "
                    "time left to the tightest deadline waiting",
    "max_missed_batches": "tail bound with --max-length-ratio: a request the band has left out of this many "
                          "batches is in the next one, as its limits allow (the cost model's rounds need none: a "
                          "request runs in the round that takes it in)",
    "max_text_chars": "longest text accepted, in characters",
    "max_masks": "most mask tokens in one text",
    "max_top_k": "largest top_k a request may ask for (or the model's vocabulary size, where smaller)",
    "max_targets": "most targets in one request",
    "max_frame_bytes": "largest WebSocket frame a client may send; larger ones close the connection with 1009",
    "max_result_bytes": "largest answer a request may ask for: a request whose predictions could be larger (bounded "
                        "from top_k, its masks and its text before it runs) gets the error result_too_large",
    "max_answer_bytes": "memory for answers, all connections together: answers waiting to be sent plus those being "
                        "computed; beyond it only a connection with no answer pending may start a request (one), "
                        "so the worst case is this plus one answer per connection",
    "device": "auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps",
    "dtype": "float32 (exact, default), bfloat16 or float16 (faster where the hardware has them), int8 (dynamic "
             "quantisation, CPU); the fast modes give scores that differ from float32 in later digits",
    "torch_threads": "torch intra-op threads; 0 = measured at start-up (a few forward passes at each candidate "
                     "count), or torch's default (one per core, within the container's CPU quota) when "
                     "--calibration-s is 0",
    "forward_parts": "on a CPU, run each batch of several texts as this many parts side by side, each a forward "
                     "pass on an equal share of the torch threads (the parts meet once a batch, not at every "
                     "operator, so the server's other threads stall them less); 0 = measured at start-up with "
                     "the thread count, whether set or measured (one pass with --calibration-s 0 or on a GPU), "
                     "1 = one pass",
    "calibration_s": "time budget for the start-up calibration: the torch thread count, a lone request after a "
                     "quiet spell (--quiet-lone), the cost model's first coefficients, and for --dtype "
                     "bfloat16/float16/int8 its speed against float32 (a warning when slower); each measurement "
                     "takes at least two rounds, so a slow forward pass (a large vocabulary, a slow or busy CPU) "
                     "takes longer; 0 = skip it (the cost model then starts from CPU defaults and learns online)",
    "quiet_lone": "auto: the start-up calibration times a lone request after the torch thread team has been "
                  "quiet, on one thread and on the team, and where one thread is faster (waking a sleeping team "
                  "is slow on some machines, virtual ones above all) by more than it is slower back to back, runs "
                  "such requests on one thread, timing them as it serves and choosing again; off: a lone request "
                  "always runs on its layout's threads (nothing timed), as with --torch-threads set or "
                  "--calibration-s 0",
    "forward": "traced: run encoder, head and softmax as one TorchScript graph, which holds the GIL once per "
               "batch instead of once per operator, so other threads' Python work cannot stall the model (checked "
               "bit for bit against eager at start-up, which it falls back to); eager: plain PyTorch modules",
    "projection": "auto: on a CPU in float32, the traced graph runs the output projection (hidden states to the "
                  "vocabulary) on oneDNN's kernel with a packed copy of its weight where the start-up measures it "
                  "at most 0.9x the time of torch's own and its logits agree within rounding (the copy costs the "
                  "weight's memory); torch: the model's own kernel always",
    "shutdown_timeout": "seconds to let accepted requests finish after SIGTERM, SIGINT or SIGHUP",
    "drain_delay": "on SIGTERM, seconds to go on serving with /readyz answering 503 before the drain starts, so "
                   "that a load balancer's health check takes this server out first (the Kubernetes preStop "
                   "pattern); SIGINT (Ctrl-C) and SIGHUP (a closed terminal) skip it",
    "log_level": "debug, info, warning or error (warning and error also leave out the start-up's progress "
                 "lines)",
    "gil_switch_ms": "the interpreter's switch interval: how long a thread running Python may keep the GIL while "
                     "another waits for it. Shorter hands it to the model thread sooner after its forward pass "
                     "(while it waits, its torch threads idle); longer spends less CPU on hand-overs between the "
                     "server's other threads; 0 = automatic: 1 ms while the model runs on one CPU thread, 0.2 ms "
                     "on more (or on a GPU), following the thread count in use",
    "max_connections": "most open WebSocket connections; beyond it the handshake is refused with HTTP 503",
    "max_inflight_per_connection": "most requests in flight on one connection; beyond it requests get the error "
                                   "too_many_inflight",
    "max_send_buffer_bytes": "answers waiting for one client (unsent, or being computed) beyond which the server "
                             "stops reading that connection's frames and starts none of its queued requests until "
                             "its client reads (one request always may start)",
    "send_timeout": "seconds a client with answers waiting for it may take nothing from its socket before the "
                    "connection is closed with 1008 (also in a drain)",
    "allowed_origins": "comma-separated origins whose pages may open a WebSocket (e.g. https://app.example.com), "
                       "plus the keywords same-origin, localhost, null (pages opened from disk) and * (any page); "
                       "others get HTTP 403. Clients that send no Origin header (not browsers) are always allowed",
    "allowed_hosts": "comma-separated Host names this server answers to (e.g. fill.example.com, *.example.com, "
                     "fill.example.com:443), plus the keywords localhost (localhost, *.localhost, loopback addresses), "
                     "ip (any IP address) and * (any host, e.g. behind a proxy that rewrites Host); the --host address "
                     "is always allowed. Others get HTTP 421, which stops DNS rebinding; /healthz and /readyz answer "
                     "any Host",
    "forwarded_allow_ips": "comma-separated addresses or networks of the proxies in front of this server (e.g. "
                           "10.0.0.5 or 10.0.0.0/8; * for any peer) whose X-Forwarded-For header names the client "
                           "in log lines (as 'CLIENT through PROXY:PORT'); by default none, and the header is "
                           "ignored (any client can write it). Nothing is allowed or refused by it",
    "token": "shared secret clients must present as 'Authorization: Bearer TOKEN' or ?token=TOKEN on the "
             "WebSocket and /metrics requests (HTTP 401 otherwise); leave it out to serve without one (an empty "
             "token is refused)",
    "certfile": "PEM certificate chain (may also hold the key): serve wss:// and https:// instead of ws:// and http://",
    "keyfile": "PEM private key for --certfile, when the certificate file does not hold it",
}

#: Settings with a fixed set of values, each in lower case; a value is taken in any case (``WARNING``).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("float32", "bfloat16", "float16", "int8"),
    "log_level": ("debug", "info", "warning", "error"),
    "forward": ("traced", "eager"),
    "projection": ("auto", "torch"),
    "quiet_lone": ("auto", "off"),
}


def _value(name: str, raw: str) -> object:
    """The setting ``name``'s value from the text ``raw`` (a flag's or a variable's): of its default's
    type, in lower case for a setting of ``CHOICES``; ValueError when it is not of that type."""
    kind: type[typing.Any] = type(next(f for f in fields(Config) if f.name == name).default)
    return raw.lower() if name in CHOICES else kind(raw)


def _choice(name: str, raw: str) -> str:
    """A flag's value for the setting ``name`` of ``CHOICES``, in lower case; the refusal names the value
    as given."""
    value = raw.lower()
    if value not in CHOICES[name]:
        raise argparse.ArgumentTypeError(f"invalid choice: {raw!r} (choose from {', '.join(CHOICES[name])})")
    return value


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help text without breaking model ids such as google-bert/bert-base-uncased at hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


# --help lists the options in these groups, in this order (every Config field is in exactly one).
_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("model", ("model", "device", "dtype", "torch_threads", "forward_parts", "forward", "projection",
               "calibration_s", "quiet_lone")),
    ("listening", ("host", "port", "certfile", "keyfile")),
    ("batching and queue", ("max_batch_size", "max_batch_tokens", "max_length_ratio", "max_batch_ms",
                            "max_missed_batches", "max_wait_ms", "anticipate_ms", "max_queue")),
    ("request limits", ("max_text_chars", "max_masks", "max_top_k", "max_targets", "max_frame_bytes",
                        "max_result_bytes")),
    ("connections and access", ("max_connections", "max_inflight_per_connection", "max_send_buffer_bytes",
                                "max_answer_bytes",
                                "send_timeout", "allowed_origins", "allowed_hosts", "forwarded_allow_ips",
                                "token")),
    ("process", ("shutdown_timeout", "drain_delay", "log_level", "gil_switch_ms")),
]
_METAVAR: dict[str, str] = {
    "model": "ID_OR_DIR", "device": "DEVICE", "host": "HOST", "certfile": "PATH", "keyfile": "PATH",
    "max_wait_ms": "MS", "anticipate_ms": "MS", "max_batch_ms": "MS", "gil_switch_ms": "MS",
    "calibration_s": "SECONDS", "max_length_ratio": "RATIO", "send_timeout": "SECONDS",
    "shutdown_timeout": "SECONDS", "drain_delay": "SECONDS",
    "allowed_origins": "ORIGINS", "allowed_hosts": "HOSTS", "forwarded_allow_ips": "ADDRESSES", "token": "TOKEN",
    "max_send_buffer_bytes": "BYTES",
    "max_frame_bytes": "BYTES", "max_result_bytes": "BYTES", "max_answer_bytes": "BYTES",
}


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is the server's one line (``error: what was wrong; see
    PROG --help``, exit status 2), not a usage block of every option with the error under it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        description="WebSocket fill-mask inference server with dynamic batching. Every option can also be "
                    f"set by the environment variable shown ({ENV_PREFIX}NAME); a flag beats its variable.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    by_name = {f.name: f for f in fields(Config)}
    assert sorted(n for _, names in _GROUPS for n in names) == sorted(by_name), "every option in one group"
    for title, names in _GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            default = by_name[name].default
            group.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                type=functools.partial(_choice, name) if name in CHOICES else type(default),
                default=argparse.SUPPRESS,
                metavar="{" + ",".join(CHOICES[name]) + "}" if name in CHOICES else _METAVAR.get(name, "N"),
                help=f"{_HELP[name]} [env {env_name(name)}] (default: {_shown_default(default)})",
            )
    return parser


def _shown_default(default: object) -> str:
    """The default as --help shows it (argparse expands % in help text, so it is escaped)."""
    if default == "":
        return "none"
    return str(default).replace("%", "%%")


def load_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Flags over environment over defaults; exits with a one-line usage error on bad values."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    values: dict[str, object] = {}
    if args.get("token") == "":  # as from --token "$UNSET": never serve open by mistake
        parser.error("--token is empty: give the token, or leave --token out to serve without one")
    for f in fields(Config):
        if f.name in args:
            values[f.name] = args[f.name]
            continue
        raw = environ.get(env_name(f.name))
        if raw == "" and f.name == "token":  # a secret that came out empty: never serve open by mistake
            parser.error(f"{env_name(f.name)} is set but empty: set the token, or unset the variable to serve "
                         "without one")
        if raw is None or raw == "":
            continue
        problem = _variable_problem(f.name, raw)
        if problem:
            parser.error(problem)
        values[f.name] = _value(f.name, raw)
    config = Config(**values)  # type: ignore[arg-type]
    problem = validate(config)
    if problem:
        parser.error(_named_source(problem, args, environ))
    return config


def _variable_problem(name: str, raw: str, alone: bool = False) -> str | None:
    """Why ``raw`` is no value for the setting ``name`` (from its variable), or None: not of its type, or
    not one of its choices; with ``alone``, also what ``validate`` says of it with every other setting
    at its default."""
    kind = type(next(f for f in fields(Config) if f.name == name).default)
    try:
        value = _value(name, raw)
    except ValueError:
        return f"{env_name(name)}={raw!r} is not a valid {kind.__name__}"
    choices = CHOICES.get(name)
    if choices and value not in choices:
        return f"{env_name(name)}={raw!r} must be one of {', '.join(choices)}"
    problem = validate(replace(Config(), **{name: value})) if alone else None  # type: ignore[arg-type]
    if problem and set(re.findall(r"--[a-z][a-z-]*", problem)) == {f"--{name.replace('_', '-')}"}:  # (not a
        # rule between two settings, such as --keyfile's need of --certfile, which the flags may meet)
        return f"{env_name(name)}={'(hidden)' if name == 'token' else repr(raw)}: {problem}"
    return None


def overridden_variables(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning line for each setting's variable in ``environ`` whose value is not valid while its flag,
    also given in ``argv``, overrides it: ignored without a word, it would stop the server the day the
    flag goes. (Without the flag, ``load_config`` refuses it.)"""
    environ = os.environ if environ is None else environ
    given = vars(build_parser().parse_args(argv))  # (only the flags given: the parser's defaults are suppressed)
    lines = []
    for f in fields(Config):
        raw = environ.get(env_name(f.name))
        problem = _variable_problem(f.name, raw, alone=True) if raw and f.name in given else None
        if problem:
            lines.append(f"warning: {problem}; --{f.name.replace('_', '-')} overrides it, so it is ignored now")
    return lines


#: ``FILLMASK_*`` variables that are not the server's settings but belong to other parts of the project:
#: the client's (``FILLMASK_URL``), deploy/haproxy.cfg's, the README's test fixture's
#: (``FILLMASK_SERVER_DIR``, which the server it starts inherits), and the tests'.
OTHER_VARIABLES = ("FILLMASK_URL", "FILLMASK_REPLICA_", "FILLMASK_LB_", "FILLMASK_SERVER_DIR", "FILLMASK_TEST_",
                   "FILLMASK_CHROMIUM", "FILLMASK_UPDATE_SCREENSHOT")


#: A ``--token`` shorter than this gets a warning at start: the server does not slow down guessing.
MIN_TOKEN_CHARS = 16


#: The smallest ``fill_mask`` frame (protocol.md §3) around an empty text: what a frame holds beside its text.
_SMALLEST_REQUEST = b'{"type":"fill_mask","id":0,"text":""}'


#: The ports browsers refuse to fetch from or open a WebSocket to (the Fetch standard's "bad ports",
#: those of other protocols): a server on one serves every client but a browser (web_demo/lib.js has
#: the same list, tests/test_web_demo.py checks).
BROWSER_BLOCKED_PORTS = frozenset({
    1, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23, 25, 37, 42, 43, 53, 69, 77, 79, 87, 95, 101, 102, 103, 104,
    109, 110, 111, 113, 115, 117, 119, 123, 135, 137, 139, 143, 161, 179, 389, 427, 465, 512, 513, 514, 515,
    526, 530, 531, 532, 540, 548, 554, 556, 563, 587, 601, 636, 989, 990, 993, 995, 1719, 1720, 1723, 2049,
    3659, 4045, 4190, 5060, 5061, 6000, 6566, 6665, 6666, 6667, 6668, 6669, 6679, 6697, 10080})


def setting_warnings(config: Config, cpus: int | None = None) -> list[str]:
    """One warning line for each setting that works but is unwise (start-up prints them): a short
    ``--token``, which a client could guess (the server answers wrong tokens at full speed); more
    ``--torch-threads`` or ``--forward-parts`` than the ``cpus`` this process may use (``usable_cpus``),
    which only slow the forward pass (far more are refused: ``validate``); a ``--max-text-chars`` that
    no frame within ``--max-frame-bytes`` can carry; a ``--port`` browsers refuse."""
    lines = []
    if config.port in BROWSER_BLOCKED_PORTS:
        lines.append(f"warning: --port {config.port} is one that browsers refuse to connect to (the Fetch standard "
                     "blocks it: another protocol's port), so neither the demo page nor a client in a browser "
                     "can reach this server directly; other clients can; for browsers choose another port, e.g. "
                     "8765")
    if config.token and len(config.token) < MIN_TOKEN_CHARS:
        lines.append(f"warning: --token is {len(config.token)} characters long, and the server does not slow down "
                     f"clients that guess: use {MIN_TOKEN_CHARS} or more random characters (python -c \"import "
                     "secrets; print(secrets.token_urlsafe(24))\")")
    cpus = usable_cpus() if cpus is None else cpus
    if config.torch_threads > cpus:
        lines.append(f"warning: --torch-threads {config.torch_threads} is more than the {_cpus(cpus)} this process may "
                     "use, and threads beyond them only slow the forward pass: use at most "
                     f"{cpus}, or 0 to measure")
    if config.forward_parts > cpus:
        lines.append(f"warning: --forward-parts {config.forward_parts} is more than the {_cpus(cpus)} this process may "
                     f"use, and each part is a thread of its own: use at most {cpus}")
    longest = config.max_frame_bytes - len(_SMALLEST_REQUEST)  # (a character is one byte or more in UTF-8)
    if config.max_text_chars > longest:
        lines.append(f"warning: --max-text-chars {config.max_text_chars} is more than a frame of --max-frame-bytes "
                     f"{config.max_frame_bytes} can carry: a text of more than about {longest} bytes (a character "
                     "outside ASCII takes two to four, more where the client escapes it) closes its connection "
                     "with 1009 instead of being answered; "
                     "raise --max-frame-bytes or lower --max-text-chars")
    threads = config.torch_threads or cpus
    if config.forward_parts > 1 and threads % config.forward_parts and config.forward_parts <= threads:
        used = threads // config.forward_parts * config.forward_parts
        lines.append(f"warning: {config.forward_parts} forward parts share {threads} torch threads in equal shares: "
                     f"{used} of them run ({threads // config.forward_parts} a part)")
    return lines


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning line for each ``FILLMASK_*`` variable set in ``environ`` that is no setting of the
    server (a misspelling is otherwise ignored without a word), naming the nearest setting."""
    environ = os.environ if environ is None else environ
    settings = [f.name.upper() for f in fields(Config)]  # env_name without the prefix
    lines = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name.removeprefix(ENV_PREFIX) in settings \
                or name.startswith(OTHER_VARIABLES):
            continue
        near = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), settings, n=1)
        hint = (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near
                else f" (see {build_parser().prog} --help for the settings)")
        lines.append(f"warning: {name} is not a setting of this server and is ignored{hint}")
    return lines


def named_source(problem: str, argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """``problem`` with the environment variable named that set the first option it names, when no flag
    in ``argv`` set it (``_named_source``): for problems found after the configuration was read, such
    as a ``--device`` that torch does not know, from ``FILLMASK_DEVICE``."""
    args = vars(build_parser().parse_args(argv))
    return _named_source(problem, args, os.environ if environ is None else environ)


def _named_source(problem: str, args: dict[str, object], environ: Mapping[str, str]) -> str:
    """``problem`` (which names options as flags), prefixed with the environment variable that set
    the first option it names that no flag set: ``FILLMASK_MAX_QUEUE='0': --max-queue must
    be at least 1``, so that nobody looks for a flag they never passed. Unchanged when flags set them all."""
    named = sorted((found.start(), f.name) for f in fields(Config)
                   if (found := re.search(rf"--{f.name.replace('_', '-')}(?![\w-])", problem)))
    from_environment = [name for _, name in named if name not in args and environ.get(env_name(name))]
    if not from_environment:
        return problem
    name = from_environment[0]
    shown = "(hidden)" if name == "token" else repr(environ[env_name(name)])
    return f"{env_name(name)}={shown}: {problem}"


#: The least ``--max-frame-bytes`` and ``--max-result-bytes``: below it no request with a short text
#: fits (its frame, or its predictions' bound at one candidate), and a server that refuses everything
#: is a mistake better reported at start.
MIN_MESSAGE_BYTES = 1024
#: ``--torch-threads`` above this many per CPU the process may use is refused: past the CPUs, more
#: threads only slow the forward pass, and thousands fail to start at all.
MAX_THREADS_PER_CPU = 4


def _cpus(count: int) -> str:
    return f"{count} CPU" if count == 1 else f"{count} CPUs"


def _host_problem(host: str) -> str | None:
    """What makes ``--host`` no host, in a form its users write (before any lookup, which says only
    that the name does not resolve), or None: a URL, an IPv6 address in brackets (as a URL writes it),
    a host with its port."""
    if "://" in host or "/" in host:
        return f"--host {host!r} is no host name or address: give the host alone (such as 127.0.0.1, or 0.0.0.0)"
    if host.startswith("[") and host.endswith("]"):
        return f"--host {host!r}: write an IPv6 address without its brackets (--host {host[1:-1]})"
    name, _, port = host.rpartition(":")
    if port.isdigit() and name and (name.count(":") == 0 or name.startswith("[")):
        return (f"--host {host!r} holds a port: give the port with --port (--host {name.strip('[]')} "
                f"--port {port})")
    return None


def checked(config: Config) -> Config:
    """``config``, for a ``Config`` built in code (a program that embeds the server); ``ValueError``
    with ``validate``'s one line where the command line would refuse it."""
    problem = validate(config)
    if problem is not None:
        raise ValueError(problem)
    return config


#: The types a setting's annotation names, and what a value of one is called (``validate``).
_SETTING_TYPES = {"int": ((int,), "a whole number"), "float": ((int, float), "a number"), "str": ((str,), "text")}


def validate(config: Config) -> str | None:
    """Return a one-line description of the first nonsensical value, or None."""
    for f in fields(Config):  # (a Config built in code: the command line's parser checks each type)
        value = getattr(config, f.name)
        takes, kind = _SETTING_TYPES.get(str(f.type), ((), ""))
        if takes and (isinstance(value, bool) or not isinstance(value, takes)):
            return f"--{f.name.replace('_', '-')} must be {kind}, not {value!r}"[:200]
    for f in fields(Config):  # NaN passes every comparison below (all are false), and no duration is endless
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{f.name.replace('_', '-')} must be a finite number, not {value}"
    for f in fields(Config):  # (the hello frame carries them: a larger one failed to encode, a traceback)
        value = getattr(config, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_SAFE_INTEGER:
            return (f"--{f.name.replace('_', '-')} must be at most {MAX_SAFE_INTEGER}, the largest number every "
                    "client reads exactly")
    for name, choices in CHOICES.items():  # (the command line's parser checks them; a Config built in code too)
        if getattr(config, name) not in choices:
            return f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, not {getattr(config, name)!r}"
    positive = ("max_queue", "max_text_chars", "max_masks", "max_top_k", "max_targets", "max_connections",
                "max_inflight_per_connection", "max_send_buffer_bytes", "max_answer_bytes")  # (and two below)
    for name in positive:
        if getattr(config, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    for name in ("max_frame_bytes", "max_result_bytes"):
        if getattr(config, name) < MIN_MESSAGE_BYTES:
            return (f"--{name.replace('_', '-')} must be at least {MIN_MESSAGE_BYTES}: below it no request with a "
                    "short text fits")
    cpus = usable_cpus()
    if config.torch_threads > MAX_THREADS_PER_CPU * cpus:
        return (f"--torch-threads {config.torch_threads} is far more than the {_cpus(cpus)} this process may use "
                f"(the most accepted is {MAX_THREADS_PER_CPU * cpus}); threads beyond the CPUs only slow the "
                f"forward pass: use at most {cpus}, or 0 to measure")
    if config.torch_threads and config.forward_parts > config.torch_threads:
        return (f"--forward-parts {config.forward_parts} needs at least as many --torch-threads (one a part), "
                f"not {config.torch_threads}: give the parts more threads, or fewer parts")
    if config.forward_parts > MAX_THREADS_PER_CPU * cpus:
        return (f"--forward-parts {config.forward_parts} is far more than the {_cpus(cpus)} this process may use "
                f"(the most accepted is {MAX_THREADS_PER_CPU * cpus}); each part is a thread of its own: use at "
                f"most {cpus}, 1 for one pass, or 0 to measure")
    if config.max_length_ratio != 0 and config.max_length_ratio < 1:
        return "--max-length-ratio must be 0 (automatic) or at least 1"
    for name in ("max_batch_size", "max_batch_tokens"):
        if getattr(config, name) < 0:
            return f"--{name.replace('_', '-')} must be 0 (automatic) or at least 1"
    for name in ("max_wait_ms", "anticipate_ms", "shutdown_timeout", "drain_delay", "max_batch_ms",
                 "max_missed_batches", "calibration_s", "torch_threads", "forward_parts"):
        if getattr(config, name) < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    if not 0 <= config.port <= 65535:
        return "--port must be between 0 and 65535"
    if not config.model.strip():  # (an empty one was read as this directory, "''")
        return "--model must not be empty: give a Hugging Face model id or a local directory"
    if not config.device.strip():  # (torch's words: "Device string must not be empty")
        return "--device must not be empty: choose auto, cpu, cuda, cuda:N or mps"
    host = _host_problem(config.host)
    if host is not None:
        return host
    if config.send_timeout <= 0:
        return "--send-timeout must be greater than 0"
    if config.gil_switch_ms != 0 and not 0.01 <= config.gil_switch_ms <= 1000:
        return "--gil-switch-ms must be 0 (automatic) or between 0.01 and 1000"
    try:
        OriginPolicy.parse(config.allowed_origins)
        HostPolicy.parse(config.allowed_hosts)
        ProxyPolicy.parse(config.forwarded_allow_ips)
    except ValueError as exc:
        return str(exc)
    if config.token != config.token.strip() or any(ord(c) < 33 or ord(c) > 126 for c in config.token):
        return "--token must be printable ASCII without spaces (it travels in an HTTP header and a URL)"
    if config.keyfile and not config.certfile:
        return "--keyfile needs --certfile (the certificate the key belongs to)"
    if config.certfile:
        try:
            tls_context(config.certfile, config.keyfile)
        except ValueError as exc:
            return f"--certfile/--keyfile: {exc}"
    return None
