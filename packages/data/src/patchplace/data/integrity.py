"""Check a shard's bytes against its manifest entry (size and sha256) before a reader uses any of its samples.

The manifest records every shard's sha256 and size (:class:`~patchplace.data.manifest.ShardInfo`). Readers verify
each shard when they open it, as TFRecord readers check each record's CRC, so a byte flipped on disk (a label turned
into another valid class, a pixel changed) stops the run, naming the shard, instead of training silently:

- local files (plain paths, ``file:`` URLs): the size is compared first (a ``stat``), then the file is hashed in
  one sequential read; the tar is then parsed from the page cache;
- other URLs (``http(s)://`` and object stores' ``s3://``, ``gs://``, ``hf://`` ... fetched by
  :mod:`patchplace.data.remote`, with retries; ``pipe:`` commands; anything else webdataset's ``gopen`` streams):
  the bytes are hashed as they arrive and spooled (in memory up to :data:`SPOOL_IN_MEMORY` bytes, then in a
  temporary file), and the samples are parsed from the spool only once the whole shard matched. Every URL is thus
  verified, each read once. A URL that cannot be fetched is a :class:`~patchplace.data.remote.RemoteError` (the
  server, the store or the network), a ``pipe:`` command that exits non-zero a
  :class:`~patchplace.data.remote.CommandError`; a shard read whole whose bytes differ is a :class:`ShardMismatch`
  (corrupt).

URL ``i`` is checked against the manifest's shard ``i`` (``urls`` name the same shards in the same order).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse
from urllib.request import url2pathname

import webdataset as wds

from .errors import DataError
from .manifest import ShardInfo, sha256_file
from .remote import PIPE, Network, fetch, is_remote, run_command

SPOOL_IN_MEMORY = 64 << 20  # a streamed shard up to this size is spooled in memory, a larger one on disk
_CHUNK = 1 << 20


class ShardMismatch(DataError):
    """A shard's bytes differ from its manifest entry (size or sha256)."""


def local_path(url: str) -> Path | None:
    """The file a shard URL names when it is local (a plain path or ``file:``); None for streamed URLs."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return Path(url)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    return None


def mismatch(shard: ShardInfo, size: int, sha256: str | None) -> str | None:
    """What differs between ``shard``'s manifest entry and bytes of ``size`` / ``sha256`` (None: nothing; a None
    ``sha256`` is not compared)."""
    if size != shard.bytes:
        return f"{size} bytes, the manifest says {shard.bytes} for {shard.name} (truncated or rewritten?)"
    if sha256 is not None and sha256 != shard.sha256:
        return (f"sha256 {sha256} differs from the manifest's {shard.sha256} for {shard.name} (its bytes changed "
                "after the split was written)")
    return None


def check_file(path: Path, shard: ShardInfo) -> None:
    """Raise :class:`ShardMismatch` unless the file at ``path`` has ``shard``'s size and sha256."""
    size = path.stat().st_size
    problem = mismatch(shard, size, sha256_file(path) if size == shard.bytes else None)
    if problem:
        raise ShardMismatch(problem)


def spool_checked(url: str, shard: ShardInfo | None, network: Network | None = None) -> BinaryIO:
    """The bytes streamed from ``url``, spooled and rewound, once their size and sha256 match ``shard`` (None:
    not checked). ``http(s)`` and object-store URLs are fetched with ``network``'s timeout and retries."""
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115 (returned open, closed by the reader)
    try:
        if is_remote(url):
            size, sha256 = fetch(url, network or Network(), spool)
        elif url.startswith(PIPE):  # a command that fails is named with its exit status, not read as a short shard
            size, sha256 = run_command(url, spool)
        else:
            digest, size = hashlib.sha256(), 0
            with wds.gopen(url, "rb") as stream:
                while block := stream.read(_CHUNK):
                    digest.update(block)
                    spool.write(block)
                    size += len(block)
            sha256 = digest.hexdigest()
        problem = mismatch(shard, size, sha256) if shard is not None else None
        if problem:
            raise ShardMismatch(problem)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


def _spooled_samples(url: str, spool: BinaryIO) -> Iterator[dict]:
    try:
        yield from wds.tariterators.group_by_keys(
            wds.tariterators.tar_file_expander([{"url": url, "stream": spool}]))
    finally:
        spool.close()


def open_shard(url: str, shard: ShardInfo, verify: bool = True, network: Network | None = None) -> Iterator[dict]:
    """The webdataset samples of the shard at ``url``. With ``verify`` its size and sha256 are checked against
    ``shard`` first (here, before any sample is parsed): :class:`ShardMismatch` when they differ; OSError and the
    like when it cannot be read; :class:`~patchplace.data.remote.RemoteError` when a remote URL cannot be fetched
    (``network``: its timeout and retries), :class:`~patchplace.data.remote.CommandError` when a ``pipe:``
    command fails."""
    path = local_path(url)
    if path is None:  # streamed: read whole (remote URLs retried) before any sample is parsed, verified or not
        return _spooled_samples(url, spool_checked(url, shard if verify else None, network))
    if verify:
        check_file(path, shard)
    return wds.tariterators.tarfile_samples([{"url": url}])
