#!/usr/bin/env python
"""Synthesize a Speech-Commands-layout keyword corpus with espeak-ng (offline, deterministic given the seed).

    python data/spoken_keywords.py --out corpora/spoken_keywords
    python data/speech_commands.py --src corpora/spoken_keywords --out shards/spoken_keywords

Layout (as Speech Commands v2): ``<word>/<speakerhash>_nohash_<n>.wav`` (1 s, 16 kHz, mono, 16-bit PCM)
for the 10 keywords and the 25 auxiliary ("unknown") words, ``_background_noise_/`` with white, pink, brown
and babble noise, ``validation_list.txt`` / ``testing_list.txt`` from ``which_set`` (so a speaker never
spans splits), and ``corpus.json`` + ``README.txt`` describing how it was made.

A "speaker" is an espeak-ng voice x variant pair (English accents, plus a few other languages' voices
reading the English words for foreign accents, crossed with variants such as m1..m8, f1..f5, croak, klatt,
whisper); its hash is 8 hex chars of sha1("voice+variant"). Every clip also gets a random speed (-s),
pitch (-p), gain and onset. espeak's 22050 Hz output is trimmed to the speech, resampled to 16 kHz and
placed inside the 1 s clip, so the word is never cut at the border.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile
from tqdm import tqdm

from patchplace.data.atomic import atomic_dir
from patchplace.data.codecs import resample
from patchplace.data.errors import DataError
from patchplace.data.kws import (
    AUXILIARY_WORDS_V1,
    AUXILIARY_WORDS_V2_ONLY,
    BACKGROUND_NOISE_DIR,
    KEYWORDS,
    SPLITS,
    speaker_id,
    which_set,
)
from patchplace.pipelines.datasets import parse

RECIPE = "spoken_keywords"
RECIPE_VERSION = 1
ESPEAK = "espeak-ng"
SAMPLE_RATE = 16000
CLIP_SAMPLES = SAMPLE_RATE
UNKNOWN_WORDS = AUXILIARY_WORDS_V1 + AUXILIARY_WORDS_V2_ONLY

ENGLISH_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-gb-x-rp",
                  "en-029", "en-us-nyc")
# Other languages' voices read the English spelling with their own letter-to-sound rules: foreign accents.
# Left out: es and vi spell some words letter by letter ("two" -> "t, u, doble o"), sv changes vowels
# beyond recognition (go -> "gu:"), and voices for non-Latin scripts (hi, ru, el, ...) switch to English.
ACCENT_VOICES = ("de", "fr", "it", "nl", "pl", "pt")
VOICES = ENGLISH_VOICES + ACCENT_VOICES
# espeak-ng variants (`espeak-ng --voices=variant`); mbrola voices are not used (not installed).
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f4", "f5", "croak",
            "klatt", "klatt2", "klatt3", "klatt4", "whisper", "whisperf", "grandma", "grandpa", "Alicia",
            "Andy", "anika", "Annie", "belinda", "david", "edward", "linda", "Mike", "paul", "quincy",
            "robert", "steph", "Storm", "victor")

# Speaking rate in words per minute (espeak default 175). Measured at the slowest rate, 120 wpm, over all
# 14 voices x 37 variants x 35 words: trimmed utterances last 0.53 s (median), 0.89 s (99th percentile),
# 1.33 s at most (de+Alicia "visual"); 0.6% exceed MAX_SPEECH_S. Such an utterance is re-synthesized
# faster (speed_retries in corpus.json counts them), so the word always fits inside the 1 s clip.
SPEED_WPM = (120, 210)
PITCH = (20, 80)  # espeak -p, 0..99, default 50
PEAK_DBFS = (-24.0, -1.0)  # per-clip gain: the clip's peak level
MAX_SPEECH_S = 0.92
TRIM_THRESHOLD = 0.01  # samples below 1% of the utterance's peak (-40 dB) count as silence
TRIM_MARGIN_S = 0.005
NOISE_SECONDS = (30, 60)
NOISE_RMS = {"white_noise": 0.1, "pink_noise": 0.1, "brown_noise": 0.1, "babble": 0.05}
BABBLE_STREAMS = 8
BABBLE_SPEED_WPM = (150, 200)
# Babble text: everyday words that are none of the 35 corpus words.
FILLER_WORDS = (
    "the", "a", "we", "should", "meet", "after", "lunch", "weather", "is", "really", "nice", "today", "maybe",
    "later", "coffee", "morning", "people", "think", "about", "that", "this", "there", "could", "would",
    "because", "never", "always", "little", "water", "table", "window", "music", "number", "evening", "train",
    "station", "garden", "market", "yesterday", "tomorrow", "friend", "brother", "sister", "teacher", "paper",
    "letter", "kitchen", "dinner", "bread", "apple", "orange", "summer", "winter", "holiday", "city", "river",
    "mountain", "story", "question", "answer", "minute", "hour", "week", "year", "somebody", "nothing",
)


@dataclass(frozen=True)
class Utterance:
    """One espeak-ng call: what to say, who says it, and the random draws applied to it."""

    text: str
    voice: str
    variant: str
    speed: int
    pitch: int
    peak_dbfs: float = -6.0
    onset_frac: float = 0.0
    rel: str = ""  # output path relative to the corpus (clips only)


def speaker_hash(voice: str, variant: str) -> str:
    return hashlib.sha1(f"{voice}+{variant}".encode()).hexdigest()[:8]


# ---------------------------------------------------------------------- espeak-ng
def find_espeak() -> str:
    exe = shutil.which(ESPEAK)
    if exe is None:
        raise DataError("espeak-ng not found: apt-get install espeak-ng")
    return exe


def espeak(exe: str, text: str, voice: str, variant: str, speed: int, pitch: int) -> tuple[np.ndarray, int]:
    """Raw espeak-ng output as float32 mono and its sample rate (22050 Hz)."""
    cmd = [exe, "--stdout", "-v", f"{voice}+{variant}", "-s", str(speed), "-p", str(pitch), text]
    proc = subprocess.run(cmd, capture_output=True, check=False)
    if proc.returncode != 0 or not proc.stdout:
        raise DataError(f"espeak-ng failed for voice {voice}+{variant}, text {text!r}: "
                        f"{proc.stderr.decode(errors='replace').strip() or f'exit code {proc.returncode}'}")
    wave, rate = soundfile.read(io.BytesIO(proc.stdout), dtype="float32", always_2d=True)
    return wave.mean(axis=1), rate


def available(exe: str, voices: tuple[str, ...], variants: tuple[str, ...], log=print):
    """The voices and variants this espeak-ng has (it silently ignores an unknown variant, so check here)."""
    listing = subprocess.run([exe, "--voices=variant"], capture_output=True, text=True, check=False).stdout
    have = {tok[3:] for line in listing.splitlines() for tok in line.split() if tok.startswith("!v/")}
    ok_variants = tuple(v for v in variants if v in have)
    ok_voices = tuple(v for v in voices
                      if subprocess.run([exe, "-q", "-v", v, "yes"], capture_output=True).returncode == 0)
    missing = sorted(set(voices) - set(ok_voices)) + sorted(set(variants) - set(ok_variants))
    if missing:
        log(f"note: this espeak-ng lacks {missing}: synthesizing without them (recorded in corpus.json)")
    if not ok_voices or not ok_variants:
        raise DataError(f"espeak-ng at {exe} has none of the voices {voices} or none of the variants: "
                        "reinstall espeak-ng-data")
    return ok_voices, ok_variants


def trim(wave: np.ndarray, rate: int) -> np.ndarray:
    """Cut espeak's leading and trailing silence (it appends ~0.5 s of pause after the utterance)."""
    loud = np.nonzero(np.abs(wave) > TRIM_THRESHOLD * np.abs(wave).max())[0]
    if loud.size == 0:
        return wave[:0]
    margin = int(TRIM_MARGIN_S * rate)
    return wave[max(0, loud[0] - margin):loud[-1] + 1 + margin]


