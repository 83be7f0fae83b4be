"""Splits served over HTTP(S): manifests and shards fetched with the standard library (``urllib``).

A split is served as the directory :class:`~patchplace.data.writer.SplitWriter` writes (``manifest.json`` next to
its ``<split>-NNNNNN.tar`` shards), e.g. ``python3 -m http.server --directory shards/fashion_mnist 8000``; readers
take ``http://host:8000/train`` wherever they take a split directory.

A failed fetch is a :class:`RemoteError`, one line naming the URL and the HTTP status or network error — a problem
of the server or the network, never reported as a corrupt shard. Transient failures (connection refused or reset,
a timeout, a body cut short, HTTP 408 / 429 / 5xx) are retried ``Network.retries`` times with exponential backoff
(``backoff``, doubling, at least a 429 / 503's ``Retry-After``, at most :data:`MAX_WAIT` s), each retry one line on
stderr; any other HTTP status (404, 403, ...) fails at once. A body shorter than its ``Content-Length`` (the
connection closed mid-shard) is such a transient failure too, never a corrupt shard. One file's whole transfer may
take ``Network.deadline`` seconds (a server trickling bytes would otherwise hold a run for as long as each read
beats ``timeout``): a transfer still going after ``Network.progress`` seconds prints a progress line (bytes so far,
rate) that often, and one past its deadline is a one-line :class:`RemoteError` (not retried) naming the bytes it got.
"""

from __future__ import annotations

import hashlib
import http.client
import ssl
import sys
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
    attempts after a transient failure, the first ``backoff`` seconds apart (then doubling); ``deadline`` seconds
    one file's whole transfer may take, a progress line every ``progress`` seconds of it."""

    timeout: float = 60.0
    retries: int = 4
    backoff: float = 1.0
    deadline: float = 600.0
    progress: float = 30.0

    def __post_init__(self) -> None:
        if not self.timeout > 0 or self.retries < 0 or self.backoff < 0:
            raise DataError(f"network settings need timeout > 0, retries >= 0 and backoff >= 0, got {self}")
        if not self.deadline > 0 or not self.progress > 0:
            raise DataError(f"network settings need deadline > 0 and progress > 0, got {self}")


class _CutShort(http.client.HTTPException):
    """A body that ended before its ``Content-Length``: the connection closed mid-file (transient)."""

    def __init__(self, received: int, expected: int) -> None:
        super().__init__(f"the connection closed after {received} of {expected} bytes")
        self.received, self.expected = received, expected


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
            return _download(url, network, into)
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
            print(f"fetching {url}: {cause}; retry {attempt + 1} of {network.retries} in {min(wait, MAX_WAIT):.3g} s",
                  file=sys.stderr, flush=True)
            time.sleep(min(wait, MAX_WAIT))
    tries = f"{network.retries + 1} attempts over {time.monotonic() - started:.1f} s"
    raise RemoteError(f"cannot fetch {url}: {cause} ({tries}: retries={network.retries}, "
                      f"timeout={network.timeout:g} s); retry / check the server")


def _download(url: str, network: Network, into: BinaryIO | None) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    if into is not None:
        into.seek(0)
        into.truncate()
    started = time.monotonic()
    report = started + network.progress
    with urlopen(Request(url, headers={"User-Agent": "patchplace"}), timeout=network.timeout) as response:
        length = response.headers.get("Content-Length", "")
        expected = int(length) if length.strip().isdigit() else None
        while block := response.read1(_CHUNK):  # as the bytes arrive: the deadline is checked between reads
            digest.update(block)
            size += len(block)
            if into is not None:
                into.write(block)
            now = time.monotonic()
            if now - started > network.deadline:
                raise RemoteError(f"cannot fetch {url}: {size} bytes" + (f" of {expected}" if expected else "")
                                  + f" in {now - started:.1f} s, past its deadline of {network.deadline:g} s (a slow "
                                  "server or network); raise data.shard_deadline, or check the server")
            if now >= report:
                report = now + network.progress
                print(f"fetching {url}: {size / 2**20:.3g} MiB" + (f" of {expected / 2**20:.3g}" if expected else "")
                      + f" in {now - started:.0f} s ({size / 2**20 / (now - started):.3g} MiB/s, deadline "
                      f"{network.deadline:g} s: data.shard_deadline)", file=sys.stderr, flush=True)
    if expected is not None and size < expected:
        raise _CutShort(size, expected)
    return size, digest.hexdigest()


def _network_cause(reason: object, network: Network) -> str:
    """A network error in a few words."""
    if isinstance(reason, TimeoutError):
        return f"no answer within {network.timeout:g} s"
    if isinstance(reason, _CutShort):
        return str(reason)
    if isinstance(reason, http.client.IncompleteRead):
        return f"the connection closed after {len(reason.partial)} bytes, {reason.expected} short"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
