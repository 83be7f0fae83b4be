"""``python -m patchplace.data show|verify DIR...``: print manifests, check shards against them (a split served over
HTTP or kept in an object store by its URL too: ``python -m patchplace.data verify s3://bucket/fashion_mnist/train``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import DataError
from .helpformat import help_formatter
from .manifest import MANIFEST_NAME, Manifest, verify_split
from .remote import Network, is_remote


def _split_dirs(paths: list[str]) -> list[Path | str]:
    """Each path is a split dir, a manifest file, or a dataset dir whose sub-dirs are splits; a URL names a split
    (or its manifest.json): a server's directories cannot be listed."""
    found: list[Path | str] = []
    for path in paths:
        p = Path(path)
        if is_remote(path):
            found.append(path)
        elif p.is_file() or (p / MANIFEST_NAME).is_file():
            found.append(p)
        elif p.is_dir() and (subs := sorted(d for d in p.iterdir() if (d / MANIFEST_NAME).is_file())):
            found.extend(subs)
        else:
            raise DataError(f"no manifest.json in {p} or its sub-directories: build it with a data/ recipe")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patchplace.data", description=__doc__,
                                     formatter_class=help_formatter(argparse.HelpFormatter))
    parser.add_argument("command", choices=("show", "verify"),
                        help="show: print each manifest; verify: also check every shard's size and sha256")
    parser.add_argument("paths", nargs="+", help="split directories, manifest files or dataset directories; "
                        "URLs of split directories (http(s)://, s3://, gs://, hf://, ...)")
    parser.add_argument("--timeout", type=float, default=Network.timeout,
                        help="URLs: seconds a connection or a read may wait (default: %(default)s)")
    parser.add_argument("--retries", type=int, default=Network.retries,
                        help="URLs: further attempts after a transient failure, with backoff (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        bad, network = 0, Network(args.timeout, args.retries)
        for split_dir in _split_dirs(args.paths):
            manifest = Manifest.load(split_dir, network)
            print(manifest.summary())
            if args.command == "verify":
                problems = verify_split(manifest)
                bad += len(problems)
                print("  shards: " + ("OK" if not problems else f"{len(problems)} problem(s)"))
                for problem in problems:
                    print(f"  ! {problem}")
        return 1 if bad else 0
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
