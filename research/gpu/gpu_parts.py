"""A file too big for one call to the lent GPU machine, carried in parts, one part per call, and put
back together there (docs/study.md, "ONNX Runtime on CUDA, brought in parts"). Standard library
only: it runs under any python3.

    # here: .ort/p0/, .ort/p1/, ... + MANIFEST
    python research/gpu/gpu_parts.py split WHEEL --out .ort --max-mib 52
    # there, every call: how far it travelled
    python research/gpu/gpu_parts.py status --parts .ort
    # there, last call: the file
    python research/gpu/gpu_parts.py reassemble --parts .ort --out /tmp/ort-wheel

Each part lies in its own directory ``<out>/p<i>/`` (so a call can carry exactly one: carry
[".ort/p3"]), named ``<file>.part<i>``. Every part directory holds the same ``MANIFEST.json``: the
file's name, size and sha256 and each part's directory, name, size and sha256, so any one part says
what the whole is. ``split`` is idempotent: when the parts of the same file at the same size are all
there and intact it writes nothing. ``reassemble`` checks every part's and the whole file's sha256;
a part missing or damaged stops it with one line naming the parts and what to carry (exit 2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

FORMAT = "patchplace.gpu_parts/1"
MANIFEST = "MANIFEST.json"
MIB = 2**20
CHUNK = 4 * MIB


class PartsError(RuntimeError):
    """Parts missing, damaged or inconsistent: the message is one line saying which and what to do."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _copy_range(src, dst_path: Path, size: int, whole) -> str:
    """Copy the next ``size`` bytes of the open file ``src`` into ``dst_path`` (atomically), feeding them to the
    ``whole`` file's digest too; -> their sha256."""
    digest = hashlib.sha256()
    tmp = dst_path.with_name(f".{dst_path.name}.{os.getpid()}.tmp")
    left = size
    with open(tmp, "wb") as out:
        while left:
            block = src.read(min(CHUNK, left))
            if not block:
                raise PartsError(f"{src.name} ended early while splitting it (changed during the split?)")
            digest.update(block)
            whole.update(block)
            out.write(block)
            left -= len(block)
    os.replace(tmp, dst_path)
    return digest.hexdigest()


def part_dirs(root: Path) -> list[Path]:
    """``<root>/p<i>`` directories, by number."""
    found = [d for d in root.glob("p*") if d.is_dir() and d.name[1:].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda d: int(d.name[1:]))


def read_manifest(root: Path) -> dict | None:
    """The manifest of ``root``'s parts: p0's when it is there, else that of the first part directory holding one."""
    candidates = [root / "p0" / MANIFEST] + [d / MANIFEST for d in part_dirs(root)]
    for path in candidates:
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("parts"):
                return manifest
    return None


def check_parts(root: Path, verify: bool = True) -> tuple[dict | None, list[str], list[str], list[str]]:
    """(manifest, present, missing, damaged) part directory names of ``root``; ``verify``: compare each present
    part's sha256 with the manifest's (else only sizes)."""
    manifest = read_manifest(root)
    if manifest is None:
        return None, [], [], []
    present, missing, damaged = [], [], []
    for part in manifest["parts"]:
        path = root / part["dir"] / part["name"]
        if not path.is_file():
            missing.append(part["dir"])
        elif path.stat().st_size != part["size"] or (verify and sha256_of(path) != part["sha256"]):
            damaged.append(part["dir"])
        else:
            present.append(part["dir"])
    return manifest, present, missing, damaged


def _carry_advice(root: Path, dirs: list[str]) -> str:
    names = [f"{root.as_posix().rstrip('/')}/{d}" for d in dirs]
    if len(names) == 1:
        return f"carry {names[0]} in the next call"
    return f"carry {', '.join(names)} in the next calls (one per call)"


def _already_split(path: Path, out_dir: Path, max_bytes: int) -> bool:
    """Whether ``out_dir`` holds the intact parts of ``path`` at ``max_bytes``, a manifest in each, nothing else."""
    manifest = read_manifest(out_dir)
    if (manifest is None or manifest["file"] != path.name or manifest["size"] != path.stat().st_size
            or manifest.get("max_bytes") != max_bytes or len(part_dirs(out_dir)) != len(manifest["parts"])
            or not all((out_dir / p["dir"] / MANIFEST).is_file() for p in manifest["parts"])):
        return False
    _, _, missing, damaged = check_parts(out_dir, verify=True)
    return not missing and not damaged and manifest["sha256"] == sha256_of(path)


