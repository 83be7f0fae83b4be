"""Splits in object stores: any ``scheme://`` URL fsspec knows other than ``http(s)`` (``s3://``, ``gs://``,
``hf://``, ``az://``, ``file://``, ``memory://``, ...), read through fsspec's filesystems.

A split is kept in a bucket as the directory :class:`~patchplace.data.writer.SplitWriter` writes (``manifest.json``
next to its shards; write it locally, then e.g. ``aws s3 sync shards/imagenet s3://bucket/imagenet``). Its files
are read by :func:`patchplace.data.remote.fetch` as ``http(s)`` ones are: the manifest first, then each shard whole,
hashed as it streams (ranged reads of :data:`STORE_BLOCK` bytes), with the same retries, deadline, progress lines
and one-line :class:`~patchplace.data.remote.RemoteError` s. :func:`download` sorts a backend's error into
transient (a connection refused or reset, a timeout, HTTP 408 / 429 / 5xx, throttling: retried) and permanent (no
such bucket or key, access denied, missing credentials: one line at once).

The backends read their settings from the standard environment (S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_REGION``; any backend: fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>``,
e.g. ``FSSPEC_S3_ANON=true`` for a public bucket). For S3, ``Network`` is the one retry policy: botocore's and
s3fs's own retries are off and ``Network.timeout`` bounds each connection and read; other backends keep their own
timeouts and retries inside each of ``Network``'s attempts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.registry import known_implementations

from .remote import SCHEMES, TRANSIENT_STATUS, CutShort, Network, RemoteError, Transient, copy_stream, url_scheme

STORE_BLOCK = 8 << 20  # bytes per ranged read of a shard (the deadline is checked between reads)
S3 = ("s3", "s3a")
# settings the backends read from the environment: a filesystem built under other values is not reused
_ENV_PREFIXES = ("AWS_", "FSSPEC_", "GOOGLE_", "GCS", "HF_", "HUGGING", "AZURE_")
_TRANSIENT_NAMES = ("Timeout", "Connect", "Throttl", "SlowDown", "IncompleteRead", "Payload", "ResponseParser",
                    "Disconnected")
_PERMANENT_OS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_filesystems: dict[tuple, fsspec.AbstractFileSystem] = {}


def backend_problem(url: str) -> str | None:
    """Why ``url`` cannot be read here (an unknown scheme, a backend package not installed), in one line naming
    the fix; None when it can (``http(s)`` URLs, local paths and ``pipe:`` commands included)."""
    protocol = url_scheme(url)
    if protocol is None or protocol in SCHEMES:
        return None
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return (f"{url}: fsspec knows no {protocol}:// filesystem (a split is a local directory, an http(s):// URL "
                "or an object store's: s3://, gs://, hf://, az://, ...); check the URL")
    except ImportError as exc:
        known = known_implementations.get(protocol, {})
        package = known.get("class", "").split(".")[0]
        install = f"pip install {package}" + (" (or 'patchplace-data[s3]')" if protocol in S3 else "")
        return (f"{url}: reading {protocol}:// needs the {package or 'backend'} package, which is not installed "
                f"({' '.join(str(exc).split())}); " + (install if package else "install fsspec's backend for it"))
    return None


def filesystem(url: str, network: Network) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem that reads ``url`` (built once per process, settings and environment) and the path
    it knows the file by; :class:`RemoteError` when the scheme cannot be read here."""
    problem = backend_problem(url)
    if problem:
        raise RemoteError(f"cannot fetch {problem}")
    protocol = url_scheme(url)
    cls = fsspec.get_filesystem_class(protocol)
    options: dict[str, Any] = dict(cls._get_kwargs_from_urls(url))
    if protocol in S3:  # Network's attempts are the retries; its timeout bounds each connection and read
        configured = fsspec.config.conf.get(protocol, {}).get("config_kwargs", {})
        options["config_kwargs"] = {**configured, "connect_timeout": network.timeout,
                                    "read_timeout": network.timeout, "retries": {"total_max_attempts": 1}}
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    key = (cls, repr(sorted(options.items())), os.getpid(), env)  # a forked DataLoader worker builds its own
    fs = _filesystems.get(key)
    if fs is None:
        fs = _filesystems[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        if protocol in S3:
            fs.retries = 1  # s3fs's attempts per call (a class attribute, not an option)
    return fs, fs._strip_protocol(url)


def download(url: str, network: Network, into: BinaryIO | None) -> tuple[int, str]:
    """One attempt at reading the object at ``url`` (into ``into``): its size and sha256; :class:`Transient` or
    :class:`RemoteError` when it fails."""
    fs, path = filesystem(url, network)
    try:
        with fs.open(path, "rb", block_size=STORE_BLOCK, cache_type="none") as file:
            expected = getattr(file, "size", None)
            expected = expected if isinstance(expected, int) else None
            size, sha256 = copy_stream(url, lambda _: file.read(STORE_BLOCK), expected, network, into)
    except (RemoteError, Transient):
        raise
    except Exception as exc:  # the backend's own exception types: sorted by failure()
        raise failure(url, exc) from None
    if expected is not None and size < expected:
        raise CutShort(size, expected)
    return size, sha256


def failure(url: str, exc: BaseException) -> Transient | RemoteError:
    """A backend's exception as :class:`Transient` (retried) or a one-line :class:`RemoteError` naming the fix."""
    status, cause = http_status(exc), describe(exc)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return RemoteError(f"cannot fetch {url}: no such bucket or key ({cause}; a split is kept as its directory: "
                           "manifest.json next to its shards); check the URL, or upload the split (e.g. aws s3 sync "
                           "<split directory> <its URL>)")
    if isinstance(exc, PermissionError) or status in (401, 403) or _named(exc, ("Credential",)):
        return RemoteError(f"cannot fetch {url}: access denied or no credentials ({cause}); check the credentials "
                           "the store's client reads (S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE; a "
                           "public bucket: FSSPEC_S3_ANON=true) and the bucket's policy")
    if status in TRANSIENT_STATUS or (status is None and transient(exc)):
        return Transient(cause)
    return RemoteError(f"cannot fetch {url}: {cause}; check the URL and the store's settings")


def transient(exc: BaseException) -> bool:
    """Whether a backend error without an HTTP status is worth retrying: a connection or timeout error anywhere in
    its chain, or an I/O error that is not a missing / forbidden path."""
    if _named(exc, _TRANSIENT_NAMES) or any(isinstance(e, (ConnectionError, TimeoutError)) for e in _chain(exc)):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, _PERMANENT_OS)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind a backend error, where its chain records one (botocore's ``response`` dict,
    requests / httpx's ``response.status_code``, aiohttp's ``status``, gcsfs's ``code``)."""
    for error in _chain(exc):
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        else:
            code = getattr(response, "status_code", None)
        for value in (code, getattr(error, "status", None), getattr(error, "code", None)):
            if isinstance(value, int) and 100 <= value < 600:
                return value
    return None


def describe(exc: BaseException) -> str:
    """A backend error in one short line: its type and first words (and its HTTP status, when it has one)."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    status = http_status(exc)
    return f"{type(exc).__name__}: {text}" + (f", HTTP {status}" if status and str(status) not in text else "")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__`` / ``__context__``), a few deep."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen and len(seen) < 8:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _named(exc: BaseException, words: tuple[str, ...]) -> bool:
    return any(word in type(e).__name__ for e in _chain(exc) for word in words)
