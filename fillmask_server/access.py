"""Who may connect, as pure decisions: the Host rule, the Origin rule, the shared token, and the TLS context.

Nothing here touches a socket or an event loop; the server calls these from its request hook and
tests call them directly (tests/test_hardening_access.py). Invariants:

- ``HostPolicy.allows`` never lets through a host *name* that is not configured (other than localhost
  names). That is what defeats DNS rebinding: the attacker's page runs under the attacker's name, so
  its requests carry ``Host: attacker.example`` whatever address that name resolves to. An IP
  address in ``Host`` cannot come from rebinding (the browser connects to that very address, so the
  page is either this server's own or cross-origin, which the Origin rule decides), which is why the
  default lets addresses through: load balancers, Kubernetes probes and port mappings use them.

- ``OriginPolicy.allows`` lets through every handshake without an ``Origin`` header: browsers always
  send one on a WebSocket handshake, so its absence means a non-browser client, which the Origin
  check cannot and need not stop (that is the token's job).
- Origins are compared after normalisation (lower case, default port dropped), so
  ``HTTP://Example.com:80`` and ``http://example.com`` are the same origin.
- ``token_matches`` compares in constant time and never says which part of a token was wrong.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

#: ``--host`` values that listen on every interface (an empty host is every one too, to asyncio).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})

SAME_ORIGIN = "same-origin"
LOCALHOST = "localhost"
ANY_ORIGIN = "*"
NULL_ORIGIN = "null"
KEYWORDS = (SAME_ORIGIN, LOCALHOST, ANY_ORIGIN, NULL_ORIGIN)
TOKEN_QUERY_PARAMETER = "token"
ANY_HOST = "*"
IP_HOSTS = "ip"
HOST_KEYWORDS = (LOCALHOST, IP_HOSTS, ANY_HOST)

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_ORIGIN_SYNTAX = re.compile(r"^https?://[^/?#\s]+$", re.IGNORECASE)
_REG_NAME = re.compile(r"^[a-z0-9\-._~!$&'()*+,;=%]+$")  # RFC 3986 reg-name, lower-cased
_PORT = re.compile(r"^[0-9]{1,5}$")


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
        ``Host`` header and the server's scheme, or is https where the server is plain http, as behind a
        proxy that ends TLS), ``localhost`` (any page on localhost, 127.0.0.1 or [::1], any port),
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
            if scheme == ("https" if tls else "http"):
                return authority == _normalize_host(host, tls)
            # An https page on the name a plain server was reached by: this server behind a proxy that
            # ends TLS (a Kubernetes Ingress), never a downgrade (an http page for a TLS server is refused).
            return scheme == "https" and authority == _normalize_host(host, True)
        return False


@dataclass(frozen=True)
class Authority:
    """A parsed ``Host`` header: ``host`` in lower case, without a trailing dot or IPv6 brackets;
    ``address`` is set when the host is an IP address rather than a name; ``port`` None when absent."""

    host: str
    port: int | None
    address: ipaddress.IPv4Address | ipaddress.IPv6Address | None


def parse_host(value: str) -> Authority | None:
    """Read ``host[:port]`` (RFC 9110 §7.2: a name, a dotted IPv4 address or a bracketed IPv6 address);
    None when it is none of those."""
    value = value.strip()
    if value.startswith("["):
        literal, bracket, rest = value[1:].partition("]")
        try:
            address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.IPv6Address(literal)
        except ValueError:
            return None
        if not bracket or (rest and not rest.startswith(":")):
            return None
        host, port_text = str(address), rest[1:]
    else:
        host, _, port_text = value.partition(":")
        if ":" in port_text:
            return None  # an IPv6 address without brackets, or junk
        host = host.lower()
        host = host[:-1] if host.endswith(".") else host  # "example.com." is the same name
        if not _REG_NAME.match(host):
            return None
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            address = None
    if port_text and not (_PORT.match(port_text) and int(port_text) <= 65535):
        return None
    return Authority(host, int(port_text) if port_text else None, address)


def is_local(authority: Authority) -> bool:
    """localhost, a name under .localhost (browsers resolve both to loopback themselves, RFC 6761),
    or a loopback address (127.0.0.0/8, ::1, or 127.x written as an IPv4-mapped IPv6 address)."""
    address = authority.address
    if address is None:
        return authority.host == "localhost" or authority.host.endswith(".localhost")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` headers this server answers (see ``parse``); ``hosts`` holds (host, port or None)."""

    any_host: bool = False
    localhost: bool = True
    ip: bool = True
    hosts: frozenset[tuple[str, int | None]] = frozenset()
    suffixes: frozenset[tuple[str, int | None]] = frozenset()  # "*.example.com" is (".example.com", None)

    @classmethod
    def parse(cls, spec: str, listen: str = "") -> HostPolicy:
        """Read ``--allowed-hosts``: comma-separated entries, each a keyword or a host.

        Keywords: ``localhost`` (localhost, ``*.localhost``, 127.0.0.0/8 and ::1), ``ip`` (any IP address,
        see the module docstring), ``*`` (any host: behind a proxy that rewrites ``Host``, or where the
        token alone guards the server). Other entries are names or addresses with an optional port
        (``fill.example.com``, ``fill.example.com:443``, ``10.0.0.5``, ``[fd00::5]:8765``) or
        ``*.example.com`` (any name under example.com); without a port, any port matches. ``listen``,
        the ``--host`` the server listens on, is always allowed unless it is a wildcard address.
        Raises ``ValueError`` with one readable line for anything else.
        """
        entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
        if not entries:
            raise ValueError(f"--allowed-hosts is empty; name hosts, or use the keywords {', '.join(HOST_KEYWORDS)}")
        hosts: set[tuple[str, int | None]] = set()
        suffixes: set[tuple[str, int | None]] = set()
        for entry in entries:
            if entry.lower() in HOST_KEYWORDS:
                continue
            wildcard = entry.startswith("*.")
            authority = parse_host(entry[1:] if wildcard else entry)
            if authority is None or (wildcard and (parse_host(entry[2:]) or authority).address is not None):
                raise ValueError(f"--allowed-hosts entry {entry!r} is not a host name or IP address (with an optional "
                                 f":port) such as fill.example.com, *.example.com or 10.0.0.5:8765, nor one of "
                                 f"{', '.join(HOST_KEYWORDS)}")
            (suffixes if wildcard else hosts).add((authority.host, authority.port))
        if listen not in WILDCARD_HOSTS:
            listening = parse_host(f"[{listen}]" if ":" in listen else listen)
            if listening is not None:
                hosts.add((listening.host, None))
        lowered = {entry.lower() for entry in entries}
        return cls(ANY_HOST in lowered, LOCALHOST in lowered, IP_HOSTS in lowered, frozenset(hosts),
                   frozenset(suffixes))

    def allows(self, authority: Authority, tls: bool) -> bool:
        """Does this server answer for ``authority`` (the request's ``Host``) on a ``tls`` or plain port?"""
        if self.any_host or (self.ip and authority.address is not None) or (self.localhost and is_local(authority)):
            return True
        port = authority.port if authority.port is not None else (443 if tls else 80)
        for host, entry_port in self.hosts:
            if host == authority.host and entry_port in (None, port):
                return True
        for suffix, entry_port in self.suffixes:
            if authority.host.endswith(suffix) and entry_port in (None, port):
                return True
        return False


