"""Dataset recipes: each module turns a real on-disk dataset into WebDataset shards + manifest.json.

Run them as scripts (``python data/fashion_mnist.py --help``); tests import them as ``data.<recipe>``. Their
command lines are here: the arguments parse without numpy, webdataset or torch, so that ``--help`` and a usage
error answer in about a second (as the pipelines' :mod:`patchplace.pipelines.cli`); the recipe module is imported
only to run (:func:`main`). A recipe's own ``main(argv)`` parses with the same parser (:func:`parse`). Help fits
100 columns on any terminal (:class:`~patchplace.pipelines.help.HelpFormatter`); a usage error is one line on
stderr, exit 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from patchplace.data.errors import DataError
from patchplace.data.kws import BACKGROUND_NOISE_DIR, KWS_CLASSES
from patchplace.data.remote import refuse_url
from patchplace.pipelines.help import HelpFormatter

FASHION_MNIST_SRC = Path("/usr/share/datasets/fashion-mnist")  # the Debian package dataset-fashion-mnist
SPEECH_COMMANDS_OUT = "shards/speech_commands"  # where the speech_commands_mp3_* configs read


class RecipeParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help: the options)\n")


def description(recipe: str) -> str:
    """The docstring of recipe module ``recipe``, read from its source without importing it."""
    source = Path(__file__).with_name(f"{recipe}.py").read_text()
    return ast.get_docstring(ast.parse(source), clean=False) or ""


def new_parser(recipe: str, **kwargs: object) -> RecipeParser:
    """The parser of ``python data/<recipe>.py`` (``description``: the module's docstring unless given)."""
    kwargs.setdefault("description", description(recipe))
    return RecipeParser(prog=f"python data/{recipe}.py", formatter_class=HelpFormatter, **kwargs)  # type: ignore[arg-type]


def add_output_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """``--out``, ``--max-count`` and ``--max-size`` (shard limits), shared by every recipe (torch-free)."""
    parser.add_argument("--out", type=local_dir, default=Path(default_out),
                        help="output directory; each split goes to OUT/<split>/ (default: %(default)s)")
    parser.add_argument("--max-count", type=int, default=10_000,
                        help="max samples per shard (default: %(default)s)")
    parser.add_argument("--max-size", type=float, default=256e6,
                        help="max bytes per shard (default: %(default).0f)")


def local_dir(value: str) -> Path:
    """``--out``: a local directory; a URL (``s3://...``) is refused in one line (write locally, then upload)."""
    try:
        refuse_url(value)
    except DataError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(value)


def cifar_parser() -> RecipeParser:
    parser = new_parser("cifar")
    parser.add_argument("--src", type=Path, required=True,
                        help="extracted cifar-10-batches-py or cifar-100-python folder")
    parser.add_argument("--labels", choices=("fine", "coarse"), default="fine",
                        help="CIFAR-100 label set (default: %(default)s; ignored for CIFAR-10)")
    add_output_args(parser, "shards/cifar")
    return parser


def fashion_mnist_parser() -> RecipeParser:
    parser = new_parser("fashion_mnist")
    parser.add_argument("--src", type=Path, default=FASHION_MNIST_SRC,
                        help="directory with the four IDX .gz files (default: %(default)s)")
    add_output_args(parser, "shards/fashion_mnist")
    return parser


def image_folder_parser() -> RecipeParser:
    parser = new_parser("image_folder")
    parser.add_argument("--src", type=Path, required=True, help="dataset root holding one folder per split")
    parser.add_argument("--splits", nargs="+", default=["train", "val"],
                        help="split folders under --src; the first defines classes and statistics "
                             "(default: %(default)s)")
    parser.add_argument("--name", default=None, help="dataset name in the manifest (default: the --src folder name)")
    parser.add_argument("--stats-samples", type=int, default=10_000,
                        help="train images used for normalization statistics (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of each split's sample shuffle before sharding, recorded in the manifest's source "
                             "(default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes writing whole shards (and decoding the statistics' images); the output is "
                             "byte-identical for any count (default: %(default)s)")
    parser.add_argument("--val-labels", type=Path, default=None, metavar="FILE",
                        help="labels of a flat val folder (ILSVRC2012_val_*.JPEG): Kaggle's LOC_val_solution.csv "
                             "or 'filename wnid' lines; wnids are the first split's class folders")
    add_output_args(parser, "shards/image_folder")
    return parser


def speech_commands_parser() -> RecipeParser:
    parser = new_parser(
        "speech_commands",
        description="Turn a Speech Commands v1/v2 folder (or the synthesized spoken-keywords corpus) into "
                    "12-class keyword-spotting WebDataset shards: train / validation / test (classes "
                    f"{', '.join(KWS_CLASSES)}) plus a background_noise split, each with a manifest.json.",
        epilog="Examples: python data/speech_commands.py --src speech_commands_v0.01 --split-lists "
               "TC-ResNet/speech_commands_dataset (MP3 / TC-ResNet's splits, into shards/speech_commands); "
               "python data/spoken_keywords.py --out corpora/spoken_keywords && "
               "python data/speech_commands.py --src corpora/spoken_keywords --out shards/spoken_keywords (the demo)",
    )
    parser.add_argument("--src", required=True, type=Path,
                        help="Speech Commands folder: <word>/*.wav, validation_list.txt, testing_list.txt, "
                             f"{BACKGROUND_NOISE_DIR}/*.wav")
    parser.add_argument("--version", default="auto", choices=["auto", "1", "2"],
                        help="Speech Commands version (auto: 2 when v2-only words such as 'backward' exist)")
    parser.add_argument("--silence-percentage", type=float, default=10.0,
                        help="_silence_ clips per split, in %% of its keyword clips (default 10, as in "
                             "TensorFlow)")
    parser.add_argument("--unknown-percentage", type=float, default=10.0,
                        help="_unknown_ clips per split, in %% of its keyword clips (default 10, as in "
                             "TensorFlow)")
    parser.add_argument("--seed", type=int, default=0, help="seed for unknown subsampling and silence cuts")
    parser.add_argument("--split-lists", type=Path, default=None, metavar="DIR",
                        help="folder with TC-ResNet's fixed lists train.txt / valid.txt / test.txt "
                             "(hyperconnect/TC-ResNet speech_commands_dataset/): each split holds exactly the "
                             "files its list names, _silence_ lines as all-zero clips; --silence-percentage, "
                             "--unknown-percentage and --seed then play no part (default: the seeded draw)")
    add_output_args(parser, SPEECH_COMMANDS_OUT)
    parser.add_argument("--dataset", default=None,
                        help="dataset name in the manifests (default: spoken_keywords for the synthesized "
                             "corpus, else speech_commands_v1/v2)")
    return parser


def spoken_keywords_parser() -> RecipeParser:
    parser = new_parser(
        "spoken_keywords",
        description="Synthesize a Speech-Commands-layout keyword corpus with espeak-ng: 10 keywords, 25 "
                    "unknown words, background noise, validation/testing lists split by speaker (voice x "
                    "variant). Deterministic given --seed.",
        epilog="Then: python data/speech_commands.py --src corpora/spoken_keywords "
               "--out shards/spoken_keywords",
    )
    parser.add_argument("--out", required=True, type=Path,
                        help="corpus folder to create (an existing one is replaced atomically)")
    parser.add_argument("--clips-per-keyword", type=int, default=200, help="clips per keyword (default 200)")
    parser.add_argument("--clips-per-unknown-word", type=int, default=30,
                        help="clips per unknown word (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel espeak-ng processes (default: number of CPU cores)")
    parser.add_argument("--noise-seconds", type=float, default=None,
                        help="length of each background-noise file (default: drawn from 30-60 s)")
    return parser


PARSERS: dict[str, Callable[[], RecipeParser]] = {
    "cifar": cifar_parser, "fashion_mnist": fashion_mnist_parser, "image_folder": image_folder_parser,
    "speech_commands": speech_commands_parser, "spoken_keywords": spoken_keywords_parser}


def parse(recipe: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (default: the process's arguments) parsed by ``recipe``'s parser; ``--help`` exits 0, a usage error
    exits 2 in one line."""
    return PARSERS[recipe]().parse_args(sys.argv[1:] if argv is None else argv)


def main(recipe: str, argv: list[str] | None = None) -> int:
    """``python data/<recipe>.py``: the arguments parsed here, then the recipe module imported and run on them."""
    args = parse(recipe, argv)
    return importlib.import_module(f"patchplace.pipelines.datasets.{recipe}").run(args)
