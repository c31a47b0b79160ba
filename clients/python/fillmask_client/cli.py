"""Command line: ``fillmask-client "Paris is the [MASK] of France."`` (or ``python -m fillmask_client``).

Texts come from the arguments, from ``-`` (standard input) or ``--file`` (``--file -``: standard
input), one per line; blank lines are skipped. With no texts given, standard input is read. Standard
input is read to its end before anything is sent (in a terminal the command says so: end with
Ctrl-D). Prints one table per text (one per mask when a text has several), or with ``--json`` each
text's raw terminal frame on one line, in input order (a request the client refuses before sending,
such as one over the server's ``limits.max_frame_bytes``, gets a line of the same shape as an
``error`` frame, with ``"id": null`` and ``"source": "client"``). A failed text is named by its
number and where it came from: ``text 3 (--file texts.txt line 4: '...')`` (all but a lone text given
as an argument, whose line is about it alone). Texts refused because
the server was busy end the run with a line saying what to do (``--retry``, a lower ``--concurrency``).

Exit status: 0 when every text got a result; 1 when a request failed (one line on stderr per failed
text, up to ``NAMED_PER_REASON`` for each failure reason and then one line saying more failed so, and
how many at the end (in the summary line, or with ``--quiet`` in a line of its own); the others still
print); 2 for a usage error, said on stderr before anything is sent (a
malformed ``--url``, a duration that is not a finite number, a text or input line that is not UTF-8,
a ``--cafile`` with no certificate), including ``--top-k``, ``--targets`` or
``--deadline-ms`` outside the server's limits (checked once against its ``hello``, §2); 3 when the
server cannot be reached within ``--timeout``, the connection is lost, or the server is shutting down
(``going_away``, §10): the run stops there with one line saying how far it got, unless ``--reconnect``
follows the server to its replacement (for up to ``--reconnect-timeout``, whatever ``--timeout`` is).
Only what waiting may fix (``ConnectError.transient``: refused, reset, 502/503/504...) is tried again
within ``--timeout``; any other connection failure (TLS against a plain server, a peer that is not a
fill-mask server, a 401 for the token...) ends the run at once with its one line. Runs of several
texts end with a summary line on stderr, Ctrl-C included (``interrupted; 5 texts: ...``, then exit
status 130, ``EXIT_INTERRUPTED``; what was printed before stays printed), and SIGTERM too
(``terminated; ...``, exit status 143, ``EXIT_TERMINATED``). While the command waits
for a server, it says ``waiting for the server… (Ns)`` on stderr once a second (with why, when that
changes: a failure, or ``connected, no hello frame yet``). When standard output is closed before the
run ends (``fillmask-client ... | head -1``), the run stops with exit status 141 (``EXIT_OUTPUT_CLOSED``,
128 + SIGPIPE, what a shell reports for a command that a closed pipe ended). Options and texts may come
in any order; everything after ``--`` is a text, so a text that could be taken for an option
(``-[MASK]``: a ``-`` and no space) goes there.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import io
import logging
import math
import os
import re
import signal
import ssl
import sys
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

import orjson

from ._version import __version__
from .async_client import DEFAULT_URL, MAX_CONNECTIONS, FillMaskClient
from .connection import GOING_AWAY_CODES, is_secure, redact, url_problem
from .errors import (
    ConnectError,
    ConnectionLostError,
    FillMaskError,
    OverloadedError,
    RequestError,
    UsageError,
    one_line,
)
from .frames import FillMaskResult
from .wire import SERVER_GONE_REASONS, retryable

#: Exit statuses of the command (documented in the module docstring and in ``--help``).
EXIT_OK, EXIT_REQUEST_FAILED, EXIT_USAGE, EXIT_CONNECTION = 0, 1, 2, 3
#: Ctrl-C (128 + SIGINT, as a shell reports a command that SIGINT ended).
EXIT_INTERRUPTED = 130
#: SIGTERM (``timeout(1)``, a supervisor): 128 + SIGTERM, after the same summary as Ctrl-C's.
EXIT_TERMINATED = 143
#: Standard output was closed before every outcome was printed (128 + SIGPIPE, as a shell reports it).
EXIT_OUTPUT_CLOSED = 141
#: The environment variable the server reads its ``--token`` from; the command reads it too.
TOKEN_ENV = "FILLMASK_TOKEN"
#: The server's URL when no --url is given (a server on another port, or behind a balancer).
URL_ENV = "FILLMASK_URL"
#: ``--timeout``'s default: longer than a server takes from its start to ``ready:`` (loading the model).
CONNECT_TIMEOUT_S = 30.0
#: ``--reconnect-timeout``'s default: long enough for a server to drain, exit and load its model again.
RECONNECT_TIMEOUT_S = 120.0
#: How often the command looks whether it is waiting for a server (it says so once a second).
WAIT_POLL_S = 0.1
#: The most failed texts named one by one for each failure reason (``no_mask``, ``queue_full``...); the
#: rest are counted in the summary line (``--json`` still prints a line for every text).
NAMED_PER_REASON = 10


class Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line on stderr (``fillmask-client: what was wrong; see
    fillmask-client --help``) and exit status 2, not the usage block followed by the error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> Parser:
    """The argument parser of the ``fillmask-client`` command (``parse_intermixed_args``: options and
    texts may come in any order)."""
    parser = Parser(
        prog="fillmask-client",
        description="Ask a fill-mask server to fill the [MASK] in each text.",
        epilog="exit status: 0 all answered, 1 a request failed, 2 usage error (also a value outside the "
               "server's limits), 3 server unreachable, lost or shutting down, 130 interrupted (Ctrl-C), 143 "
               "terminated (SIGTERM), "
               "141 standard output closed (e.g. piped into head). Everything after '--' is a text (a "
               "text such as '-[MASK]' goes there; '-' still reads standard input).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("texts", nargs="*", metavar="TEXT",
                        help="texts containing the mask token; '-' reads texts from stdin, one per line "
                             "(the default when no TEXT and no --file is given and stdin is not a terminal)")
    parser.add_argument("--file", "-f", metavar="PATH",
                        help="read texts from PATH, one per line ('-': standard input); blank lines are skipped, "
                             "and a failed text is reported with its line number")
    parser.add_argument("--url", action="append", metavar="URL",
                        help=f"server WebSocket URL (default: ${URL_ENV}, else {DEFAULT_URL}); repeat it to "
                             "spread the texts over several servers")
    parser.add_argument("--top-k", "-k", type=int, metavar="K", help="candidates per mask (server default: 5)")
    parser.add_argument("--targets", "-t", action="append", metavar="WORDS",
                        help="only score these words: comma-separated, may be repeated")
    parser.add_argument("--deadline-ms", type=float, metavar="MS",
                        help="give up on a request still queued after MS milliseconds (answered 504)")
    parser.add_argument("--concurrency", "-c", type=int, metavar="N",
                        help="most requests in flight at once (default: the server's max_batch_size per "
                             "connection, and at most half its max_queue)")
    parser.add_argument("--connections", type=int, default=1, metavar="N",
                        help="connections per URL; each request goes on the least busy one (several "
                             "replicas behind one load-balancer URL: use about one per replica) "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print each text's raw terminal frame as one line of JSON, in input order: the n-th "
                             "line is the n-th text's (ids are per connection, so join by line); a request refused "
                             "before sending gets an error line with \"source\": \"client\"")
    parser.add_argument("--retry", action="store_true",
                        help="resend requests the server answers 503 queue_full or 429 queue_share, after its "
                             "retry_after_ms")
    parser.add_argument("--reconnect", action="store_true",
                        help="when a server shuts down (going_away) or the connection drops, reconnect (to "
                             "the same URL: a load balancer, or a restarted server) and resend what it did not "
                             "answer, instead of stopping with exit status 3")
    parser.add_argument("--reconnect-timeout", type=float, default=RECONNECT_TIMEOUT_S, metavar="S",
                        help="with --reconnect: seconds to wait for a server that went away to be back "
                             "(a restart: drain, exit, load), whatever --timeout is (default: %(default)g)")
    parser.add_argument("--timeout", type=float, default=CONNECT_TIMEOUT_S, metavar="S",
                        help="seconds to wait for a server that is starting (connection refused, or 503) "
                             "at the start of the run, and for each handshake and hello (default: %(default)g)")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no summary line at the end of the run, and no 'waiting for the server' lines")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"the server's --token, sent as 'Authorization: Bearer TOKEN' (default: ${TOKEN_ENV})")
    parser.add_argument("--cafile", metavar="PATH",
                        help="for wss:// URLs: trust the certificate(s) in PATH, e.g. the server's self-signed one")
    return parser


class Text(str):
    """A text to send, and where it came from (``origin``: ``argument 2``, ``--file texts.txt line 4``,
    ``standard input line 3``), for the line that reports its failure; ``line``: its line number when it
    was read from lines (a file or standard input), else None. Blank lines are skipped, so the n-th
    text is not always on line n. Equal to (and sent as) the plain string."""

    origin: str
    line: int | None

    def __new__(cls, text: str, origin: str, line: int | None = None) -> Text:
        made = super().__new__(cls, text)
        made.origin, made.line = origin, line
        return made


class BadInput(ValueError):
    """A text cannot be sent as given (it is not valid UTF-8); the message names where it came from."""


#: How much of an input ``read_lines`` reads (and checks) at a time.
READ_CHUNK = 1 << 16


def read_lines(stream: BinaryIO | TextIO, name: str = "standard input") -> list[Text]:
    """The non-blank lines of ``stream``, decoded as UTF-8 and stripped: one text each, its ``origin``
    ``NAME line N`` (N counts every line, blank ones too).

    Lines end at ``\\n``, ``\\r\\n`` or ``\\r``. ``BadInput`` names ``name`` and the line when the bytes are
    not UTF-8 (a text stream's lone surrogates, as ``errors='surrogateescape'`` makes them, count as such).
    The input is decoded as it is read, ``READ_CHUNK`` at a time: the first byte that is not UTF-8 ends
    the read there, so an endless input (``/dev/urandom``) that is not text is refused at once.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts: list[str] = []
    while True:
        chunk = stream.read1(READ_CHUNK) if isinstance(stream, io.BufferedIOBase) else stream.read(READ_CHUNK)
        data = chunk.encode("utf-8", "surrogatepass") if isinstance(chunk, str) else chunk
        try:
            parts.append(decoder.decode(data, final=not chunk))
        except UnicodeDecodeError as exc:
            # ``exc.object``: the bytes the decoder held back from the chunk before, then this chunk's.
            before = "".join(parts) + exc.object[: exc.start].decode("utf-8")
            line = len(re.split(r"\r\n|\r|\n", before))  # the lines before it, plus its own
            raise BadInput(f"{name}: line {line} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x}); "
                           f"save it as UTF-8") from None
        if not chunk:
            break
    content = "".join(parts)
    return [Text(line.strip(), f"{name} line {number}", number)
            for number, line in enumerate(re.split(r"\r\n|\r|\n", content), start=1) if line.strip()]


def collect_texts(args: argparse.Namespace, stdin: BinaryIO | TextIO) -> list[Text]:
    """Texts in the order given: arguments (``-`` expands to stdin's lines), then ``--file``'s lines
    (``--file -``: stdin's). Standard input is read to its end before anything is sent.

    Every text returned is valid Unicode (``BadInput`` otherwise, before anything is sent).
    """
    texts: list[Text] = []
    for number, text in enumerate(args.texts, start=1):
        if text == "-":
            texts.extend(read_lines(stdin))
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8, as Python decodes arguments on POSIX
            raise BadInput(f"TEXT argument {number} is not valid UTF-8: {_one_line(ascii(text))}") from None
        texts.append(Text(text, f"argument {number}"))
    if args.file == "-":
        texts.extend(read_lines(stdin))
    elif args.file is not None:
        with open(args.file, "rb") as handle:
            texts.extend(read_lines(handle, f"--file {shown_path(args.file)}"))
    if not args.texts and args.file is None:
        texts.extend(read_lines(stdin))
    return texts


def parse_targets(values: Sequence[str] | None) -> list[str] | None:
    """``--targets a,b --targets c`` as ``["a", "b", "c"]``; ``None`` when not given (``[]``: given, but blank)."""
    if values is None:
        return None
    return [word.strip() for value in values for word in value.split(",") if word.strip()]


def limits_problem(top_k: int | None, targets: list[str] | None, deadline_ms: float | None,
                   limits: dict[str, Any]) -> str | None:
    """Why a flag's value is outside the server's ``limits`` (§2, §3), naming the flag; ``None`` if none is.

    Checked once, before any text is sent: otherwise every text would get the same error from the server.
    A limit the server does not announce is not checked here (the server still is).
    """
    bounds = limits.get("top_k")
    if top_k is not None and isinstance(bounds, dict):
        low, high = bounds.get("min"), bounds.get("max")
        if isinstance(low, int) and isinstance(high, int) and not low <= top_k <= high:
            return f"--top-k {top_k}: the server accepts {low} to {high}"
    if targets is not None:
        most = limits.get("max_targets")
        if isinstance(most, int) and len(targets) > most:
            return f"--targets: {len(targets)} words; the server accepts at most {most}"
        longest = limits.get("max_target_chars")
        too_long = [word for word in targets if isinstance(longest, int) and len(word) > longest]
        if too_long:
            return (f"--targets: {_one_line(too_long[0], 30)!r} has {len(too_long[0])} characters; the server "
                    f"accepts at most {longest}")
    latest = limits.get("max_deadline_ms")
    if deadline_ms is not None and isinstance(latest, (int, float)) and deadline_ms > latest:
        return f"--deadline-ms {_number(deadline_ms)}: the server accepts at most {_number(latest)}"
    return None


def format_table(text: str, result: FillMaskResult) -> str:
    """A readable table of one text's predictions: rank, token, score, sequence; one table per mask.

    Columns are aligned whatever the scores look like (``0.5000`` beside ``2.03e-05``). Every string
    shown (the text, and what the server sent: each ``token_str`` and ``sequence``, the targets' notes)
    passes ``printable``: the table holds no control character, so a server cannot clear or recolour the
    terminal, nor add lines of its own; ``--json`` prints the frame as received instead.
    """
    lines = [printable(text), *target_notes(result)]
    tables = result.per_mask()
    for number, predictions in enumerate(tables, start=1):
        if len(tables) > 1:
            lines.append(f"mask {number} of {len(tables)}")
        tokens = [printable(str(p.get("token_str", ""))) for p in predictions]
        scores = [_score(float(p.get("score", 0.0))) for p in predictions]
        token_width = max([len("token"), *(len(token) for token in tokens)])
        score_width = max([len("score"), *(len(score) for score in scores)])
        lines.append(f"{'rank':>4}  {'token':<{token_width}}  {'score':>{score_width}}  sequence")
        for rank, (prediction, token, score) in enumerate(zip(predictions, tokens, scores, strict=True), start=1):
            sequence = printable(str(prediction.get("sequence", "")))
            lines.append(f"{rank:>4}  {token:<{token_width}}  {score:>{score_width}}  {sequence}")
    return "\n".join(lines)


def printable(text: str) -> str:
    """``text`` with every control character (escape, carriage return, bell, line breaks, C1 codes)
    as a space, for a terminal: ``errors.one_line``, the cleaning of a server's messages, without its
    cut (a table shows a sequence whole). The same length as ``text``, so columns stay aligned."""
    return one_line(text, max(len(text), 1))


def target_notes(result: FillMaskResult) -> list[str]:
    """One line per target that was not scored as given (§4 ``targets``): ``note: target "new york" was
    scored as "new"`` (like the pipeline, the server scores a multi-token target's first sub-token), or
    ``note: target "…" was ignored: it has no vocabulary token``."""
    return [f"note: target {_quoted(entry['given'])} was scored as {_quoted(entry['scored'])}"
            if entry["scored"] is not None else
            f"note: target {_quoted(entry['given'])} was ignored: it has no vocabulary token"
            for entry in result.targets]


def _quoted(text: str) -> str:
    """``text`` in double quotes, as JSON escapes it, and ``printable`` (JSON leaves DEL and C1 codes as they are)."""
    return printable(orjson.dumps(text).decode())


def _score(score: float) -> str:
    """Four decimals, or three significant digits for scores too small to show that way."""
    return f"{score:.4f}" if score >= 0.001 or score == 0 else f"{score:.2e}"


def _number(value: float) -> str:
    """A number as typed: ``600000.5``, ``1234567`` (``:g`` rounds both to six digits: ``1.23457e+06``)."""
    return str(int(value)) if math.isfinite(value) and value == int(value) else repr(value)


def _one_line(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure_reason(error: FillMaskError) -> str:
    """A short, stable name for how a request failed, for the summary: the §7 code or §6 reason."""
    if isinstance(error, RequestError):
        return error.code
    if isinstance(error, OverloadedError):
        return error.reason or str(error.status)
    if isinstance(error, ConnectionLostError):
        return "connection_lost"
    return "failed"


def stops_the_run(error: FillMaskError) -> bool:
    """The server is going away or gone (§10, §6), or the connection is: the rest would fail the same way."""
    if isinstance(error, ConnectionLostError):
        return True
    return isinstance(error, OverloadedError) and error.reason in SERVER_GONE_REASONS


@dataclass
class Tally:
    """What happened to the texts of one run, for the closing line."""

    total: int
    answered: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    busy: int = 0  # of the failed: refused as busy (queue_full, queue_share, or a reason not known: §14)

    def summary(self) -> str:
        """``5 texts: 3 answered, 2 failed (1 no_mask, 1 queue_full)``."""
        failures = sum(self.failed.values())
        line = f"{self.total} texts: {self.answered} answered, {failures} failed"
        if failures:
            line += " (" + ", ".join(f"{count} {reason}" for reason, count in self.failed.most_common()) + ")"
        unanswered = self.total - self.answered - failures
        if unanswered:
            line += f", {unanswered} not answered"
        return line

    def unnamed(self) -> list[str]:
        """``15 more texts failed with no_mask``: for each failure reason, the texts not named one by one
        (beyond ``NAMED_PER_REASON``); what ``--quiet`` says in place of the summary."""
        return [f"{count - NAMED_PER_REASON} more texts failed with {reason}"
                for reason, count in self.failed.most_common() if count > NAMED_PER_REASON]


def message_for(error: FillMaskError) -> str:
    """The one line that says ``error`` on the command line: its message, except where the library's
    advice is for programs: a 401 names ``--token`` and ``$FILLMASK_TOKEN``, not the header or the
    query parameter a program would set, and an untrusted certificate ``--cafile``, not ``ssl=``."""
    if isinstance(error, ConnectError) and error.http_status == 401:
        return (f"{error.url} refused the connection (HTTP 401): missing or wrong token; pass the server's "
                f"token as --token TOKEN or in the {TOKEN_ENV} environment variable")
    if isinstance(error, ConnectError) and error.kind == "certificate" and "; to trust it" in error.message:
        head = error.message.split("; to trust it", 1)[0]
        return (f"{head}; to trust it, pass --cafile PATH with its certificate (e.g. the server's cert.pem), or "
                "with the certificate of the authority that issued it")
    return error.message


def stop_line(error: FillMaskError, tally: Tally, reconnect: bool) -> str:
    """The one line for a run that stopped because the server went away or the connection did."""
    if isinstance(error, OverloadedError):
        what = f"the server is shutting down ({error.status} {error.reason})"
        if error.reason == "engine_stopped":
            what = f"the server's model worker stopped ({error.status} {error.reason})"
    elif isinstance(error, ConnectionLostError) and error.code in GOING_AWAY_CODES:
        # The close that ends a drain (§10): the same news as the going_away before it.
        what = f"the server is shutting down ({error.code} {error.reason or 'going away'})"
    else:
        what = message_for(error)
    line = f"stopped: {what}"
    if tally.total > 1:
        line += f"; {tally.summary()}"
    if not reconnect:
        line += "; run again, or pass --reconnect to follow the server to its replacement"
    return line


class SayHandler(logging.Handler):
    """The library's log lines of WARNING and above (``N of M connections could not be opened: ...``)
    as the command's own: each through ``say`` (so ``fillmask-client: `` first), as one line, without a
    traceback. Without it, Python's last-resort handler printed them bare."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.say(one_line(record.getMessage()))
        except Exception:  # (a closed stderr: as logging does for any handler)
            self.handleError(record)


async def report_waiting(waiting: Callable[[], bool], reason: Callable[[], str | None],
                         say: Callable[[str], None]) -> None:
    """Say ``waiting for the server… (Ns)`` once a second for as long as ``waiting()`` holds, with
    ``reason()`` appended whenever it differs from the one last shown. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    began: float | None = None
    said = 0
    said_reason: str | None = None
    while True:
        await asyncio.sleep(WAIT_POLL_S)
        if not waiting():
            began, said = None, 0
            continue
        now = loop.time()
        if began is None:
            began = now
        seconds = int(now - began)
        if seconds > said:
            said = seconds
            why = reason()
            line = f"waiting for the server… ({seconds}s)"
            if why and why != said_reason:
                line, said_reason = f"{line}: {why}", why
            say(line)


def load_cafile(path: str) -> ssl.SSLContext:
    """A TLS context that trusts the certificates in ``path``; ``BadInput`` naming the file when it
    cannot be read or holds no certificate."""
    try:
        return ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        raise BadInput(f"--cafile {shown_path(path)}: no certificate could be loaded from it ({exc.reason or exc}); "
                       "expected PEM certificates, such as the server's cert.pem") from None
    except OSError as exc:
        raise BadInput(f"--cafile {shown_path(path)}: cannot read it ({exc.strerror or exc})") from None


async def run(args: argparse.Namespace, texts: Sequence[str], out: TextIO, err: TextIO,
              context: ssl.SSLContext | None = None) -> int:
    """Send every text and print the outcomes in input order; the exit status (see the module docstring).

    Ctrl-C reaches it as the cancellation ``asyncio.run`` makes of it: the summary line is said (for
    several texts, unless ``--quiet``), the connections are closed, and the cancellation goes on (so
    ``asyncio.run`` raises ``KeyboardInterrupt``, which ``main`` turns into exit status 130). SIGTERM
    (in the main thread) does the same, ``terminated; ...``, and returns ``EXIT_TERMINATED`` (143).

    ``context`` is the TLS context for ``wss://`` (``load_cafile(args.cafile)``; ``None``: the system's).
    While it runs, the library's warnings (logger ``fillmask_client``) are lines of its own on ``err``
    (``SayHandler``), like every other line it says."""

    def say(line: str) -> None:
        print(f"fillmask-client: {line}", file=err, flush=True)

    library_log = logging.getLogger("fillmask_client")
    said_by_us = SayHandler(say)
    library_log.addHandler(said_by_us)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    terminated = False

    def on_sigterm() -> None:  # as Ctrl-C: the run is cancelled, says how far it got, and ends
        nonlocal terminated
        terminated = True
        if task is not None:
            task.cancel()

    installed = False  # only over SIGTERM's default: a handler the program has set stays its own
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # (not the main thread)
            loop.add_signal_handler(signal.SIGTERM, on_sigterm)
            installed = True
    try:
        status = await _run(args, texts, out, context, say, lambda: "terminated" if terminated else "interrupted")
        return EXIT_TERMINATED if terminated else status
    except asyncio.CancelledError:
        if terminated and task is not None:
            task.uncancel()  # (its own cancellation, taken back: an enclosing timeout still counts right)
            return EXIT_TERMINATED
        raise
    finally:
        if installed:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGTERM)
        library_log.removeHandler(said_by_us)


async def _run(args: argparse.Namespace, texts: Sequence[str], out: TextIO, context: ssl.SSLContext | None,
               say: Callable[[str], None], stopped_by: Callable[[], str] = lambda: "interrupted") -> int:
    """``run``'s work, with the library's warnings said as the command's lines."""
    targets = parse_targets(args.targets)
    client = FillMaskClient(args.url or [DEFAULT_URL], connections=args.connections, retry=args.retry,
                            reconnect=args.reconnect, reconnect_timeout=args.reconnect_timeout,
                            open_timeout=args.timeout, token=args.token, ssl=context)
    tally = Tally(len(texts))
    connecting = True

    def last_reason() -> str | None:
        if client.awaiting_hello:  # the WebSocket is open: what it waits for is the server's hello (§2)
            return "connected, no hello frame yet"
        error = client.last_connect_error
        return message_for(error) if error is not None else None

    ticker = asyncio.create_task(report_waiting(
        lambda: not args.quiet and (connecting or client.waiting_for_connection > 0), last_reason, say))
    try:
        await client.connect(wait=args.timeout)
        connecting = False
        problem = limits_problem(args.top_k, targets, args.deadline_ms, client.limits)
        if problem is not None:
            say(problem)
            return EXIT_USAGE
        outcomes = client.fill_mask_iter(
            texts, concurrency=args.concurrency, top_k=args.top_k, targets=targets, deadline_ms=args.deadline_ms
        )
        async with contextlib.aclosing(outcomes):
            index = 0
            async for item in outcomes:
                text, index = texts[index], index + 1
                if isinstance(item, FillMaskError):
                    if stops_the_run(item):
                        # Leaving the loop cancels what is still in flight; one line says how far it got.
                        say(stop_line(item, tally, args.reconnect))
                        return EXIT_CONNECTION
                    reason = failure_reason(item)
                    tally.failed[reason] += 1
                    tally.busy += type(item) is OverloadedError and retryable(item.reason)
                    if tally.failed[reason] <= NAMED_PER_REASON:
                        origin = getattr(text, "origin", None)
                        quoted = f"{origin}: {_one_line(text)!r}" if origin else repr(_one_line(text))
                        # Named unless it is the only text and was given as an argument (a file's one line
                        # is named, by its line: blank lines are skipped).
                        named = len(texts) > 1 or getattr(text, "line", None) is not None
                        where = f"text {index} ({quoted}): " if named else ""
                        say(f"{where}{item}")
                    elif tally.failed[reason] == NAMED_PER_REASON + 1:
                        counted = "their count follows at the end" if args.quiet else "the summary counts them"
                        say(f"more texts failed with {reason}: {counted}"
                            + ("" if args.json else " (--json prints a line for each text)"))
                    if args.json:
                        print(_dumps(item.frame if item.frame is not None else client_frame(item)),
                              file=out, flush=True)
                    continue
                tally.answered += 1
                if args.json:
                    print(_dumps(item.frame), file=out, flush=True)
                else:
                    print(("\n" if index > 1 else "") + format_table(text, item), file=out, flush=True)
    except ConnectionLostError as exc:  # from connect(): no server usable within --timeout
        say(message_for(exc))
        return EXIT_CONNECTION
    except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task, then raises KeyboardInterrupt
        if len(texts) > 1 and not args.quiet:  # (or SIGTERM: ``run`` cancelled it, and returns 143)
            say(f"{stopped_by()}; {tally.summary()}")
        for line in tally.unnamed() if args.quiet else []:
            say(line)
        raise
    finally:
        ticker.cancel()
        await client.close()
    if len(texts) > 1 and not args.quiet:
        say(tally.summary())
    for line in tally.unnamed() if args.quiet else []:  # (without the summary, what was not named is counted)
        say(line)
    if tally.busy and not args.quiet:
        say(busy_hint(tally.busy, args.retry))
    return EXIT_REQUEST_FAILED if tally.failed else EXIT_OK


def busy_hint(count: int, retried: bool) -> str:
    """What to do about ``count`` texts the server refused as busy (503 ``queue_full``, 429 ``queue_share``)."""
    texts = "1 text was" if count == 1 else f"{count} texts were"
    advice = ("send fewer at once (a lower --concurrency or fewer --connections)" if retried
              else "pass --retry, or send fewer at once (a lower --concurrency)")
    return f"{texts} refused because the server was busy: {advice}"


def client_frame(error: FillMaskError) -> dict[str, Any]:
    """``--json``'s line for a request that failed with no server frame (the client refused it before
    sending): a §7 ``error`` frame's fields (``id`` null, as for a frame that carried no valid id,
    since none was sent), marked ``"source": "client"``; its ``code`` may be the client's own
    (``frame_too_large``), which is not among the server's codes."""
    code = error.code if isinstance(error, RequestError) else failure_reason(error)
    return {"type": "error", "id": None, "code": code, "message": error.message, "source": "client"}


def _dumps(frame: dict[str, Any]) -> str:
    return orjson.dumps(frame).decode()


#: An option given ``--`` as its attached value (``--targets=--``, ``-k--``): argparse makes that value an
#: empty list, whatever the option's type, and the run then failed on it with a traceback.
_DASHES_VALUE = re.compile(r"^(--[A-Za-z][\w-]*=|-[A-Za-z])--$")


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_intermixed_args(argv)``, except that everything after the first ``--`` is a text
    as it is, after the texts before it: argparse's intermixed parsing took a text there that could
    be an option (``-[MASK]``, with no space) for an unknown option all the same. An option whose
    attached value is ``--`` is a usage error."""
    cut = argv.index("--") if "--" in argv else len(argv)
    for arg in argv[:cut]:
        if _DASHES_VALUE.match(arg):
            parser.error(f"{arg[:-2].rstrip('=')}: '--' cannot be its value (it marks the end of the options)")
    args = parser.parse_intermixed_args(argv[:cut])
    args.texts = [*args.texts, *argv[cut + 1:]]
    return args


def shown_path(path: str) -> str:
    """``path`` as a message shows it: as given, or quoted where it holds a control character (a newline
    in a file's name would break the one line every message is)."""
    return repr(path) if any(ord(c) < 32 or ord(c) == 127 for c in path) else path


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fillmask-client`` and ``python -m fillmask_client``; returns the exit status."""
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if not 1 <= args.connections <= MAX_CONNECTIONS:
        parser.error(f"--connections must be between 1 and {MAX_CONNECTIONS}")
    # ``not 0 < x < inf`` (rather than ``x <= 0``) also refuses NaN, with which every comparison is false.
    if not 0 < args.timeout < math.inf:
        parser.error(f"--timeout {_number(args.timeout)}: must be a finite number of seconds greater than 0")
    if not 0 < args.reconnect_timeout < math.inf:
        parser.error(f"--reconnect-timeout {_number(args.reconnect_timeout)}: must be a finite number of seconds "
                     "greater than 0")
    given = "--url"
    if not args.url and os.environ.get(URL_ENV):
        args.url, given = [os.environ[URL_ENV]], f"${URL_ENV}"
    for url in args.url or []:
        problem = url_problem(url)
        if problem is not None:
            several = given != "--url" and "more than one URL" in problem  # (the variable holds one)
            parser.error(f"{given}: {problem}" + (" (as --url URL, repeated)" if several else ""))
    # What needs no server to judge is judged here (the server's own limits are checked after its hello).
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k {args.top_k}: must be at least 1")
    if args.targets is not None and not parse_targets(args.targets):
        parser.error("--targets: no words given (comma-separated words, e.g. -t capital,city)")
    if args.deadline_ms is not None and not 0 < args.deadline_ms < math.inf:
        parser.error(f"--deadline-ms {_number(args.deadline_ms)}: must be a finite number greater than 0")
    if args.cafile is not None and not os.path.isfile(args.cafile):
        parser.error(f"--cafile {shown_path(args.cafile)}: no such file")
    plain = [url for url in args.url or [DEFAULT_URL] if not is_secure(url)]
    if args.cafile is not None and plain:
        parser.error(f"--cafile is for wss:// URLs, and {redact(plain[0])!r} is ws://: use wss://, or leave "
                     "--cafile out")
    if args.token == "":  # (the library's refusal of an empty token names no flag)
        parser.error("--token is empty: give the server's token, or leave --token out")
    if not args.texts and args.file is None and sys.stdin.isatty():
        parser.error("no texts: pass TEXT arguments, --file PATH, or pipe lines on stdin")
    reads_stdin = "-" in args.texts or args.file == "-" or (not args.texts and args.file is None)
    if reads_stdin and sys.stdin.isatty() and not args.quiet:  # else it seems to hang until Ctrl-D
        print("fillmask-client: reading texts from the terminal, one per line; end with Ctrl-D (all are read "
              "before any is sent)", file=sys.stderr, flush=True)
    try:
        context = load_cafile(args.cafile) if args.cafile is not None else None
        texts = collect_texts(args, getattr(sys.stdin, "buffer", sys.stdin))  # bytes: line numbers for errors
    except BadInput as exc:
        print(f"fillmask-client: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"fillmask-client: cannot read {shown_path(str(exc.filename))}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C while texts were being typed on standard input: nothing was sent
        return EXIT_INTERRUPTED
    if not texts:
        print("fillmask-client: no texts: the input is empty or holds only blank lines (pass TEXT arguments, "
              "--file PATH, or lines on stdin)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(run(args, texts, sys.stdout, sys.stderr, context))
    except UsageError as exc:  # what the library refuses that the checks above did not foresee
        print(f"fillmask-client: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # after ``run`` said how far it got (several texts)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (say `head`) went away: stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OUTPUT_CLOSED
