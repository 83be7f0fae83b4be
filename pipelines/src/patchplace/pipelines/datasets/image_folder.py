"""ImageNet-style class folders -> WebDataset shards (RGB).

    ROOT/train/<class>/*.jpg   ROOT/val/<class>/*.jpg
    python data/image_folder.py --src ROOT --out shards/mydata

Classes are the sub-directories of the first split (sorted); every other split must use the same names.
JPEG and PNG files are stored as they are (no re-encoding) under the member extension ``.img``; other formats
Pillow reads are stored as PNG. Keys are the relative paths (``dog__img1_jpg`` for ``dog/img1.jpg``).
Normalization statistics come from up to ``--stats-samples`` train images (evenly spaced).

Each split's samples are shuffled once (``--seed``, recorded in the manifest's ``source``) before they are cut into
shards, so every shard holds a mix of all classes and a streaming reader's shuffle buffer sees them all.
``--workers N`` writes whole shards in N processes: the shards and the manifest are byte-identical to one process's.

The ILSVRC validation layout, one flat folder of images (``ROOT/val/ILSVRC2012_val_00000001.JPEG``, ...), is read
with ``--val-labels FILE``: Kaggle's ``LOC_val_solution.csv`` (``ImageId,PredictionString``, the first token the
wnid) or a text file of ``filename wnid`` lines; its wnids must be class folders of the first split.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from patchplace.data import ChannelStats, DataError, Manifest
from patchplace.data.manifest import class_list
from patchplace.data.parallel import write_planned_split
from patchplace.data.recipes import run_cli
from patchplace.pipelines.datasets import parse

RECIPE_VERSION = 2  # 2: samples shuffled (--seed) before sharding; 1: class order
EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm"}
_KEEP_BYTES = {".jpg", ".jpeg", ".png"}


def list_split(split_dir: Path, classes: list[str] | None,
               labels_file: Path | None = None) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names and (file, label) pairs of one split, in a stable (sorted) order; with ``labels_file`` the split
    is one flat folder of images labelled by that file (:func:`read_labels`)."""
    if not split_dir.is_dir():
        raise DataError(f"missing split folder {split_dir}: expected ROOT/<split>/<class>/<image files>")
    if labels_file is not None:
        if classes is None:
            raise DataError(f"{split_dir}: the first split defines the classes, it must hold class folders "
                            "(--val-labels labels a later, flat split)")
        return classes, list_flat_split(split_dir, classes, labels_file)
    found = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not found:
        flat = any(f.suffix.lower() in EXTENSIONS for f in split_dir.iterdir())
        raise DataError(f"{split_dir} has no class sub-folders: expected {split_dir}/<class>/<image files>"
                        + (" (a flat folder of images, such as ILSVRC2012 val, needs --val-labels FILE)" if flat
                           else ""))
    if classes is None:
        classes = found
    elif unknown := sorted(set(found) - set(classes)):
        raise DataError(f"{split_dir}: class folder(s) {unknown} are not classes of the first split")
    files = [(f, classes.index(c)) for c in found for f in sorted((split_dir / c).rglob("*"))
             if f.suffix.lower() in EXTENSIONS]
    if not files:
        raise DataError(f"{split_dir} holds no image files ({', '.join(sorted(EXTENSIONS))})")
    return classes, files


def _image_id(name: str) -> str:
    """``ILSVRC2012_val_00000001`` for ``ILSVRC2012_val_00000001.JPEG``, ``val/ILSVRC2012_val_00000001`` or itself."""
    name = Path(name.strip()).name
    return name[: -len(Path(name).suffix)] if Path(name).suffix.lower() in EXTENSIONS else name