#: X-Forwarded-For entries read from the right, at most: a proxy chain is a few hops; a header of
#: thousands of entries (a client may write any) costs no more than these.
MAX_FORWARDED_HOPS = 16


@dataclass(frozen=True)
class ProxyPolicy:
    """Which direct peers are proxies whose ``X-Forwarded-For`` names the client (see ``parse``). It only
    changes what log lines say about a connection's origin; nothing is allowed or refused by it."""

    any_proxy: bool = False
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> ProxyPolicy:
        """Read ``--forwarded-allow-ips``: comma-separated addresses or networks (``10.0.0.5``,
        ``10.0.0.0/8``, ``fd00::/8``), or ``*`` (every direct peer is a proxy: only where nothing else
        can reach the server). Empty (the default): no proxy, the header is ignored, as a client can
        write any. Raises ``ValueError`` with one readable line for anything else."""
        entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
        networks = []
        for entry in entries:
            if entry == "*":
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips entry {entry!r} is not an IP address or network such as "
                                 "10.0.0.5, 10.0.0.0/8 or fd00::/8, nor *") from None
        return cls("*" in entries, tuple(networks))

    def client(self, peer_host: str, forwarded_for: list[str]) -> str | None:
        """The client's address that the proxies in front of ``peer_host`` recorded in ``forwarded_for``
        (each ``X-Forwarded-For`` header's value, in order), as a canonical IP address, or None: the
        peer is no proxy, there is no header, or an entry is not an address. Read from the right, each
        proxy appending the address it saw: the first address that is not in a listed network is the
        client (what a client wrote to the left of it is not to be believed; with ``*``, which lists no
        network, that is the rightmost: what the nearest proxy saw); if all are, the leftmost read
        (at most ``MAX_FORWARDED_HOPS``)."""
        peer = _address(peer_host)
        if not forwarded_for or peer is None or not (self.any_proxy or self._listed(peer)):
            return None
        chain = [entry for value in forwarded_for for entry in value.split(",")][-MAX_FORWARDED_HOPS:]
        address = None
        for entry in reversed(chain):
            address = _address(entry.strip(), with_port=True)
            if address is None:
                return None
            if not self._listed(address):
                break
        return None if address is None else str(address)

    def _listed(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's IPv4 peer
        return any(address in network for network in self.networks)


def _address(text: str, with_port: bool = False) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv6 zone dropped), or None. ``with_port``: also ``v4:port`` and
    ``[v6]:port``, as some proxies write them."""
    if with_port:
        if text.startswith("["):
            text = text[1:].split("]", 1)[0]
        elif text.count(":") == 1:
            text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def presented_token(authorization: str | None, path: str) -> str | None:
    """The token a client presents: ``Authorization: Bearer X`` first, else the ``?token=X`` query
    parameter, URL-decoded as a form is (``+`` is a space; a plus is ``%2B``). Two ``token`` parameters
    are ambiguous: None, refused like a missing token rather than one of them guessed at."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    query = path.partition("?")[2]
    given = [value for name, value in parse_qsl(query, keep_blank_values=True) if name == TOKEN_QUERY_PARAMETER]
    return given[0] if len(given) == 1 else None