def speak(exe: str, utt: Utterance, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """(trimmed speech at 16 kHz, retries): re-synthesized faster while longer than ``max_seconds``."""
    speed = utt.speed
    for retries in range(6):
        raw, rate = espeak(exe, utt.text, utt.voice, utt.variant, speed, utt.pitch)
        speech = resample(trim(raw, rate), rate, SAMPLE_RATE)
        if speech.size == 0 or np.abs(speech).max() < 1e-3:
            raise DataError(f"espeak-ng voice {utt.voice}+{utt.variant} produced silence for {utt.text!r}: "
                            "drop that voice or variant")
        if max_seconds is None or speech.size <= max_seconds * SAMPLE_RATE:
            return speech.astype(np.float32), retries
        speed = min(450, math.ceil(speed * speech.size / (0.95 * max_seconds * SAMPLE_RATE)))
    raise DataError(f"{utt.text!r} by {utt.voice}+{utt.variant} stays longer than {max_seconds} s even at "
                    f"{speed} wpm: drop that voice or variant")


def render_clip(exe: str, utt: Utterance, root: Path) -> dict:
    """Synthesize one clip and write it as ``root / utt.rel``; returns facts for corpus.json."""
    speech, retries = speak(exe, utt, MAX_SPEECH_S)
    speech *= 10 ** (utt.peak_dbfs / 20) / np.abs(speech).max()
    onset = int(utt.onset_frac * (CLIP_SAMPLES - speech.size + 1))
    clip = np.zeros(CLIP_SAMPLES, np.float32)
    clip[onset:onset + speech.size] = speech  # speech.size <= MAX_SPEECH_S * rate: never cut at the border
    soundfile.write(root / utt.rel, clip, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return {"speech_s": speech.size / SAMPLE_RATE, "retries": retries}


# ---------------------------------------------------------------------- noise
def colored_noise(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """Gaussian noise with power ~ 1 / f**exponent (0 white, 1 pink, 2 brown), nothing below 20 Hz."""
    white = rng.standard_normal(n)
    if exponent == 0:
        return white
    spectrum = np.fft.rfft(white)
    f = np.fft.rfftfreq(n, 1 / SAMPLE_RATE)
    spectrum *= np.where(f >= 20, np.maximum(f, 1e-9) ** (-exponent / 2), 0.0)
    return np.fft.irfft(spectrum, n)


def to_rms(wave: np.ndarray, rms: float) -> np.ndarray:
    wave = wave * (rms / max(float(np.sqrt(np.mean(wave**2))), 1e-12))
    return np.clip(wave, -0.99, 0.99).astype(np.float32)


def mix_babble(rng: np.random.Generator, n: int, utterances: list[np.ndarray]) -> np.ndarray:
    """Overlap BABBLE_STREAMS talkers; each stream is its utterances with short pauses, looped to ``n``."""
    per = len(utterances) // BABBLE_STREAMS
    out = np.zeros(n)
    for s in range(BABBLE_STREAMS):
        parts = []
        for speech in utterances[s * per:(s + 1) * per]:
            parts.append(speech * 10 ** (rng.uniform(-12, 0) / 20))
            parts.append(np.zeros(int(rng.uniform(0.1, 0.6) * SAMPLE_RATE)))
        stream = np.resize(np.concatenate(parts), n)  # loops the stream when it is short
        out += np.roll(stream, int(rng.integers(n)))
    return out


# ---------------------------------------------------------------------- planning
def plan(seed: int, clips_per_keyword: int, clips_per_unknown_word: int, noise_seconds: float | None,
         voices: tuple[str, ...], variants: tuple[str, ...]):
    """All random draws, made up front in one fixed order so the corpus does not depend on thread timing."""
    speakers = [(v, var) for v in voices for var in variants]
    hashes = [speaker_hash(*sp) for sp in speakers]
    if len(set(hashes)) != len(hashes):
        raise DataError("two espeak-ng speakers share a speaker hash: rename a voice or variant")
    rng = np.random.default_rng([seed, 0])
    clips: list[Utterance] = []
    for word in KEYWORDS + UNKNOWN_WORDS:
        taken: Counter[str] = Counter()
        for _ in range(clips_per_keyword if word in KEYWORDS else clips_per_unknown_word):
            k = int(rng.integers(len(speakers)))
            n = taken[hashes[k]]
            taken[hashes[k]] += 1
            clips.append(Utterance(
                text=word, voice=speakers[k][0], variant=speakers[k][1],
                speed=int(rng.integers(SPEED_WPM[0], SPEED_WPM[1] + 1)),
                pitch=int(rng.integers(PITCH[0], PITCH[1] + 1)),
                peak_dbfs=round(float(rng.uniform(*PEAK_DBFS)), 3), onset_frac=float(rng.uniform()),
                rel=f"{word}/{hashes[k]}_nohash_{n}.wav"))
    nrng = np.random.default_rng([seed, 1])
    seconds = {name: float(noise_seconds) if noise_seconds is not None
               else float(nrng.integers(NOISE_SECONDS[0], NOISE_SECONDS[1] + 1)) for name in NOISE_RMS}
    # Enough sentences (~3 s each) for every babble stream to fill the file once.
    per_stream = max(1, math.ceil(seconds["babble"] / 3.0))
    babble = []
    for _ in range(BABBLE_STREAMS * per_stream):
        k = int(nrng.integers(len(speakers)))
        words = nrng.choice(len(FILLER_WORDS), size=int(nrng.integers(5, 11)))
        babble.append(Utterance(text=" ".join(FILLER_WORDS[i] for i in words), voice=speakers[k][0],
                                variant=speakers[k][1],
                                speed=int(nrng.integers(BABBLE_SPEED_WPM[0], BABBLE_SPEED_WPM[1] + 1)),
                                pitch=int(nrng.integers(PITCH[0], PITCH[1] + 1))))
    return speakers, clips, seconds, babble


# ---------------------------------------------------------------------- the corpus
def synthesize_corpus(out: str | Path, clips_per_keyword: int = 200, clips_per_unknown_word: int = 30,
                      seed: int = 0, jobs: int | None = None, noise_seconds: float | None = None,
                      progress: bool = True, log=print) -> Path:
    """Write the corpus to ``out`` atomically (built in a temp sibling, renamed when complete).

    ``noise_seconds`` fixes every noise file's length (default: each drawn from 30-60 s).
    """
    jobs = check_corpus_args(clips_per_keyword, clips_per_unknown_word, noise_seconds, jobs)
    exe = find_espeak()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    version = version.split("  Data at")[0].strip()  # drop the data path: same corpus on every machine
    voices, variants = available(exe, VOICES, VARIANTS, log=log)
    speakers, clips, seconds, babble_plan = plan(seed, clips_per_keyword, clips_per_unknown_word,
                                                 noise_seconds, voices, variants)
    out = Path(out)
    start = time.perf_counter()
    with atomic_dir(out) as tmp:
        for word in KEYWORDS + UNKNOWN_WORDS:
            if any(c.text == word for c in clips):
                (tmp / word).mkdir()
        facts, babble = render_all(exe, clips, babble_plan, tmp, jobs,
                                   tqdm(total=len(clips) + len(babble_plan), desc=f"espeak-ng -> {out}", unit="utt",
                                        disable=not progress))
        write_noise(tmp / BACKGROUND_NOISE_DIR, seed, seconds, babble)
        rels = sorted(c.rel for c in clips)
        sets = {rel: which_set(rel) for rel in rels}
        for set_name, list_name in (("validation", "validation_list.txt"), ("testing", "testing_list.txt")):
            (tmp / list_name).write_text("".join(f"{r}\n" for r in rels if sets[r] == set_name))
        meta = {
            "recipe": RECIPE, "recipe_version": RECIPE_VERSION, "seed": seed,
            "clips_per_keyword": clips_per_keyword, "clips_per_unknown_word": clips_per_unknown_word,
            "espeak_ng": version, "sample_rate": SAMPLE_RATE, "clip_samples": CLIP_SAMPLES,
            "keywords": list(KEYWORDS), "unknown_words": list(UNKNOWN_WORDS),
            "voices": list(voices), "variants": list(variants), "num_speakers": len(speakers),
            "speed_wpm": list(SPEED_WPM), "pitch": list(PITCH), "peak_dbfs": list(PEAK_DBFS),
            "max_speech_s": MAX_SPEECH_S, "longest_speech_s": round(max(f["speech_s"] for f in facts), 4),
            "speed_retries": sum(f["retries"] > 0 for f in facts),
            "num_clips": len(clips), "counts": dict(Counter(c.text for c in clips)),
            "splits": {s: sum(v == s for v in sets.values()) for s in SPLITS},
            "speakers_per_split": {s: len({speaker_id(r) for r in rels if sets[r] == s}) for s in SPLITS},
            "background_noise": {f"{name}.wav": {"seconds": seconds[name], "rms": rms}
                                 for name, rms in NOISE_RMS.items()},
        }
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "README.txt").write_text(readme(meta))
    log(f"wrote {len(clips)} clips from {len(speakers)} speakers + {len(NOISE_RMS)} noise files to {out} "
        f"in {time.perf_counter() - start:.1f} s ({meta['splits']})")
    return out


def check_corpus_args(clips_per_keyword: int, clips_per_unknown_word: int, noise_seconds: float | None,
                      jobs: int | None) -> int:
    """The corpus's sizes and the worker count (default: the CPUs), refused in one line; returns the workers."""
    if clips_per_keyword < 1 or clips_per_unknown_word < 0:
        raise DataError(f"--clips-per-keyword must be >= 1 and --clips-per-unknown-word >= 0, "
                        f"got {clips_per_keyword}, {clips_per_unknown_word}")
    if noise_seconds is not None and noise_seconds < 1:
        raise DataError(f"noise_seconds must be >= 1 (silence clips are 1 s cuts), got {noise_seconds}")
    jobs = jobs or os.cpu_count() or 1
    if jobs < 1:
        raise DataError(f"--jobs must be >= 1, got {jobs}")
    return jobs


def render_all(exe: str, clips: list[Utterance], babble_plan: list[Utterance], tmp: Path, jobs: int,
               bar: tqdm) -> tuple[list[dict], list[np.ndarray]]:
    """Every clip rendered into ``tmp`` and every babble utterance spoken (peak-normalized), on ``jobs`` threads:
    (the clips' facts, the babble waveforms), both in plan order."""
    with ThreadPoolExecutor(jobs) as pool, bar:
        def clip_job(utt: Utterance) -> dict:
            facts = render_clip(exe, utt, tmp)
            bar.update()
            return facts

        def babble_job(utt: Utterance) -> np.ndarray:
            speech = speak(exe, utt)[0]
            bar.update()
            return speech / np.abs(speech).max()

        try:
            return list(pool.map(clip_job, clips)), list(pool.map(babble_job, babble_plan))
        except BaseException:
            pool.shutdown(cancel_futures=True)  # do not finish thousands of queued calls after an error
            raise


def write_noise(noise_dir: Path, seed: int, seconds: dict[str, float], babble: list[np.ndarray]) -> None:
    """The background-noise files: white / pink / brown noise and babble mixed from the spoken utterances, each at
    its RMS (16-bit PCM)."""
    noise_dir.mkdir()
    for i, (name, rms) in enumerate(NOISE_RMS.items()):
        rng = np.random.default_rng([seed, 2, i])
        n = int(seconds[name] * SAMPLE_RATE)
        wave = (mix_babble(rng, n, babble) if name == "babble"
                else colored_noise(rng, n, {"white_noise": 0, "pink_noise": 1, "brown_noise": 2}[name]))
        soundfile.write(noise_dir / f"{name}.wav", to_rms(wave, rms), SAMPLE_RATE, subtype="PCM_16")


def readme(meta: dict) -> str:
    (s0, s1), (p0, p1), (g0, g1) = meta["speed_wpm"], meta["pitch"], meta["peak_dbfs"]
    return f"""Spoken keywords: a synthetic corpus in the Speech Commands layout
(made by patchplace's data/spoken_keywords.py)

Made with {meta['espeak_ng']} -- seed {meta['seed']}, {meta['clips_per_keyword']} clips per keyword,
{meta['clips_per_unknown_word']} per unknown word; the same command and seed give identical wav files.

<word>/<speakerhash>_nohash_<n>.wav  1 s, 16 kHz, mono, 16-bit PCM; {meta['num_clips']} clips.
  keywords: {' '.join(meta['keywords'])}
  unknown words: {' '.join(meta['unknown_words'])}
  speaker = espeak-ng voice x variant ({meta['num_speakers']}); speakerhash = sha1("voice+variant")[:8]
  voices: {' '.join(meta['voices'])}
  variants: {' '.join(meta['variants'])}
  per clip: speed {s0}-{s1} wpm, pitch {p0}-{p1}, peak {g0} to {g1} dBFS, random onset;
  the trimmed word (<= {meta['max_speech_s']} s) always lies fully inside the clip.
{BACKGROUND_NOISE_DIR}/  {', '.join(meta['background_noise'])} (16 kHz; babble = {BABBLE_STREAMS} overlapping
  espeak-ng talkers saying filler sentences)
validation_list.txt, testing_list.txt  by the Speech Commands hashing rule on the speaker hash (10% / 10%):
  {meta['splits']}
corpus.json  every parameter and count above, machine-readable.

Shards: python data/speech_commands.py --src <this folder> --out shards/spoken_keywords
"""


def main(argv: list[str] | None = None) -> int:
    """``python data/spoken_keywords.py``: the options of
    :func:`patchplace.pipelines.datasets.spoken_keywords_parser`."""
    return run(parse("spoken_keywords", argv))


def run(args: argparse.Namespace) -> int:
    try:
        synthesize_corpus(args.out, clips_per_keyword=args.clips_per_keyword,
                          clips_per_unknown_word=args.clips_per_unknown_word, seed=args.seed, jobs=args.jobs,
                          noise_seconds=args.noise_seconds)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