def read_labels(file: Path) -> dict[str, tuple[str, int]]:
    """Image id (file name without its extension) -> (wnid, line number) from Kaggle's ``LOC_val_solution.csv``
    (header ``ImageId,PredictionString``; the first token of PredictionString is the wnid) or ``filename wnid``
    lines (blank lines skipped)."""
    if not file.is_file():
        raise DataError(f"missing --val-labels file {file}: pass LOC_val_solution.csv (Kaggle) or a text file of "
                        "'filename wnid' lines")
    lines = file.read_text().splitlines()
    is_csv = bool(lines) and lines[0].replace(" ", "").lower().startswith("imageid,predictionstring")
    rows = csv.reader(lines[1:]) if is_csv else (line.split() for line in lines)
    labels: dict[str, tuple[str, int]] = {}
    for number, row in enumerate(rows, start=2 if is_csv else 1):
        if not "".join(row).strip():
            continue
        if not is_csv and len(row) == 1 and row[0].isdigit():
            raise DataError(f"{file} line {number}: a bare class index (the devkit's ILSVRC2012_validation_ground_truth"
                            ".txt?): give 'filename wnid' lines or Kaggle's LOC_val_solution.csv instead")
        if (is_csv and (len(row) < 2 or not row[1].split())) or (not is_csv and len(row) != 2):
            raise DataError(f"{file} line {number}: expected " + ("'ImageId,wnid ...'" if is_csv
                                                                   else "'filename wnid'") + f", got {row}")
        name, wnid = (row[0], row[1].split()[0]) if is_csv else row
        image_id = _image_id(name)
        if image_id in labels and labels[image_id][0] != wnid:
            raise DataError(f"{file} line {number}: {image_id} is labelled {wnid}, line {labels[image_id][1]} "
                            f"says {labels[image_id][0]}")
        labels[image_id] = (wnid, number)
    if not labels:
        raise DataError(f"{file} holds no labels")
    return labels


def list_flat_split(split_dir: Path, classes: list[str], labels_file: Path) -> list[tuple[Path, int]]:
    """(file, label) pairs of a flat folder of images labelled by ``labels_file``, sorted by file name."""
    labels = read_labels(labels_file)
    images = sorted(f for f in split_dir.iterdir() if f.is_file() and f.suffix.lower() in EXTENSIONS)
    if not images:
        raise DataError(f"{split_dir} holds no image files ({', '.join(sorted(EXTENSIONS))})")
    if unlabelled := [f.name for f in images if _image_id(f.name) not in labels]:
        raise DataError(f"{len(unlabelled)} image(s) of {split_dir} have no label in {labels_file}, e.g. "
                        f"{unlabelled[0]}: is it the label file of this split?")
    ids = {_image_id(f.name) for f in images}
    if len(ids) != len(images):
        raise DataError(f"{split_dir}: two image files share a name apart from the extension; keep one")
    if missing := sorted(set(labels) - ids):
        raise DataError(f"{labels_file} labels {len(missing)} image(s) not in {split_dir}, e.g. {missing[0]} "
                        f"(line {labels[missing[0]][1]}): is the folder complete?")
    index = {name: i for i, name in enumerate(classes)}
    files = []
    for f in images:
        wnid, number = labels[_image_id(f.name)]
        if wnid not in index:
            raise DataError(f"{labels_file} line {number}: {f.name} is labelled {wnid!r}, not a class (folder) of "
                            f"the first split {class_list(classes)}")
        files.append((f, index[wnid]))
    return files


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
        yield folder_record((str(path), label, str(root)))


def folder_record(item: tuple[str, int, str]) -> tuple[str, int, np.ndarray, bytes | None]:
    """(key, label, pixels, original bytes or None) of one ``(file, label, split folder)``: run in the writer's
    worker processes (every image is decoded, so a corrupt file is an error naming it)."""
    path, label, root = Path(item[0]), item[1], Path(item[2])
    image = load_rgb(path)
    encoded = path.read_bytes() if path.suffix.lower() in _KEEP_BYTES else None
    return sample_key(path, root), label, image, encoded


def shuffled(files: list[tuple[Path, int]], seed: int, stream: int) -> list[tuple[Path, int]]:
    """``files`` in the order of a permutation drawn from ``(seed, stream)`` (stream: the split's position), as
    the speech_commands recipe shuffles its splits."""
    rng = np.random.default_rng([seed, stream])
    return [files[i] for i in rng.permutation(len(files))]