def token_matches(expected: str, presented: str | None) -> bool:
    """True when no token is configured, or the presented one equals it (constant-time comparison)."""
    if not expected:
        return True
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8", "surrogatepass"), presented.encode("utf-8", "surrogatepass"))


class _EncryptedKey(Exception):
    """The TLS key needs a passphrase."""


def _no_passphrase() -> str:
    raise _EncryptedKey


def tls_context(certfile: str, keyfile: str = "") -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or later) with the certificate chain and key loaded.

    Raises ``ValueError`` with one readable line when the files cannot be read or do not match.
    """
    texts = {}
    for path in filter(None, (certfile, keyfile)):
        try:
            if Path(path).is_dir():
                raise ValueError(f"cannot read TLS file {path!r}: it is a directory; name the PEM file in it")
            found = Path(path).is_file()
        except OSError as exc:  # (is_file raises what is not "no such file": a name too long for the system)
            raise ValueError(f"cannot read TLS file {path!r}: {exc.strerror}") from None
        if not found:
            raise ValueError(f"cannot read TLS file {path!r}: no such file")
        try:  # (each file read here: load_cert_chain's error names no file, and blamed the certificate)
            texts[path] = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read TLS file {path!r}: {exc.strerror} (for this process, uid "
                             f"{os.getuid()})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # A key that needs a passphrase: refused in one line. Without a callback OpenSSL would ask for it
        # on the terminal, and a server started by a supervisor would wait for ever (an audit's find).
        context.load_cert_chain(certfile, keyfile or None, password=_no_passphrase)
    except _EncryptedKey:
        raise ValueError(f"the TLS key {keyfile or certfile!r} is encrypted and the server asks for no passphrase; "
                         "give it an unencrypted key (openssl pkey -in KEY -out PLAIN_KEY), readable by this "
                         "server's user only") from None
    except ssl.SSLError:
        raise ValueError(_tls_problem(certfile, keyfile, texts)) from None
    except OSError as exc:
        raise ValueError(f"cannot read TLS file {exc.filename or certfile!r}: {exc.strerror}") from None
    return context


def _tls_problem(certfile: str, keyfile: str, texts: dict[str, bytes]) -> str:
    """What is wrong with TLS files OpenSSL refused, read from their PEM blocks: a file that is no PEM,
    a certificate file without a certificate, no private key where one was looked for (the certificate
    file alone, without --keyfile), else a key that does not belong to the certificate."""
    key_path = keyfile or certfile
    if b"-----BEGIN" not in texts.get(certfile, b""):
        return f"cannot load the TLS certificate {certfile!r}: it is not a PEM file (-----BEGIN CERTIFICATE-----)"
    if b"CERTIFICATE-----" not in texts[certfile]:
        return f"cannot load the TLS certificate {certfile!r}: the file holds no certificate"
    if b"PRIVATE KEY-----" not in texts.get(key_path, b""):
        if not keyfile:
            return (f"cannot load the TLS certificate {certfile!r}: the file holds no private key; give the key "
                    "with --keyfile, or one PEM file that holds both")
        return f"cannot load the TLS key {keyfile!r}: the file holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
    return (f"cannot load the TLS certificate {certfile!r}" + (f" and key {keyfile!r}" if keyfile else "")
            + ": the key does not belong to the certificate, or a file is damaged")
