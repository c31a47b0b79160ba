"""Command line: ``python -m fillmask_server.client "Paris is the [MASK] of France."``.

Prints one table per text (one per mask when a text has several), or with ``--json`` each text's raw
terminal frame on one line, in input order. Texts come from the arguments, from ``-`` (standard input)
or ``--file``, one per line; blank lines are skipped. With no texts given, standard input is read.

Exit status: 0 when every text got a result; 1 when a request failed (one line on stderr per failed
text, the others still print); 2 for a usage error; 3 when the server cannot be reached or the
connection is lost (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from .async_client import DEFAULT_URL, FillMaskClient
from .errors import ConnectionLostError, FillMaskError
from .frames import FillMaskResult

#: Exit statuses of the command (documented in the module docstring and in ``--help``).
EXIT_OK, EXIT_REQUEST_FAILED, EXIT_USAGE, EXIT_CONNECTION = 0, 1, 2, 3
#: The environment variable the server reads its ``--token`` from; the command reads it too.
TOKEN_ENV = "FILLMASK_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fillmask-client`` command."""
    parser = argparse.ArgumentParser(
        prog="fillmask-client",
        description="Ask a fill-mask server to fill the [MASK] in each text.",
        epilog="exit status: 0 all answered, 1 a request failed, 2 usage error, 3 server unreachable or lost",
    )
    parser.add_argument("texts", nargs="*", metavar="TEXT",
                        help="texts containing the mask token; '-' reads texts from stdin, one per line "
                             "(the default when no TEXT and no --file is given)")
    parser.add_argument("--file", "-f", metavar="PATH", help="read texts from PATH, one per line")
    parser.add_argument("--url", default=DEFAULT_URL, help="server WebSocket URL (default: %(default)s)")
    parser.add_argument("--top-k", "-k", type=int, metavar="K", help="candidates per mask (server default: 5)")
    parser.add_argument("--targets", "-t", action="append", metavar="WORDS",
                        help="only score these words: comma-separated, may be repeated")
    parser.add_argument("--deadline-ms", type=float, metavar="MS",
                        help="give up on a request still queued after MS milliseconds (answered 504)")
    parser.add_argument("--concurrency", "-c", type=int, metavar="N",
                        help="most requests in flight at once (default: the server's max_batch_size)")
    parser.add_argument("--json", action="store_true",
                        help="print each text's raw terminal frame as one line of JSON, in input order")
    parser.add_argument("--retry", action="store_true",
                        help="resend requests the server answers 503 queue_full, after its retry_after_ms")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for the connection and the server's hello (default: %(default)s)")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"the server's --token, sent as 'Authorization: Bearer TOKEN' (default: ${TOKEN_ENV})")
    parser.add_argument("--cafile", metavar="PATH",
                        help="for wss:// URLs: trust the certificate(s) in PATH, e.g. the server's self-signed one")
    return parser


def read_lines(stream: TextIO) -> list[str]:
    """The non-blank lines of ``stream``, stripped: one text each."""
    return [line.strip() for line in stream if line.strip()]


def collect_texts(args: argparse.Namespace, stdin: TextIO) -> list[str]:
    """Texts in the order given: arguments (``-`` expands to stdin's lines), then ``--file``'s lines."""
    texts: list[str] = []
    for text in args.texts:
        texts.extend(read_lines(stdin) if text == "-" else [text])
    if args.file is not None:
        with open(args.file, encoding="utf-8") as handle:
            texts.extend(read_lines(handle))
    if not args.texts and args.file is None:
        texts.extend(read_lines(stdin))
    return texts


def parse_targets(values: Sequence[str] | None) -> list[str] | None:
    """``--targets a,b --targets c`` as ``["a", "b", "c"]``; ``None`` when not given."""
    if not values:
        return None
    return [word.strip() for value in values for word in value.split(",") if word.strip()]


def format_table(text: str, result: FillMaskResult) -> str:
    """A readable table of one text's predictions: rank, token, score, sequence; one table per mask."""
    lines = [text]
    tables = result.per_mask()
    for number, predictions in enumerate(tables, start=1):
        if len(tables) > 1:
            lines.append(f"mask {number} of {len(tables)}")
        width = max([len("token"), *(len(str(p.get("token_str", ""))) for p in predictions)])
        lines.append(f"{'rank':>4}  {'token':<{width}}  {'score':>6}  sequence")
        for rank, prediction in enumerate(predictions, start=1):
            token = str(prediction.get("token_str", ""))
            score = _score(float(prediction.get("score", 0.0)))
            lines.append(f"{rank:>4}  {token:<{width}}  {score:>6}  {prediction.get('sequence', '')}")
    return "\n".join(lines)


def _score(score: float) -> str:
    """Four decimals, or three significant digits for scores too small to show that way."""
    return f"{score:.4f}" if score >= 0.001 or score == 0 else f"{score:.2e}"


def _one_line(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def run(args: argparse.Namespace, texts: list[str], out: TextIO, err: TextIO) -> int:
    """Send every text over one connection and print the outcomes in input order; the exit status."""
    failures = 0
    targets = parse_targets(args.targets)
    context = ssl.create_default_context(cafile=args.cafile) if args.cafile else None
    try:
        client = FillMaskClient(args.url, retry=args.retry, open_timeout=args.timeout, token=args.token, ssl=context)
        async with client:
            outcomes = client.fill_mask_iter(
                texts, concurrency=args.concurrency, top_k=args.top_k, targets=targets, deadline_ms=args.deadline_ms
            )
            async with contextlib.aclosing(outcomes):
                index = 0
                async for item in outcomes:
                    text, index = texts[index], index + 1
                    if isinstance(item, ConnectionLostError):
                        raise item
                    if isinstance(item, FillMaskError):
                        failures += 1
                        where = f"text {index} ({_one_line(text)!r}): " if len(texts) > 1 else ""
                        print(f"fillmask-client: {where}{item}", file=err, flush=True)
                        if args.json and item.frame is not None:
                            print(_dumps(item.frame), file=out, flush=True)
                        continue
                    if args.json:
                        print(_dumps(item.frame), file=out, flush=True)
                    else:
                        print(("\n" if index > 1 else "") + format_table(text, item), file=out, flush=True)
    except ConnectionLostError as exc:
        print(f"fillmask-client: {exc}", file=err, flush=True)
        return EXIT_CONNECTION
    return EXIT_REQUEST_FAILED if failures else EXIT_OK


def _dumps(frame: dict[str, Any]) -> str:
    return orjson.dumps(frame).decode()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fillmask-client`` and ``python -m fillmask_server.client``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if not args.url.startswith(("ws://", "wss://")):
        parser.error(f"--url {args.url}: expected ws://HOST:PORT/ or wss://HOST:PORT/")
    if args.cafile is not None and not os.path.isfile(args.cafile):
        parser.error(f"--cafile {args.cafile}: no such file")
    if not args.texts and args.file is None and sys.stdin.isatty():
        parser.error("no texts: pass TEXT arguments, --file PATH, or pipe lines on stdin")
    try:
        texts = collect_texts(args, sys.stdin)
    except OSError as exc:
        print(f"fillmask-client: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    if not texts:
        print("fillmask-client: no texts given (pass TEXT arguments, --file, or lines on stdin)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(run(args, texts, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader (say `head`) went away: stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