def _pixel_sums(path: Path) -> tuple[int, np.ndarray, np.ndarray]:
    """What :meth:`ChannelStats.update` adds for one image (so sums folded in file order are bit-identical)."""
    x = np.asarray(load_rgb(path), dtype=np.float64).reshape(-1, 3) / 255.0
    return x.shape[0], x.sum(0), (x * x).sum(0)


def train_statistics(files: list[tuple[Path, int]], max_samples: int, workers: int = 1) -> dict:
    """Per-channel mean / std of up to ``max_samples`` evenly spaced images of ``files`` (in their listed order,
    whatever the shuffle), decoded by ``workers`` processes and summed in file order."""
    stats = ChannelStats(3)
    step = max(1, len(files) // max_samples)
    paths = [path for path, _ in files[::step][:max_samples]]
    if workers > 1 and len(paths) > 1:
        methods = multiprocessing.get_all_start_methods()
        with multiprocessing.get_context("fork" if "fork" in methods else "spawn").Pool(workers) as pool:
            sums = list(pool.imap(_pixel_sums, paths, chunksize=16))
    else:
        sums = [_pixel_sums(path) for path in paths]
    for n, total, squares in sums:
        stats.n += n
        stats.sum += total
        stats.sumsq += squares
    return stats.result(computed_on=f"train ({min(len(files), max_samples)} images)")


def build(src: Path, out: Path, splits: tuple[str, ...] = ("train", "val"), dataset: str | None = None,
          stats_samples: int = 10_000, max_count: int = 10_000, max_size: float = 256e6,
          progress: bool = True, *, seed: int = 0, workers: int = 1,
          val_labels: Path | None = None) -> dict[str, Manifest]:
    """Write every split of ``src`` under ``out`` (each shuffled by ``seed``, written by ``workers`` processes);
    ``val_labels``: the label file of a flat ``val`` folder (ILSVRC layout)."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise DataError(f"missing {src}: pass --src to a folder with {'/'.join(splits)}/<class>/<images>")
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    if val_labels is not None and "val" not in splits[1:]:
        raise DataError(f"--val-labels labels the flat split 'val', which is not a later split of {list(splits)}")
    classes = None
    listed = {}
    for split in splits:
        classes, listed[split] = list_split(src / split, classes, val_labels if split == "val" else None)
    sizes = {load_rgb(p).shape[:2] for p, _ in listed[splits[0]][:64]}
    image_size = [int(s) for s in sizes.pop()] if len(sizes) == 1 else None  # None: sizes vary
    normalization = train_statistics(listed[splits[0]], stats_samples, workers)
    source = f"{src.resolve()} (samples shuffled with seed {seed}" + (
        f"; val labels from {Path(val_labels).resolve()})" if val_labels is not None else ")")
    manifests: dict[str, Manifest] = {}
    for stream, (split, files) in enumerate(listed.items()):
        files = shuffled(files, seed, stream)
        manifests[split] = write_planned_split(
            out, split, [(str(path), label, str(src / split)) for path, label in files], folder_record,
            workers=workers, sizes=[path.stat().st_size + len(str(label)) for path, label in files],
            max_count=max_count, max_size=max_size, progress=progress, dataset=dataset or src.name,
            classes=classes, info={"image_size": image_size, "channels": 3}, source=source, recipe="image_folder",
            recipe_version=RECIPE_VERSION, normalization=normalization, input_ext="img")
    return manifests


def main(argv: list[str] | None = None) -> int:
    """``python data/image_folder.py``: the options of :func:`patchplace.pipelines.datasets.image_folder_parser`."""
    return run(parse("image_folder", argv))


def run(args: argparse.Namespace) -> int:
    return run_cli(lambda: build(args.src, args.out, tuple(args.splits), args.name, args.stats_samples,
                                 args.max_count, args.max_size, seed=args.seed, workers=args.workers,
                                 val_labels=args.val_labels))

if __name__ == "__main__":
    sys.exit(main())
