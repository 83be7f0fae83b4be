"""Splits served over HTTP(S): manifests and shards fetched with the standard library (``urllib``).

A split is served as the directory :class:`~patchplace.data.writer.SplitWriter` writes (``manifest.json`` next to
its ``<split>-NNNNNN.tar`` shards), e.g. ``python3 -m http.server --directory shards/fashion_mnist 8000``; readers
take ``http://host:8000/train`` wherever they take a split directory.

A failed fetch is a :class:`RemoteError`, one line naming the URL and the HTTP status or network error — a problem
of the server or the network, never reported as a corrupt shard. Transient failures (connection refused or reset,
a timeout, a body cut short, HTTP 408 / 429 / 5xx) are retried ``Network.retries`` times with exponential backoff
(``backoff``, doubling, at least a 429 / 503's ``Retry-After``, at most :data:`MAX_WAIT` s); any other HTTP status
(404, 403, ...) fails at once.
"""

from __future__ import annotations

import hashlib
import http.client
import ssl
import time
from dataclasses import dataclass
from typing import BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse
from urllib.request import Request, urlopen

from .errors import DataError

SCHEMES = ("http", "https")
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_WAIT = 60.0  # seconds: the longest wait between two attempts
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Network:
    """How remote files are fetched: ``timeout`` seconds a connection or a read may wait, ``retries`` further
    attempts after a transient failure, the first ``backoff`` seconds apart (then doubling)."""

    timeout: float = 60.0
    retries: int = 4
    backoff: float = 1.0

    def __post_init__(self) -> None:
        if not self.timeout > 0 or self.retries < 0 or self.backoff < 0:
            raise DataError(f"network settings need timeout > 0, retries >= 0 and backoff >= 0, got {self}")


class RemoteError(DataError):
    """A URL could not be fetched (an HTTP status or a network error): the server or the network, not the data."""


def is_remote(location: object) -> bool:
    """Whether ``location`` (a split, manifest or shard) is an ``http(s)://`` URL."""
    return urlparse(str(location)).scheme in SCHEMES


def fetch(url: str, network: Network, into: BinaryIO | None = None) -> tuple[int, str]:
    """Download ``url`` (into ``into``, rewritten from its start on every attempt; None: nowhere) and return its
    size and sha256, retrying transient failures; :class:`RemoteError` when it cannot."""
    started = time.monotonic()
    for attempt in range(network.retries + 1):
        wait = network.backoff * 2 ** attempt
        try:
            return _download(url, network.timeout, into)
        except HTTPError as exc:
            cause = f"HTTP {exc.code} {exc.reason}"
            retry_after = exc.headers.get("Retry-After", "") if exc.headers else ""
            exc.close()
            if exc.code not in TRANSIENT_STATUS:
                raise RemoteError(f"cannot fetch {url}: {cause} (a split is served as its directory: manifest.json "
                                  "next to its shards); retry / check the server and the URL") from None
            wait = max(wait, float(retry_after)) if retry_after.strip().isdigit() else wait
        except URLError as exc:  # the connection (refused, unknown host, timeout while connecting)
            if isinstance(exc.reason, ssl.SSLCertVerificationError):  # not transient
                raise RemoteError(f"cannot fetch {url}: {exc.reason.verify_message or exc.reason}; retry / check "
                                  "the server's certificate") from None
            cause = _network_cause(exc.reason, network)
        except (OSError, http.client.HTTPException) as exc:  # reset, timeout or cut short while reading
            cause = _network_cause(exc, network)
        if attempt < network.retries:
            time.sleep(min(wait, MAX_WAIT))
    tries = f"{network.retries + 1} attempts over {time.monotonic() - started:.1f} s"
    raise RemoteError(f"cannot fetch {url}: {cause} ({tries}: retries={network.retries}, "
                      f"timeout={network.timeout:g} s); retry / check the server")


def _download(url: str, timeout: float, into: BinaryIO | None) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    if into is not None:
        into.seek(0)
        into.truncate()
    with urlopen(Request(url, headers={"User-Agent": "patchplace"}), timeout=timeout) as response:
        while block := response.read(_CHUNK):
            digest.update(block)
            size += len(block)
            if into is not None:
                into.write(block)
    return size, digest.hexdigest()


def _network_cause(reason: object, network: Network) -> str:
    """A network error in a few words."""
    if isinstance(reason, TimeoutError):
        return f"no answer within {network.timeout:g} s"
    if isinstance(reason, http.client.IncompleteRead):
        return f"the connection closed after {len(reason.partial)} bytes, {reason.expected} short"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
