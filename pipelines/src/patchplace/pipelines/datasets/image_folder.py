"""ImageNet-style class folders -> WebDataset shards (RGB).

    ROOT/train/<class>/*.jpg   ROOT/val/<class>/*.jpg      python data/image_folder.py --src ROOT --out shards/mydata

Classes are the sub-directories of the first split (sorted); every other split must use the same names.
JPEG and PNG files are stored as they are (no re-encoding) under the member extension ``.img``; other formats
Pillow reads are stored as PNG. Keys are the relative paths (``dog__img1_jpg`` for ``dog/img1.jpg``).
Normalization statistics come from up to ``--stats-samples`` train images (evenly spaced).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from patchplace.data import ChannelStats, DataError, Manifest
from patchplace.data.recipes import add_output_args, run_cli, write_image_splits

RECIPE_VERSION = 1
EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm"}
_KEEP_BYTES = {".jpg", ".jpeg", ".png"}


def list_split(split_dir: Path, classes: list[str] | None) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names and (file, label) pairs of one split, in a stable (sorted) order."""
    if not split_dir.is_dir():
        raise DataError(f"missing split folder {split_dir}: expected ROOT/<split>/<class>/<image files>")
    found = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not found:
        raise DataError(f"{split_dir} has no class sub-folders: expected {split_dir}/<class>/<image files>")
    if classes is None:
        classes = found
    elif unknown := sorted(set(found) - set(classes)):
        raise DataError(f"{split_dir}: class folder(s) {unknown} are not classes of the first split")
    files = [(f, classes.index(c)) for c in found for f in sorted((split_dir / c).rglob("*"))
             if f.suffix.lower() in EXTENSIONS]
    if not files:
        raise DataError(f"{split_dir} holds no image files ({', '.join(sorted(EXTENSIONS))})")
    return classes, files


def sample_key(path: Path, root: Path) -> str:
    """Stable key from the relative path ('/' and '.' are not allowed in webdataset keys)."""
    return re.sub(r"[./]", "_", str(path.relative_to(root)).replace("/", "__"))


def load_rgb(path: Path) -> np.ndarray:
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"cannot read image {path} ({exc}); remove or replace the file") from exc


def records(files: list[tuple[Path, int]], root: Path) -> Iterator[tuple[str, int, np.ndarray, bytes | None]]:
    for path, label in files:
        image = load_rgb(path)
        encoded = path.read_bytes() if path.suffix.lower() in _KEEP_BYTES else None
        yield sample_key(path, root), label, image, encoded


def train_statistics(files: list[tuple[Path, int]], max_samples: int) -> dict:
    stats = ChannelStats(3)
    step = max(1, len(files) // max_samples)
    for path, _ in files[::step][:max_samples]:
        stats.update(load_rgb(path))
    return stats.result(computed_on=f"train ({min(len(files), max_samples)} images)")


def build(src: Path, out: Path, splits: tuple[str, ...] = ("train", "val"), dataset: str | None = None,
          stats_samples: int = 10_000, max_count: int = 10_000, max_size: float = 256e6,
          progress: bool = True) -> dict[str, Manifest]:
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise DataError(f"missing {src}: pass --src to a folder with {'/'.join(splits)}/<class>/<images>")
    classes = None
    listed = {}
    for split in splits:
        classes, listed[split] = list_split(src / split, classes)
    sizes = {load_rgb(p).shape[:2] for p, _ in listed[splits[0]][:64]}
    image_size = [int(s) for s in sizes.pop()] if len(sizes) == 1 else None  # None: sizes vary
    normalization = train_statistics(listed[splits[0]], stats_samples)
    return write_image_splits(
        out, {s: (records(files, src / s), len(files)) for s, files in listed.items()}, progress=progress,
        dataset=dataset or src.name, classes=classes, info={"image_size": image_size, "channels": 3},
        source=str(src.resolve()), recipe="image_folder", recipe_version=RECIPE_VERSION,
        normalization=normalization, max_count=max_count, max_size=max_size, input_ext="img")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="dataset root holding one folder per split")
    parser.add_argument("--splits", nargs="+", default=["train", "val"],
                        help="split folders under --src; the first defines classes and statistics "
                             "(default: %(default)s)")
    parser.add_argument("--name", default=None, help="dataset name in the manifest (default: the --src folder name)")
    parser.add_argument("--stats-samples", type=int, default=10_000,
                        help="train images used for normalization statistics (default: %(default)s)")
    add_output_args(parser, "shards/image_folder")
    args = parser.parse_args(argv)
    return run_cli(lambda: build(args.src, args.out, tuple(args.splits), args.name, args.stats_samples,
                                 args.max_count, args.max_size))


if __name__ == "__main__":
    sys.exit(main())
