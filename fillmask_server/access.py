"""Who may connect, as pure decisions: the Origin rule, the shared token, and the TLS context.

Nothing here touches a socket or an event loop; the server calls these from its handshake hook and
tests call them directly (tests/test_hardening_access.py). Invariants:

- ``OriginPolicy.allows`` lets through every handshake without an ``Origin`` header: browsers always
  send one on a WebSocket handshake, so its absence means a non-browser client, which the Origin
  check cannot and need not stop (that is the token's job).
- Origins are compared after normalisation (lower case, default port dropped), so
  ``HTTP://Example.com:80`` and ``http://example.com`` are the same origin.
- ``token_matches`` compares in constant time and never says which part of a token was wrong.
"""

from __future__ import annotations

import hmac
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

SAME_ORIGIN = "same-origin"
LOCALHOST = "localhost"
ANY_ORIGIN = "*"
NULL_ORIGIN = "null"
KEYWORDS = (SAME_ORIGIN, LOCALHOST, ANY_ORIGIN, NULL_ORIGIN)
TOKEN_QUERY_PARAMETER = "token"

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_ORIGIN_SYNTAX = re.compile(r"^https?://[^/?#\s]+$", re.IGNORECASE)


def normalize_origin(origin: str) -> str | None:
    """``scheme://host[:port]`` in lower case without the scheme's default port; None if not an origin."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    scheme = parts.scheme.lower()
    return f"{scheme}://{host}" if port in (None, _DEFAULT_PORTS[scheme]) else f"{scheme}://{host}:{port}"


def _normalize_host(host: str, tls: bool) -> str | None:
    """A ``Host`` header as ``host[:port]`` with the default port of the server's scheme dropped."""
    scheme = "https" if tls else "http"
    origin = normalize_origin(f"{scheme}://{host.strip()}")
    return None if origin is None else origin.split("://", 1)[1]


@dataclass(frozen=True)
class OriginPolicy:
    """Which pages may open a WebSocket: keywords plus explicit origins (see ``parse``)."""

    same_origin: bool = True
    localhost: bool = True
    any_origin: bool = False
    null_origin: bool = False
    origins: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> OriginPolicy:
        """Read ``--allowed-origins``: comma-separated entries, each a keyword or an origin.

        Keywords: ``same-origin`` (the page was served by this server: its origin matches the
        ``Host`` header), ``localhost`` (any page on localhost, 127.0.0.1 or [::1], any port),
        ``null`` (pages opened from disk or sandboxed frames, which send ``Origin: null``), ``*``
        (any page). Other entries are origins such as ``https://app.example.com:8443``. Raises
        ``ValueError`` with one readable line for anything else.
        """
        entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
        origins: set[str] = set()
        for entry in entries:
            if entry.lower() in KEYWORDS:
                continue
            normalized = normalize_origin(entry) if _ORIGIN_SYNTAX.match(entry) else None
            if normalized is None:
                raise ValueError(f"--allowed-origins entry {entry!r} is not an origin such as https://example.com "
                                 f"nor one of {', '.join(KEYWORDS)}")
            origins.add(normalized)
        lowered = {entry.lower() for entry in entries}
        return cls(SAME_ORIGIN in lowered, LOCALHOST in lowered, ANY_ORIGIN in lowered, NULL_ORIGIN in lowered,
                   frozenset(origins))

    def allows(self, origin: str | None, host: str | None, tls: bool) -> bool:
        """May a handshake with this ``Origin`` (None: header absent) and ``Host`` header proceed?"""
        if origin is None or self.any_origin:
            return True
        if origin.strip().lower() == NULL_ORIGIN:
            return self.null_origin
        normalized = normalize_origin(origin)
        if normalized is None:
            return False
        if normalized in self.origins:
            return True
        scheme, authority = normalized.split("://", 1)
        if self.localhost:
            hostname = urlsplit(normalized).hostname or ""
            if hostname in _LOCAL_HOSTS or hostname.endswith(".localhost"):
                return True
        if self.same_origin and host is not None:
            return scheme == ("https" if tls else "http") and authority == _normalize_host(host, tls)
        return False


def presented_token(authorization: str | None, path: str) -> str | None:
    """The token a client presents: ``Authorization: Bearer X`` first, else the ``?token=X`` query parameter."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    query = path.partition("?")[2]
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == TOKEN_QUERY_PARAMETER:
            return value
    return None


def token_matches(expected: str, presented: str | None) -> bool:
    """True when no token is configured, or the presented one equals it (constant-time comparison)."""
    if not expected:
        return True
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8", "surrogatepass"), presented.encode("utf-8", "surrogatepass"))


def tls_context(certfile: str, keyfile: str = "") -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or later) with the certificate chain and key loaded.

    Raises ``ValueError`` with one readable line when the files cannot be read or do not match.
    """
    for path in (certfile, keyfile):
        if path and not Path(path).is_file():
            raise ValueError(f"cannot read TLS file {path!r}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile, keyfile or None)
    except ssl.SSLError:
        raise ValueError(f"cannot load the TLS certificate {certfile!r}" + (f" and key {keyfile!r}" if keyfile else "")
                         + ": not PEM, or the key does not match the certificate") from None
    except OSError as exc:
        raise ValueError(f"cannot read TLS file {exc.filename or certfile!r}: {exc.strerror}") from None
    return context
