"""``python -m patchplace.data show|verify DIR...``: print manifests, check shards against them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import DataError
from .manifest import MANIFEST_NAME, Manifest, verify_split


def _split_dirs(paths: list[str]) -> list[Path]:
    """Each path is a split dir, a manifest file, or a dataset dir whose sub-dirs are splits."""
    found = []
    for p in map(Path, paths):
        if p.is_file() or (p / MANIFEST_NAME).is_file():
            found.append(p)
        elif p.is_dir() and (subs := sorted(d for d in p.iterdir() if (d / MANIFEST_NAME).is_file())):
            found.extend(subs)
        else:
            raise DataError(f"no manifest.json in {p} or its sub-directories: build it with a data/ recipe")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patchplace.data", description=__doc__)
    parser.add_argument("command", choices=("show", "verify"),
                        help="show: print each manifest; verify: also check every shard's size and sha256")
    parser.add_argument("paths", nargs="+", help="split directories, manifest files or dataset directories")
    args = parser.parse_args(argv)
    try:
        bad = 0
        for split_dir in _split_dirs(args.paths):
            manifest = Manifest.load(split_dir)
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
