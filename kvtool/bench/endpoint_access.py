"""How `kvtool bench --endpoint` gets into a secured or hosted server: an API key (a Bearer token, as
the openai client sends it), extra headers, and https with the server's certificate checked.

The key is a secret: it is sent in the Authorization header and nowhere else. It is left out of the
options' repr, and a message the server sends back is cleaned of it before it is shown or written
to a report (``redact``).
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.bench.http_stream import merge_headers
from kvtool.config import check
from kvtool.errors import KvtoolError

API_KEY_ENV = "OPENAI_API_KEY"  # where the openai client looks for a key when none is given
# RFC 9110 token characters: what a header name may hold.
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# Headers the client writes itself: another value would break how the body is framed or sent.
_CLIENT_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
REFUSED_STATUSES = (401, 403)


def parse_header(text: str) -> tuple[str, str]:
    """'NAME:VALUE' (spaces around VALUE ignored) as (NAME, VALUE); a ValueError naming --header."""
    name, colon, value = text.partition(":")
    if not colon:
        shown = (text.split() or [""])[0]  # the name only: what follows may be a secret
        raise ValueError(f"--header {shown!r}{' ...' if shown != text else ''} has no ':': give NAME:VALUE, "
                         "e.g. --header 'X-Org-Id: acme'")
    return name.strip(), value.strip()


@dataclass(frozen=True)
class EndpointAccess:
    """``api_key``: sent as ``Authorization: Bearer KEY`` (None: no Authorization header);
    ``api_key_source`` names where it came from in messages (the flag, or the environment variable).
    ``headers``: (name, value) pairs sent with every request; they replace a header of the same name,
    the Authorization that the key makes included. ``ca_cert``: a PEM file of the certificate
    authorities that https endpoints are checked against, instead of the system's."""

    api_key: str | None = field(default=None, repr=False)
    api_key_source: str = "--api_key"
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # values may be secrets too
    ca_cert: Path | None = None

    def __post_init__(self) -> None:
        check(self.api_key is None or bool(self.api_key.strip() and _printable(self.api_key)), self, "api_key",
              "is empty, or holds a line break, a control character or a non-ASCII one: give the key itself")
        for name, value in self.headers:
            check(bool(_HEADER_NAME.match(name)), self, "headers",
                  f"name {name!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~): give NAME:VALUE")
            check(name.lower() not in _CLIENT_HEADERS, self, "headers",
                  f"{name} is written by kvtool itself and cannot be replaced: leave it out")
            check(_printable(value), self, "headers",
                  f"{name}'s value holds a line break, a control character or a non-ASCII one")
        check(self.ca_cert is None or Path(self.ca_cert).is_file(), self, "ca_cert",
              f"{self.ca_cert} is not a file: give the PEM file of the certificate authority that signed the "
              "server's certificate")

    def request_headers(self) -> dict[str, str]:
        """What every request carries besides its own framing: the key's Authorization, then ``headers``."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for name, value in self.headers:
            headers = merge_headers(headers, {name: value})
        return headers

    def ssl_context(self, url: str) -> ssl.SSLContext | None:
        """The certificate checks for an https URL (None for http): the system's certificate
        authorities, or --ca_cert's. Hostnames are checked too."""
        if not url.lower().startswith("https:"):
            if self.ca_cert is not None:
                raise KvtoolError(f"--ca_cert {self.ca_cert} checks an https server's certificate, but --endpoint "
                                  f"{url} is plain http: use https://, or leave out --ca_cert")
            return None
        try:
            return ssl.create_default_context(cafile=None if self.ca_cert is None else str(self.ca_cert))
        except (ssl.SSLError, UnicodeDecodeError) as error:
            raise KvtoolError(f"--ca_cert {self.ca_cert} holds no PEM certificate ({_reason(error)}): give the "
                              "certificate of the authority that signed the server's, as PEM "
                              "(-----BEGIN CERTIFICATE-----)") from None

    def redact(self, text: str) -> str:
        """``text`` with the key replaced, for whatever a server's message echoes back."""
        return text.replace(self.api_key, "<api key>") if self.api_key else text

    def refused(self, status: int) -> str:
        """What a 401/403 answer means and what to do (the server's own message may quote the key)."""
        if not self.api_key:
            return (f"HTTP {status}: the server refused the API key (none was given): give --api_key KEY or set "
                    f"{API_KEY_ENV}")
        return (f"HTTP {status}: the server refused the API key from {self.api_key_source}: check it, or give "
                f"another with --api_key KEY or {API_KEY_ENV}")

    def connect_problem(self, error: BaseException) -> str | None:
        """What to do when a TLS handshake failed (None: ``error`` is not about TLS)."""
        cause = _ssl_cause(error)
        if isinstance(cause, ssl.SSLCertVerificationError):
            reason = cause.verify_message or _reason(cause)
            if self.ca_cert is not None:
                return (f"the server's certificate failed the check against --ca_cert {self.ca_cert} ({reason}): "
                        "give the certificate of the authority that signed it")
            return (f"the server's certificate failed the check ({reason}): give --ca_cert FILE, the PEM "
                    "certificate of the authority that signed it (of a self-signed server: its own certificate)")
        if cause is not None:
            return (f"the TLS handshake failed ({_reason(cause)}): is the server serving https? Use http:// for "
                    "a plain-HTTP server")
        return None


def _printable(text: str) -> bool:
    """ASCII without control characters (a tab aside): what a header value can carry as it is."""
    return text.isascii() and not any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in text)


def _reason(error: BaseException) -> str:
    return getattr(error, "reason", None) or str(error) or type(error).__name__


def _ssl_cause(error: BaseException | None) -> ssl.SSLError | None:
    """The ssl error behind ``error`` (httpx wraps it in its own), if there is one."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ssl.SSLError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
