#!/usr/bin/env python
"""Speech Commands v1/v2 folder -> 12-class keyword-spotting shards (+ the background noise, for mixing).

    python data/speech_commands.py --src speech_commands_v0.01            # -> shards/speech_commands/
    python data/speech_commands.py --src speech_commands_v0.01 --split-lists TC-ResNet/speech_commands_dataset

Input is the Speech Commands layout: one folder of 16 kHz wavs (at most 1 s; some real ones are shorter) per
word, ``validation_list.txt`` and ``testing_list.txt`` (paths relative to the folder) and
``_background_noise_/*.wav``. Real Speech Commands (v1: 30 words, v2: 35) and the corpus synthesized by
``data/spoken_keywords.py`` both work.

Output (``--out``, default ``shards/speech_commands``: where the ``speech_commands_mp3_*`` configs read):

- ``train`` / ``validation`` / ``test``, classes ``KWS_CLASSES`` (``_silence_``, ``_unknown_``, the ten keywords).
  With ``--split-lists DIR`` (TC-ResNet's fixed ``train.txt`` / ``valid.txt`` / ``test.txt``, which MP3 §4.1 keeps:
  "keeping their audio preprocessing routines, data splits and other details intact"), each split holds exactly
  the files its list names -- keyword files as their keyword, every other word as ``_unknown_`` -- and one
  ``_silence_`` clip per ``_silence_/...`` line: an all-zero clip, as TC-ResNet's ``_gen_empty_audio`` (noise
  comes from the training augmentation). Without lists (TensorFlow's ``speech_commands`` ``input_data.py``):
  files named in the two Speech Commands list files go to validation / test, all others to train; with K keyword
  clips in a split, ``ceil(K * unknown_percentage / 100)`` clips of the other words are drawn as ``_unknown_`` and
  ``ceil(K * silence_percentage / 100)`` ``_silence_`` clips are cut from the noise files at a random offset and a
  random volume in [0, 1), all drawn from ``--seed`` (TensorFlow's draw is unseeded and directory-order dependent,
  TC-ResNet's README: a departure from TC-ResNet's lists, docs/data.md).
- ``background_noise``: every noise file in full (class ``_background_noise_``), so training can mix noise in.

Audio goes through ``read_wav`` (other rates are resampled, extra channels downmixed), then every clip is brought
to exactly 1 s here, once: zero-padded at the end or cut after 1 s, as TensorFlow's
``decode_wav(desired_samples=16000)`` in TC-ResNet's ``anchored_slice_or_pad`` (and TensorFlow's
``speech_commands`` input pipeline). The manifests' ``clip_samples`` = 16000 therefore holds for every sample, and
the splits load in memory (``data.in_memory=auto``).
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
from patchplace.data.recipes import run_cli
from patchplace.data.writer import SplitWriter
from patchplace.pipelines.datasets import SPEECH_COMMANDS_OUT, parse

RECIPE = "speech_commands"
# 2: clips padded / cut to 1 s at write (1 left short clips short), --split-lists
RECIPE_VERSION = 2
SAMPLE_RATE = 16000
CLIP_SAMPLES = SAMPLE_RATE  # 1 s clips
LIST_FILES = {"validation": "validation_list.txt", "testing": "testing_list.txt"}
# TC-ResNet's fixed split lists (speech_commands_dataset/{train,valid,test}.txt) -> our set names.
TC_RESNET_LISTS = {"training": "train.txt", "validation": "valid.txt", "testing": "test.txt"}
# Speech Commands' set names -> our split directory names.
SPLIT_DIRS = {"training": "train", "validation": "validation", "testing": "test"}
BACKGROUND_SPLIT = "background_noise"
SYNTH_HINT = "run python data/spoken_keywords.py first, or pass --src to a Speech Commands folder"
DEFAULT_OUT = SPEECH_COMMANDS_OUT


@dataclass(frozen=True)
class Clip:
    """One sample to write: a wav file (``rel`` path), a silence cut (``noise`` index, offset, volume) or, with
    neither, an all-zero silence clip (TC-ResNet's lists)."""

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


def fixed_clip(wave: np.ndarray, samples: int = CLIP_SAMPLES) -> np.ndarray:
    """``wave`` zero-padded at the end or cut after ``samples``: TensorFlow's ``decode_wav(desired_samples=...)``,
    which TC-ResNet's ``anchored_slice_or_pad`` (and TensorFlow's speech_commands pipeline) reads every clip with."""
    out = np.zeros(samples, dtype=np.float32)
    n = min(len(wave), samples)
    out[:n] = wave[:n]
    return out


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


def read_split_lists(src: Path, lists: Path, words: dict[str, list[str]]) -> dict[str, tuple[list[str], int]]:
    """TC-ResNet's fixed lists: set name -> (the wav paths its list names, in list order; its ``_silence_`` lines).

    Lines are ``word/file.wav`` relative to ``src``; ``_silence_/...`` lines name no file and count one silence
    clip each. A file named twice (in one list or two) or missing from ``src`` is an error."""
    present = set(rel for rels in words.values() for rel in rels)
    out, seen = {}, {}
    for set_name, name in TC_RESNET_LISTS.items():
        path = lists / name
        if not path.is_file():
            raise DataError(f"--split-lists {lists} has no {name} (TC-ResNet's speech_commands_dataset/ holds "
                            f"{', '.join(TC_RESNET_LISTS.values())}): point it at that folder")
        rels, silence = [], 0
        for number, line in enumerate(path.read_text().splitlines(), 1):
            rel = line.strip().replace("\\", "/")
            if not rel:
                continue
            if rel.split("/", 1)[0] == SILENCE:
                silence += 1
                continue
            if rel not in present:
                raise DataError(f"{path}:{number} names {rel}, but {src / rel} is not a wav of a word folder of "
                                f"{src}: pass the Speech Commands version the lists were made for (TC-ResNet: v1)")
            if rel in seen:
                raise DataError(f"{path}:{number} names {rel}, already named by {seen[rel]}: remove one line")
            seen[rel] = f"{name}:{number}"
            rels.append(rel)
        out[set_name] = (rels, silence)
    return out


def plan_listed_split(set_name: str, rels: list[str], silence: int) -> list[Clip]:
    """The clips of one split as TC-ResNet's list names them: keyword files under their keyword, every other
    word as ``_unknown_``, ``silence`` all-zero ``_silence_`` clips; in list order (TC-ResNet's lists are
    shuffled), the silence clips spread evenly through it so that small shuffle buffers still mix them in."""
    clips = [Clip(sample_key(rel), KWS_CLASSES.index(word if word in KEYWORDS else UNKNOWN), rel=rel)
             for rel, word in ((rel, rel.split("/", 1)[0]) for rel in rels)]
    if not clips and not silence:
        raise DataError(f"the {TC_RESNET_LISTS[set_name]} list names no clip")
    for i in range(silence):
        at = (i + 1) * (len(clips) + 1) // (silence + 1)
        clips.insert(at, Clip(f"{SILENCE}__{i:06d}", KWS_CLASSES.index(SILENCE)))
    return clips


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


def build_kws_shards(src: str | Path, out: str | Path = DEFAULT_OUT, *, version: str = "auto",
                     silence_percentage: float = 10, unknown_percentage: float = 10, seed: int = 0,
                     split_lists: str | Path | None = None, max_count: int = 10_000, max_size: float = 256e6,
                     dataset: str | None = None, progress: bool = True, log=print) -> dict[str, Manifest]:
    """Write ``train`` / ``validation`` / ``test`` KWS splits and ``background_noise`` under ``out``.

    ``split_lists``: a folder with TC-ResNet's ``train.txt`` / ``valid.txt`` / ``test.txt``, used exactly (the
    percentages and the seed then play no part); None: the seeded draw. Returns the manifests by split name. Each
    split directory appears only when complete.
    """
    src, out = Path(src), Path(out)
    for name, pct in (("silence_percentage", silence_percentage), ("unknown_percentage", unknown_percentage)):
        if not 0 <= pct <= 100:
            raise DataError(f"--{name.replace('_', '-')} must be in [0, 100], got {pct}")
    words = scan_words(src)
    version_n = detect_version(src, words, str(version))
    noise = load_noise(src)
    dataset = dataset or dataset_name(src, version_n)
    if split_lists is not None:
        listed = read_split_lists(src, Path(split_lists), words)
        plans = {SPLIT_DIRS[s]: plan_listed_split(s, *listed[s]) for s in SPLIT_DIRS}
        source = (f"{src.resolve()} (Speech Commands v{version_n} layout, split, _unknown_ and _silence_ by the "
                  f"fixed lists {Path(split_lists).resolve()}/{{{','.join(TC_RESNET_LISTS.values())}}}; silence "
                  "clips all zeros; clips zero-padded / cut to 1 s)")
    else:
        set_of, rule = assign_sets(src, words, log=log)
        plans = {SPLIT_DIRS[s]: plan_split(s, set_of, noise, silence_percentage=silence_percentage,
                                           unknown_percentage=unknown_percentage, seed=seed) for s in SPLIT_DIRS}
        source = (f"{src.resolve()} (Speech Commands v{version_n} layout, split by {rule}; silence "
                  f"{silence_percentage:g}% / unknown {unknown_percentage:g}% of keyword clips, seed {seed}; clips "
                  "zero-padded / cut to 1 s)")
    common = dict(dataset=dataset, modality="audio", source=source, recipe=RECIPE,
                  recipe_version=RECIPE_VERSION, max_count=max_count, max_size=max_size)
    manifests: dict[str, Manifest] = {}
    total = sum(len(p) for p in plans.values()) + len(noise)
    with tqdm(total=total, desc=f"{dataset} -> {out}", unit="clip", disable=not progress) as bar:
        for split, clips in plans.items():
            with SplitWriter(out, split, classes=list(KWS_CLASSES),
                             info={"sample_rate": SAMPLE_RATE, "clip_samples": CLIP_SAMPLES}, **common) as w:
                for clip in clips:
                    w.add_audio(clip.key, clip.label, clip_wave(src, clip, noise))
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


def clip_wave(src: Path, clip: Clip, noise: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """The 1 s float32 wave of one planned clip (:func:`fixed_clip`: the one place clips are brought to 1 s)."""
    if clip.rel is not None:
        wave = read_wav(str(src / clip.rel), SAMPLE_RATE, key=str(src / clip.rel))
        if wave.size == 0:
            raise DataError(f"{src / clip.rel} holds no samples: delete it or replace it")
        return fixed_clip(wave)
    if clip.noise < 0:
        return np.zeros(CLIP_SAMPLES, dtype=np.float32)
    cut = noise[clip.noise][1][clip.offset:clip.offset + CLIP_SAMPLES]
    return fixed_clip((cut * clip.volume).astype(np.float32))


def main(argv: list[str] | None = None) -> int:
    """``python data/speech_commands.py``: the options of
    :func:`patchplace.pipelines.datasets.speech_commands_parser`."""
    return run(parse("speech_commands", argv))


def run(args: argparse.Namespace) -> int:
    return run_cli(lambda: build_kws_shards(
        args.src, args.out, version=args.version, silence_percentage=args.silence_percentage,
        unknown_percentage=args.unknown_percentage, seed=args.seed, split_lists=args.split_lists,
        max_count=args.max_count, max_size=args.max_size, dataset=args.dataset))

if __name__ == "__main__":
    sys.exit(main())
