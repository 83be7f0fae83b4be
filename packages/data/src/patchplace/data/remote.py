"""Splits read by URL: served over HTTP(S) (the standard library's ``urllib``), kept in an object store (``s3://``,
``gs://``, ``hf://``, ... through fsspec: :mod:`patchplace.data.stores`), or produced by a ``pipe:`` command.

A split is the directory :class:`~patchplace.data.writer.SplitWriter` writes (``manifest.json`` next to its
``<split>-NNNNNN.tar`` shards), served as it is (e.g. ``python3 -m http.server --directory shards/fashion_mnist
8000``) or copied to a bucket (``aws s3 sync shards/fashion_mnist s3://bucket/fashion_mnist``); readers take
``http://host:8000/train`` or ``s3://bucket/fashion_mnist/train`` wherever they take a split directory.

A failed fetch is a :class:`RemoteError`, one line naming the URL and the HTTP status, store or network error — a
problem of the server, the store or the network, never reported as a corrupt shard. Transient failures (connection
refused or reset, a timeout, a body cut short, HTTP 408 / 429 / 5xx, a store's throttling) are retried
``Network.retries`` times with exponential backoff (``backoff``, doubling, at least a 429 / 503's ``Retry-After``,
at most :data:`MAX_WAIT` s), each retry one line on stderr; any other failure (HTTP 404 / 403, no such bucket or
key, access denied) fails at once. A body shorter than its announced size (the connection closed mid-shard) is
such a transient failure too, never a corrupt shard. One file's whole transfer may take ``Network.deadline``
seconds (a server trickling bytes would otherwise hold a run for as long as each read beats ``timeout``): a transfer
still going after ``Network.progress`` seconds prints a progress line (bytes so far, rate) that often, and one past
its deadline is a one-line :class:`RemoteError` (not retried) naming the bytes it got.

A ``pipe:`` command (:func:`run_command`) that exits non-zero is a :class:`CommandError` naming its exit status
and the last line of its stderr (not retried), never a corrupt shard.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from .errors import DataError

SCHEMES = ("http", "https")  # fetched with urllib; any other scheme:// goes through fsspec (stores.py)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_WAIT = 60.0  # seconds: the longest wait between two attempts
PIPE = "pipe:"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # scheme://...: a URL (a local path has no scheme)
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


_UNTIMED = Network(deadline=float("inf"), progress=float("inf"))  # a pipe: command's output: no deadline, no progress


class Transient(Exception):
    """One attempt failed in a way worth retrying: ``cause`` in a few words, ``retry_after`` seconds the server
    asked for (0: none)."""

    def __init__(self, cause: str, retry_after: float = 0.0) -> None:
        super().__init__(cause)
        self.cause, self.retry_after = cause, retry_after


class CutShort(Transient):
    """A body that ended before its announced size: the connection closed mid-file (transient)."""

    def __init__(self, received: int, expected: int) -> None:
        super().__init__(f"the connection closed after {received} of {expected} bytes")
        self.received, self.expected = received, expected


class RemoteError(DataError):
    """A URL could not be fetched (an HTTP status, a store's or a network error): not the data."""


class CommandError(RemoteError):
    """A ``pipe:`` URL's command exited with a non-zero status: the command, not the shard's bytes."""


def url_scheme(location: object) -> str | None:
    """The lower-case scheme of a ``scheme://...`` URL (``http``, ``s3``, ``hf``, ``file``, ...); None for a local
    path or a ``pipe:`` command."""
    found = _URL.match(str(location))
    return found.group(1).lower() if found else None


def is_remote(location: object) -> bool:
    """Whether ``location`` (a split, manifest or shard) is a URL read by :func:`fetch`: ``http(s)://`` or any
    other ``scheme://`` (an object store through fsspec), never a local path or a ``pipe:`` command."""
    return url_scheme(location) is not None


def fetch(url: str, network: Network, into: BinaryIO | None = None) -> tuple[int, str]:
    """Download ``url`` (into ``into``, rewritten from its start on every attempt; None: nowhere) and return its
    size and sha256, retrying transient failures; :class:`RemoteError` when it cannot."""
    if url_scheme(url) in SCHEMES:
        download, fix = _http_download, "retry / check the server"
    else:
        from .stores import download  # (stores imports this module: imported here, not at the top)

        fix = "retry / check the network and the store's endpoint"
    started = time.monotonic()
    for attempt in range(network.retries + 1):
        try:
            return download(url, network, into)
        except Transient as exc:
            cause, wait = exc.cause, max(network.backoff * 2 ** attempt, exc.retry_after)
        if attempt < network.retries:
            print(f"fetching {url}: {cause}; retry {attempt + 1} of {network.retries} in {min(wait, MAX_WAIT):.3g} s",
                  file=sys.stderr, flush=True)
            time.sleep(min(wait, MAX_WAIT))
    tries = f"{network.retries + 1} attempts over {time.monotonic() - started:.1f} s"
    raise RemoteError(f"cannot fetch {url}: {cause} ({tries}: retries={network.retries}, "
                      f"timeout={network.timeout:g} s); {fix}")


def _http_download(url: str, network: Network, into: BinaryIO | None) -> tuple[int, str]:
    """One attempt at an ``http(s)`` URL: its size and sha256, :class:`Transient` or :class:`RemoteError`."""
    try:
        with urlopen(Request(url, headers={"User-Agent": "patchplace"}), timeout=network.timeout) as response:
            length = response.headers.get("Content-Length", "")
            expected = int(length) if length.strip().isdigit() else None
            size, sha256 = copy_stream(url, response.read1, expected, network, into)
    except HTTPError as exc:
        cause = f"HTTP {exc.code} {exc.reason}"
        retry_after = exc.headers.get("Retry-After", "") if exc.headers else ""
        exc.close()
        if exc.code not in TRANSIENT_STATUS:
            raise RemoteError(f"cannot fetch {url}: {cause} (a split is served as its directory: manifest.json "
                              "next to its shards); retry / check the server and the URL") from None
        raise Transient(cause, float(retry_after) if retry_after.strip().isdigit() else 0.0) from None
    except URLError as exc:  # the connection (refused, unknown host, timeout while connecting)
        if isinstance(exc.reason, ssl.SSLCertVerificationError):  # not transient
            raise RemoteError(f"cannot fetch {url}: {exc.reason.verify_message or exc.reason}; retry / check "
                              "the server's certificate") from None
        raise Transient(_network_cause(exc.reason, network)) from None
    except (OSError, http.client.HTTPException) as exc:  # reset, timeout or cut short while reading
        raise Transient(_network_cause(exc, network)) from None
    if expected is not None and size < expected:
        raise CutShort(size, expected)
    return size, sha256


def copy_stream(url: str, read: Callable[[int], bytes], expected: int | None, network: Network,
                into: BinaryIO | None) -> tuple[int, str]:
    """Read ``url``'s bytes with ``read(n)`` until it returns none (into ``into``, rewound and emptied first):
    their size and sha256. The deadline is checked, and progress printed, between reads."""
    digest, size = hashlib.sha256(), 0
    if into is not None:
        into.seek(0)
        into.truncate()
    started = time.monotonic()
    report = started + network.progress
    while block := read(_CHUNK):  # as the bytes arrive
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


def run_command(url: str, into: BinaryIO) -> tuple[int, str]:
    """Run a ``pipe:`` URL's shell command, writing its stdout into ``into``: the size and sha256 of what it wrote.
    A non-zero exit is a :class:`CommandError` naming the status and its stderr's last line (not retried: a
    command that should retry says so itself, e.g. ``curl -f --retry 4``)."""
    from webdataset.utils import enforce_security  # WDS_SECURE=1 refuses pipe: URLs, as webdataset's gopen does

    command = url[len(PIPE):]
    if enforce_security:
        raise CommandError(f"{url}: pipe: URLs are refused under WDS_SECURE=1 (they run shell commands); unset it "
                           "or read the shards by URL")
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: a chatty command cannot block on it
        with subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=stderr) as process:
            assert process.stdout is not None
            size, sha256 = copy_stream(url, process.stdout.read, None, _UNTIMED, into)
            status = process.wait()
        if status == 0:
            return size, sha256
        stderr.seek(0)
        lines = [line.strip() for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    said = f" ({lines[-1][:300]})" if lines else ""
    raise CommandError(f"command `{command}` {how}{said} after writing {size} bytes: the command failed, not the "
                       "shard; run it by hand to see why (a pipe: URL's command writes the shard to stdout and exits "
                       "0)")


def refuse_url(out_dir: object) -> None:
    """Splits are written to a local directory: a URL given as where to write one is a :class:`DataError` naming
    what to do instead (fsspec would write to a bucket, but not atomically: a run could read half a split)."""
    scheme = url_scheme(out_dir)
    if scheme is not None:
        raise DataError(f"cannot write a split to {out_dir}: splits are written to a local directory; write it there "
                        f"(e.g. --out shards/<dataset>), then upload the directory"
                        + (f" (aws s3 sync shards/<dataset> {out_dir})" if scheme in ("s3", "s3a") else "")
                        + "; readers take its URL")
