#!/usr/bin/env python
"""Speech Commands v1/v2 folder -> 12-class keyword-spotting shards (+ the background noise, for mixing).

    python data/speech_commands.py --src corpora/spoken_keywords --out shards/spoken_keywords

Input is the Speech Commands layout: one folder of 1 s, 16 kHz wavs per word, ``validation_list.txt`` and
``testing_list.txt`` (paths relative to the folder) and ``_background_noise_/*.wav``. Real Speech Commands
(v1: 30 words, v2: 35) and the corpus synthesized by ``data/spoken_keywords.py`` both work.

Output, following TensorFlow's ``speech_commands`` recipe (``input_data.py``):

- ``train`` / ``validation`` / ``test``: files named in the two list files go to validation / test, all others
  to train. Classes are ``KWS_CLASSES`` (``_silence_``, ``_unknown_``, the ten keywords). With K keyword clips
  in a split, ``ceil(K * unknown_percentage / 100)`` clips of the other words are drawn at random as
  ``_unknown_`` and ``ceil(K * silence_percentage / 100)`` ``_silence_`` clips are cut from the noise files
  at a random offset and a random volume in [0, 1) -- both percentages are of the keyword count, as in
  TensorFlow.
- ``background_noise``: every noise file in full (class ``_background_noise_``), so training can mix noise in.

Audio goes through ``read_wav`` (other rates are resampled, extra channels downmixed); clips are not padded
(the reader pads / crops to ``clip_samples``). Every random choice comes from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from patchplace.data.codecs import read_wav
from patchplace.data.errors import DataError
from patchplace.data.kws import (
    AUXILIARY_WORDS_V2_ONLY,
    BACKGROUND_NOISE_DIR,
    KEYWORDS,
    KWS_CLASSES,
    SILENCE,
    UNKNOWN,
    which_set,
)
from patchplace.data.manifest import Manifest
from patchplace.data.recipes import add_output_args, run_cli
from patchplace.data.writer import SplitWriter

RECIPE = "speech_commands"
RECIPE_VERSION = 1
SAMPLE_RATE = 16000
CLIP_SAMPLES = SAMPLE_RATE  # 1 s clips
LIST_FILES = {"validation": "validation_list.txt", "testing": "testing_list.txt"}
# Speech Commands' set names -> our split directory names.
SPLIT_DIRS = {"training": "train", "validation": "validation", "testing": "test"}
BACKGROUND_SPLIT = "background_noise"
SYNTH_HINT = "run python data/spoken_keywords.py first, or pass --src to a Speech Commands folder"


@dataclass(frozen=True)
class Clip:
    """One sample to write: a wav file (``rel`` path) or a silence cut (``noise`` index, offset, volume)."""

    key: str
    label: int
    rel: str | None = None
    noise: int = -1
    offset: int = 0
    volume: float = 0.0


def sample_key(rel: str) -> str:
    """Stable shard key from a relative path: ``yes/0a7c2a8d_nohash_0.wav`` -> ``yes__0a7c2a8d_nohash_0``."""
    stem = rel[:-4] if rel.lower().endswith(".wav") else rel
    return stem.replace("/", "__").replace(".", "_")


def _wavs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".wav")


def scan_words(src: Path) -> dict[str, list[str]]:
    """Word folder -> sorted relative wav paths (``word/file.wav``); skips folders starting with _ or ."""
    if not src.is_dir():
        raise DataError(f"--src {src} is not a directory: {SYNTH_HINT}")
    words = {}
    for folder in sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        files = _wavs(folder)
        if files:
            words[folder.name] = [f"{folder.name}/{f.name}" for f in files]
    if not words:
        raise DataError(f"{src} has no word folders with .wav files (expected e.g. {src}/yes/*.wav): "
                        f"{SYNTH_HINT}")
    return words


def detect_version(src: Path, words: dict[str, list[str]], version: str) -> int:
    """Speech Commands version: 2 when any v2-only word (backward, forward, ...) is present, else 1."""
    found = sorted(set(words) & set(AUXILIARY_WORDS_V2_ONLY))
    detected = 2 if found else 1
    if version == "auto":
        return detected
    if version not in ("1", "2"):
        raise DataError(f"--version must be auto, 1 or 2, got {version!r}")
    if int(version) != detected:
        why = f"has the v2-only word folder(s) {found}" if found else "has none of the v2-only words"
        raise DataError(f"--version {version} but {src} {why}: pass --version {detected} or --version auto")
    return detected


def read_list(src: Path, name: str) -> list[str]:
    """Relative paths named by a list file, checked to exist."""
    list_file = src / name
    rels = []
    for line in list_file.read_text().splitlines():
        rel = line.strip().replace("\\", "/")
        if not rel:
            continue
        if not (src / rel).is_file():
            raise DataError(f"{list_file} names {rel}, but {src / rel} does not exist: restore the file "
                            f"or remove the line")
        rels.append(rel)
    return rels


def assign_sets(src: Path, words: dict[str, list[str]], log=print) -> tuple[dict[str, str], str]:
    """Relative path -> ``training`` / ``validation`` / ``testing`` and a description of the rule used."""
    present = {s: (src / f).is_file() for s, f in LIST_FILES.items()}
    files = [rel for rels in words.values() for rel in rels]
    if not any(present.values()):
        log(f"note: {src} has no {' / '.join(LIST_FILES.values())}: splitting by speaker hash "
            "(which_set, 10% validation / 10% testing)")
        return {rel: which_set(rel) for rel in files}, "which_set 10/10"
    if not all(present.values()):
        have = [f for s, f in LIST_FILES.items() if present[s]]
        missing = [f for s, f in LIST_FILES.items() if not present[s]]
        raise DataError(f"{src} has {have[0]} but not {missing[0]}: add it, or remove both to split by "
                        "speaker hash")
    listed: dict[str, str] = {}
    for set_name, name in LIST_FILES.items():
        for rel in read_list(src, name):
            if listed.get(rel, set_name) != set_name:
                raise DataError(f"{rel} is named in both {src / LIST_FILES['validation']} and "
                                f"{src / LIST_FILES['testing']}: remove it from one of them")
            listed[rel] = set_name
    return {rel: listed.get(rel, "training") for rel in files}, "validation_list.txt / testing_list.txt"


def load_noise(src: Path) -> list[tuple[str, np.ndarray]]:
    """``_background_noise_/*.wav`` as (relative path, float32 16 kHz mono wave), sorted by name."""
    folder = src / BACKGROUND_NOISE_DIR
    if not folder.is_dir():
        return []
    out = []
    for f in _wavs(folder):
        rel = f"{BACKGROUND_NOISE_DIR}/{f.name}"
        out.append((rel, read_wav(str(f), SAMPLE_RATE, key=str(f))))
    return out


def plan_split(set_name: str, set_of: dict[str, str], noise: list[tuple[str, np.ndarray]], *,
               silence_percentage: float, unknown_percentage: float, seed: int) -> list[Clip]:
    """The clips of one split: keywords, a random ``_unknown_`` subset, ``_silence_`` cuts; shuffled."""
    rng = np.random.default_rng([seed, list(SPLIT_DIRS).index(set_name)])
    keyword_clips, unknown_clips = [], []
    for rel in sorted(r for r, s in set_of.items() if s == set_name):
        word = rel.split("/", 1)[0]
        if word in KEYWORDS:
            keyword_clips.append(Clip(sample_key(rel), KWS_CLASSES.index(word), rel=rel))
        else:
            unknown_clips.append(Clip(sample_key(rel), KWS_CLASSES.index(UNKNOWN), rel=rel))
    n = len(keyword_clips)
    if n == 0:
        raise DataError(f"the {set_name} set has no keyword clips ({', '.join(KEYWORDS)}): check the word "
                        "folders and the list files (a corpus this small may need more speakers)")
    # TensorFlow: unknown_size = silence_size = ceil(set_size * percentage / 100), set_size = keyword clips.
    n_unknown = min(len(unknown_clips), math.ceil(n * unknown_percentage / 100))
    chosen = [unknown_clips[i] for i in sorted(rng.permutation(len(unknown_clips))[:n_unknown])]
    n_silence = math.ceil(n * silence_percentage / 100)
    usable = [i for i, (_, w) in enumerate(noise) if len(w) >= CLIP_SAMPLES]
    if n_silence and not usable:
        raise DataError(f"no background noise of at least 1 s in {BACKGROUND_NOISE_DIR}/ to cut {SILENCE} "
                        "clips from: add noise wavs there, or pass --silence-percentage 0")
    silence = []
    for i in range(n_silence):
        k = usable[int(rng.integers(len(usable)))]
        offset = int(rng.integers(0, len(noise[k][1]) - CLIP_SAMPLES + 1))
        silence.append(Clip(f"{SILENCE}__{i:06d}", KWS_CLASSES.index(SILENCE), noise=k, offset=offset,
                            volume=float(rng.uniform(0, 1))))
    clips = keyword_clips + chosen + silence
    # Shard order is shuffled once, so streaming readers with small shuffle buffers still see mixed classes.
    return [clips[i] for i in rng.permutation(len(clips))]


def dataset_name(src: Path, version: int) -> str:
    meta = src / "corpus.json"
    if meta.is_file():
        try:
            if json.loads(meta.read_text()).get("recipe") == "spoken_keywords":
                return "spoken_keywords"
        except (json.JSONDecodeError, AttributeError):
            pass
    return f"speech_commands_v{version}"


def build_kws_shards(src: str | Path, out: str | Path, *, version: str = "auto",
                     silence_percentage: float = 10, unknown_percentage: float = 10, seed: int = 0,
                     max_count: int = 10_000, max_size: float = 256e6,
                     dataset: str | None = None, progress: bool = True, log=print) -> dict[str, Manifest]:
    """Write ``train`` / ``validation`` / ``test`` KWS splits and ``background_noise`` under ``out``.

    Returns the manifests by split name. Each split directory appears only when complete.
    """
    src, out = Path(src), Path(out)
    for name, pct in (("silence_percentage", silence_percentage), ("unknown_percentage", unknown_percentage)):
        if not 0 <= pct <= 100:
            raise DataError(f"--{name.replace('_', '-')} must be in [0, 100], got {pct}")
    words = scan_words(src)
    version_n = detect_version(src, words, str(version))
    set_of, rule = assign_sets(src, words, log=log)
    noise = load_noise(src)
    dataset = dataset or dataset_name(src, version_n)
    plans = {SPLIT_DIRS[s]: plan_split(s, set_of, noise, silence_percentage=silence_percentage,
                                       unknown_percentage=unknown_percentage, seed=seed) for s in SPLIT_DIRS}
    source = (f"{src.resolve()} (Speech Commands v{version_n} layout, split by {rule}; silence "
              f"{silence_percentage:g}% / unknown {unknown_percentage:g}% of keyword clips, seed {seed})")
    common = dict(dataset=dataset, modality="audio", source=source, recipe=RECIPE,
                  recipe_version=RECIPE_VERSION, max_count=max_count, max_size=max_size)
    manifests: dict[str, Manifest] = {}
    total = sum(len(p) for p in plans.values()) + len(noise)
    with tqdm(total=total, desc=f"{dataset} -> {out}", unit="clip", disable=not progress) as bar:
        for split, clips in plans.items():
            with SplitWriter(out, split, classes=list(KWS_CLASSES),
                             info={"sample_rate": SAMPLE_RATE, "clip_samples": CLIP_SAMPLES}, **common) as w:
                for clip in clips:
                    if clip.rel is not None:
                        wave = read_wav(str(src / clip.rel), SAMPLE_RATE, key=str(src / clip.rel))
                        if wave.size == 0:
                            raise DataError(f"{src / clip.rel} holds no samples: delete it or replace it")
                    else:
                        cut = noise[clip.noise][1][clip.offset:clip.offset + CLIP_SAMPLES]
                        wave = (cut * clip.volume).astype(np.float32)
                    w.add_audio(clip.key, clip.label, wave)
                    bar.update()
            manifests[split] = w.manifest
        if noise:
            with SplitWriter(out, BACKGROUND_SPLIT, classes=[BACKGROUND_NOISE_DIR],
                             info={"sample_rate": SAMPLE_RATE, "clip_samples": None}, **common) as w:
                for rel, wave in noise:
                    w.add_audio(sample_key(rel), 0, wave)
                    bar.update()
            manifests[BACKGROUND_SPLIT] = w.manifest
        else:
            log(f"note: {src / BACKGROUND_NOISE_DIR} has no wavs: no {BACKGROUND_SPLIT} split written")
    return manifests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python data/speech_commands.py",
        description="Turn a Speech Commands v1/v2 folder (or the synthesized spoken-keywords corpus) into "
                    "12-class keyword-spotting WebDataset shards: train / validation / test (classes "
                    f"{', '.join(KWS_CLASSES)}) plus a background_noise split, each with a manifest.json.",
        epilog="Example: python data/spoken_keywords.py --out corpora/spoken_keywords && "
               "python data/speech_commands.py --src corpora/spoken_keywords --out shards/spoken_keywords",
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
    add_output_args(parser, "shards/spoken_keywords")
    parser.add_argument("--dataset", default=None,
                        help="dataset name in the manifests (default: spoken_keywords for the synthesized "
                             "corpus, else speech_commands_v1/v2)")
    args = parser.parse_args(argv)
    return run_cli(lambda: build_kws_shards(
        args.src, args.out, version=args.version, silence_percentage=args.silence_percentage,
        unknown_percentage=args.unknown_percentage, seed=args.seed, max_count=args.max_count,
        max_size=args.max_size, dataset=args.dataset))


if __name__ == "__main__":
    sys.exit(main())