def split(path: str | os.PathLike, out_dir: str | os.PathLike, max_bytes: int) -> dict:
    """Split ``path`` into parts of at most ``max_bytes`` under ``out_dir/p<i>/`` with a MANIFEST.json in each;
    nothing is written when ``out_dir`` already holds intact parts of the same file at the same size. Part
    directories of an earlier split that the new one does not use are removed. -> the manifest."""
    path, out_dir = Path(path), Path(out_dir)
    if max_bytes < 1:
        raise PartsError(f"max_bytes must be >= 1, got {max_bytes}")
    if not path.is_file():
        raise PartsError(f"{path} is not a file")
    size = path.stat().st_size
    if _already_split(path, out_dir, max_bytes):
        return {**read_manifest(out_dir), "unchanged": True}
    for old in part_dirs(out_dir):  # first: a split cut off halfway leaves no manifest to trust
        (old / MANIFEST).unlink(missing_ok=True)
    count = max(1, -(-size // max_bytes))
    parts = []
    whole = hashlib.sha256()
    with open(path, "rb") as src:
        for i in range(count):
            part_dir = out_dir / f"p{i}"
            part_dir.mkdir(parents=True, exist_ok=True)
            for stale in part_dir.iterdir():  # a part of another file or size
                if stale.is_file() and not stale.name.startswith("."):
                    stale.unlink()
            name = f"{path.name}.part{i}"
            part_size = min(max_bytes, size - i * max_bytes)
            digest = _copy_range(src, part_dir / name, part_size, whole)
            parts.append({"dir": part_dir.name, "name": name, "size": part_size, "sha256": digest})
    for extra in part_dirs(out_dir)[count:]:
        shutil.rmtree(extra)
    manifest = {"format": FORMAT, "file": path.name, "size": size, "sha256": whole.hexdigest(),
                "max_bytes": max_bytes, "parts": parts}
    text = (json.dumps(manifest, indent=2) + "\n").encode()
    for part in parts:  # the manifests last: a split cut off halfway is never taken for a complete one
        _atomic_write_bytes(out_dir / part["dir"] / MANIFEST, text)
    return manifest


def reassemble(parts_root: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Put the parts under ``parts_root`` back together as ``out_dir/<file>`` (atomically), after checking every
    part's sha256, and check the whole file's; a file already there with the right sha256 is kept. Raises
    :class:`PartsError` (one line: which parts are missing or damaged, what to carry) otherwise. -> the file."""
    root, out_dir = Path(parts_root), Path(out_dir)
    manifest, present, missing, damaged = check_parts(root)
    if manifest is None:
        found = ", ".join(d.name for d in part_dirs(root)) or "none"
        raise PartsError(f"no {MANIFEST} under {root} (part directories here: {found}): {_carry_advice(root, ['p0'])}"
                         f" (make gpu-ort-parts writes it)")
    problems = [f"{', '.join(missing)} missing"] if missing else []
    problems += [f"{', '.join(damaged)} damaged (size or sha256 differs from the manifest)"] if damaged else []
    if problems:
        total = len(manifest["parts"])
        raise PartsError(f"{manifest['file']}: {len(present)} of {total} parts intact; {'; '.join(problems)}: "
                         f"{_carry_advice(root, sorted(missing + damaged, key=lambda d: int(d[1:])))} with the same "
                         "command")
    out = out_dir / manifest["file"]
    if out.is_file() and out.stat().st_size == manifest["size"] and sha256_of(out) == manifest["sha256"]:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    whole = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for part in manifest["parts"]:
            with open(root / part["dir"] / part["name"], "rb") as src:
                while block := src.read(CHUNK):
                    whole.update(block)
                    dst.write(block)
    if whole.hexdigest() != manifest["sha256"]:
        tmp.unlink()
        raise PartsError(f"{manifest['file']}: every part matches the manifest but the whole does not (a manifest "
                         f"from another split?): run make gpu-ort-parts here again and carry every part anew")
    os.replace(tmp, out)
    return out


def status_line(parts_root: str | os.PathLike, verify: bool = False) -> tuple[str, bool]:
    """One line: which parts are here (``verify``: by sha256, else by size) and what to carry next; -> (line,
    complete)."""
    root = Path(parts_root)
    manifest, present, missing, damaged = check_parts(root, verify=verify)
    if manifest is None:
        found = ", ".join(d.name for d in part_dirs(root)) or "none"
        return (f"[gpu-parts] {root}: no {MANIFEST} (part directories here: {found}); "
                f"{_carry_advice(root, ['p0'])}"), False
    total = len(manifest["parts"])
    line = (f"[gpu-parts] {manifest['file']} ({manifest['size'] / MIB:.1f} MiB): {len(present)} of {total} parts "
            f"here ({', '.join(present) or 'none'})")
    if damaged:
        line += f"; damaged: {', '.join(damaged)}"
    todo = sorted(missing + damaged, key=lambda d: int(d[1:]))
    if todo:
        return f"{line}; next: {_carry_advice(root, todo[:1])}", False
    return f"{line}; complete{' (sha256 checked)' if verify else ''}", True


def capped(base: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """``base`` in at most 100 columns, whatever the terminal's width (as every entry point's --help)."""

    class Capped(base):  # type: ignore[misc, valid-type]
        def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                     width: int | None = None) -> None:
            width = min(width or shutil.get_terminal_size().columns - 2, 100)
            super().__init__(prog, indent_increment, max_help_position, width)

    return Capped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python research/gpu/gpu_parts.py", description=__doc__,
                                     formatter_class=capped(argparse.RawDescriptionHelpFormatter))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", formatter_class=capped(argparse.HelpFormatter),
                       help="split FILE into parts of at most --max-mib under --out/p<i>/",
                       description="Split FILE into --out/p0/, --out/p1/, ... (parts of at most --max-mib MiB, the "
                                   "last one smaller) with the same MANIFEST.json in each part directory; writes "
                                   "nothing when intact parts of the same file at the same size are already there.")
    p.add_argument("file", type=Path, help="the file to split (e.g. the onnxruntime-gpu wheel)")
    p.add_argument("--out", type=Path, default=Path(".ort"), help="parts root (default: %(default)s)")
    p.add_argument("--max-mib", type=float, default=52.0,
                   help="largest part in MiB (default: %(default)s; a part plus the tracked tree must stay under "
                        "the 64 MiB a call carries)")
    p = sub.add_parser("reassemble", formatter_class=capped(argparse.HelpFormatter),
                       help="check every part and put the file back together",
                       description="Check every part's sha256 against the manifest, concatenate them into "
                                   "--out/<file> and check the whole file's sha256; print the file's path. A part "
                                   "missing or damaged: one line naming it and what to carry, exit 2.")
    p.add_argument("--parts", type=Path, default=Path(".ort"), help="parts root (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("/tmp/ort-wheel"),
                   help="directory for the reassembled file (default: %(default)s)")
    p = sub.add_parser("status", formatter_class=capped(argparse.HelpFormatter),
                       help="print which parts are here (one line)",
                       description="One line: which parts are here and which to carry next. Exit 0 (with --strict: "
                                   "1 unless every part is here, intact by --verify and of --expect).")
    p.add_argument("--parts", type=Path, default=Path(".ort"), help="parts root (default: %(default)s)")
    p.add_argument("--verify", action="store_true", help="compare each part's sha256 (default: sizes only)")
    p.add_argument("--expect", metavar="FILE",
                   help="complete only if the parts are of this file name (e.g. the wheel make gpu-ort-parts wants)")
    p.add_argument("--strict", action="store_true", help="exit 1 unless complete (make gpu-ort-parts uses it)")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.file, args.out, int(args.max_mib * MIB))
            sizes = ", ".join(f"{p['dir']} {p['size'] / MIB:.1f} MiB" for p in manifest["parts"])
            verb = "already split, nothing to do" if manifest.get("unchanged") else "split"
            print(f"[gpu-parts] {manifest['file']}: {verb}: {len(manifest['parts'])} parts under {args.out} ({sizes})"
                  f"; sha256 {manifest['sha256']}")
        elif args.command == "reassemble":
            print(reassemble(args.parts, args.out))
        else:
            line, complete = status_line(args.parts, verify=args.verify)
            manifest = read_manifest(args.parts)
            if args.expect and manifest and manifest["file"] != args.expect:
                line, complete = (f"[gpu-parts] {args.parts} holds parts of {manifest['file']}, not {args.expect}: "
                                  "split again"), False
            print(line)
            return 1 if args.strict and not complete else 0
    except PartsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
