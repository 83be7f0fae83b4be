"""The keyword-spotting recipes: which_set, data/speech_commands.py and data/spoken_keywords.py (CPU)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile

from patchplace.data.errors import DataError
from patchplace.data.kws import KEYWORDS, KWS_CLASSES, SILENCE, UNKNOWN, speaker_id, which_set
from patchplace.data.manifest import Manifest
from patchplace.pipelines.datasets import speech_commands, spoken_keywords

REPO = Path(__file__).resolve().parents[1]


def read_split(split_dir: Path) -> dict[str, tuple[int, np.ndarray, int]]:
    """key -> (label, wave, sample rate), read straight from the tar shards with tarfile."""
    members: dict[str, dict[str, bytes]] = {}
    for shard in sorted(split_dir.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                members.setdefault(key, {})[ext] = tar.extractfile(m).read()
    out = {}
    for key, fields in members.items():
        assert set(fields) == {"wav", "cls"}, key
        wave, rate = soundfile.read(io.BytesIO(fields["wav"]), dtype="float32")
        out[key] = (int(fields["cls"]), wave, rate)
    return out


def check_manifest_matches_tars(manifest: Manifest) -> dict[str, tuple[int, np.ndarray, int]]:
    samples = read_split(manifest.directory)
    tar_members = 0
    for shard in manifest.shards:
        with tarfile.open(manifest.directory / shard.name) as tar:
            n = len(tar.getmembers())
        assert n == 2 * shard.count  # .wav + .cls per sample
        tar_members += n
    assert tar_members == 2 * manifest.num_samples == 2 * len(samples)
    counts = Counter(label for label, _, _ in samples.values())
    assert manifest.class_counts == [counts[i] for i in range(len(manifest.classes))]
    return samples


# ---------------------------------------------------------------------- which_set
def readme_which_set(filename: str) -> str:
    """The Speech Commands README's snippet, written out independently."""
    base = filename.rsplit("/", 1)[-1]
    hash_name = base.split("_nohash_")[0]
    h = int(hashlib.sha1(hash_name.encode()).hexdigest(), 16)
    pct = (h % (2**27 - 1 + 1)) * (100.0 / (2**27 - 1))
    return "validation" if pct < 10 else "testing" if pct < 20 else "training"


def test_which_set_is_stable_and_speaker_consistent():
    rng = random.Random(0)
    names = [f"{rng.randrange(16**8):08x}" for _ in range(4000)]
    for name in names[:200]:
        expected = readme_which_set(f"yes/{name}_nohash_0.wav")
        assert which_set(f"yes/{name}_nohash_0.wav") == expected
        # same speaker, other word / take / directory prefix: same set
        assert which_set(f"/data/sc/marvin/{name}_nohash_4.wav") == expected
        assert which_set(Path("left") / f"{name}_nohash_1.wav") == expected
        assert speaker_id(f"left/{name}_nohash_1.wav") == name
    frac = Counter(which_set(f"go/{n}_nohash_0.wav") for n in names)
    assert 0.08 < frac["validation"] / len(names) < 0.12
    assert 0.08 < frac["testing"] / len(names) < 0.12
    assert which_set("go/ab_nohash_0.wav", validation_percentage=0, testing_percentage=0) == "training"
    assert which_set("go/ab_nohash_0.wav", validation_percentage=100, testing_percentage=0) == "validation"


# ---------------------------------------------------------------------- speech_commands recipe
WORDS = ("yes", "no", "left", "bed", "cat", "marvin")  # three keywords, three unknown words
SPEAKERS = [f"{i:08x}" for i in range(0x1a2b3c00, 0x1a2b3c00 + 10)]
VAL_SPEAKERS, TEST_SPEAKERS = SPEAKERS[:2], SPEAKERS[2:4]


def tone(rate: int, seconds: float, freq: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.fixture()
def sc_folder(tmp_path: Path) -> Path:
    """A tiny Speech Commands layout: 6 words x 10 speakers, some files stereo at 44.1 kHz."""
    src = tmp_path / "sc"
    for w, word in enumerate(WORDS):
        (src / word).mkdir(parents=True)
        for s, spk in enumerate(SPEAKERS):
            path = src / word / f"{spk}_nohash_0.wav"
            if s % 3 == 0:  # stereo, 44.1 kHz, a bit shorter than 1 s: resampled + downmixed, zero-padded
                mono = tone(44100, 0.9, 300 + 50 * w)
                soundfile.write(path, np.stack([mono, mono], 1), 44100, subtype="PCM_16")
            else:
                soundfile.write(path, tone(16000, 1.0, 300 + 50 * w), 16000, subtype="PCM_16")
    (src / "_background_noise_").mkdir()
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 3 * 16000).astype(np.float32)
    soundfile.write(src / "_background_noise_" / "white_noise.wav", noise, 16000, subtype="PCM_16")
    (src / "_background_noise_" / "README.md").write_text("not a wav\n")
    for name, spks in (("validation_list.txt", VAL_SPEAKERS), ("testing_list.txt", TEST_SPEAKERS)):
        (src / name).write_text("".join(f"{w}/{s}_nohash_0.wav\n" for w in WORDS for s in spks))
    return src


def test_speech_commands_recipe(sc_folder: Path, tmp_path: Path, capsys):
    out = tmp_path / "shards"
    assert speech_commands.main(["--src", str(sc_folder), "--out", str(out), "--silence-percentage", "20",
                                 "--unknown-percentage", "50", "--seed", "3", "--max-count", "7"]) == 0
    printed = capsys.readouterr().out
    assert "speech_commands_v1/train" in printed and "background_noise" in printed
    manifests = {s: Manifest.load(out / s) for s in ("train", "validation", "test", "background_noise")}
    expected_speakers = {"train": set(SPEAKERS[4:]), "validation": set(VAL_SPEAKERS),
                         "test": set(TEST_SPEAKERS)}
    for split, speakers in expected_speakers.items():
        m = manifests[split]
        assert m.classes == list(KWS_CLASSES) and m.info == {"sample_rate": 16000, "clip_samples": 16000}
        assert m.dataset == "speech_commands_v1" and m.modality == "audio"
        samples = check_manifest_matches_tars(m)
        n_kw = 3 * len(speakers)
        words = {k.split("__")[0] for k in samples if not k.startswith(SILENCE)}
        for key, (label, wave, rate) in samples.items():
            assert rate == 16000 and wave.ndim == 1
            if key.startswith(SILENCE):
                assert label == KWS_CLASSES.index(SILENCE) and len(wave) == 16000
                assert np.abs(wave).max() <= 0.5 + 1e-3  # a cut of the noise file at volume < 1
                continue
            word, name = key.split("__")
            assert name.split("_nohash_")[0] in speakers  # the list files decide the split
            assert label == (KWS_CLASSES.index(word) if word in KEYWORDS else KWS_CLASSES.index(UNKNOWN))
            spk_index = SPEAKERS.index(name.split("_nohash_")[0])
            assert len(wave) == 16000  # every clip 1 s, as TensorFlow's decode_wav(desired_samples=16000)
            if spk_index % 3 == 0:  # 0.9 s at 44.1 kHz -> 14400 samples at 16 kHz, then zeros to the end
                assert np.abs(wave[:14000]).max() > 0.1 and not wave[14400:].any()
        labels = Counter(label for label, _, _ in samples.values())
        assert sum(labels[KWS_CLASSES.index(k)] for k in ("yes", "no", "left")) == n_kw
        assert labels[KWS_CLASSES.index(UNKNOWN)] == math.ceil(n_kw * 0.5)
        assert labels[KWS_CLASSES.index(SILENCE)] == math.ceil(n_kw * 0.2)
        assert {"yes", "no", "left"} <= words
    assert len(manifests["train"].shards) > 1  # --max-count 7
    bg = manifests["background_noise"]
    assert bg.classes == ["_background_noise_"] and bg.info == {"sample_rate": 16000, "clip_samples": None}
    noise = check_manifest_matches_tars(bg)
    assert list(noise) == ["_background_noise___white_noise"]
    assert len(noise["_background_noise___white_noise"][1]) == 48000  # full file, not cut to 1 s

    # same inputs and seed -> byte-identical shards
    again = speech_commands.build_kws_shards(sc_folder, tmp_path / "again", silence_percentage=20,
                                             unknown_percentage=50, seed=3, max_count=7, progress=False)
    assert [s.sha256 for s in again["train"].shards] == [s.sha256 for s in manifests["train"].shards]


def test_speech_commands_without_lists_uses_which_set(sc_folder: Path, tmp_path: Path):
    for name in ("validation_list.txt", "testing_list.txt"):
        (sc_folder / name).unlink()
    notes = []
    # speaker ids chosen above may not cover every split, so just check the assignment rule
    words = speech_commands.scan_words(sc_folder)
    set_of, rule = speech_commands.assign_sets(sc_folder, words, log=notes.append)
    assert rule.startswith("which_set") and "which_set" in notes[0]
    assert all(set_of[rel] == which_set(rel) for rel in set_of)
    (sc_folder / "testing_list.txt").write_text("")
    with pytest.raises(DataError, match=r"validation_list\.txt"):
        speech_commands.assign_sets(sc_folder, speech_commands.scan_words(sc_folder))


def test_speech_commands_errors(sc_folder: Path, tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=re.escape(str(missing))) as err:
        speech_commands.build_kws_shards(missing, tmp_path / "out", progress=False)
    assert "spoken_keywords.py" in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no word folders"):
        speech_commands.build_kws_shards(empty, tmp_path / "out", progress=False)
    with open(sc_folder / "testing_list.txt", "a") as f:
        f.write("yes/deadbeef_nohash_0.wav\n")
    with pytest.raises(DataError, match=r"testing_list\.txt names yes/deadbeef_nohash_0\.wav.*not exist"):
        speech_commands.build_kws_shards(sc_folder, tmp_path / "out", progress=False)
    with pytest.raises(DataError, match="--version 2"):
        speech_commands.build_kws_shards(sc_folder, tmp_path / "out", version="2", progress=False)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_speech_commands_runs_as_a_script(tmp_path: Path):
    missing = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, str(REPO / "data" / "speech_commands.py"), "--src", str(missing),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"error: --src {missing} is not a directory" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- spoken_keywords (espeak-ng)
needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                  reason="espeak-ng is not installed (apt-get install espeak-ng)")


def test_spoken_keywords_reports_missing_espeak(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(spoken_keywords.shutil, "which", lambda name: None)
    with pytest.raises(DataError, match="espeak-ng not found: apt-get install espeak-ng"):
        spoken_keywords.synthesize_corpus(tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


@needs_espeak
def test_spoken_keywords_end_to_end(tmp_path: Path):
    kwargs = dict(clips_per_keyword=3, clips_per_unknown_word=1, seed=0, jobs=2, noise_seconds=2,
                  progress=False)
    corpus = spoken_keywords.synthesize_corpus(tmp_path / "corpus", **kwargs, log=lambda *_: None)
    assert corpus == tmp_path / "corpus" and not list(tmp_path.glob(".*partial*"))
    words = KEYWORDS + spoken_keywords.UNKNOWN_WORDS
    assert len(words) == 35
    wavs = sorted(str(p.relative_to(corpus)) for p in corpus.glob("*/*_nohash_*.wav"))
    assert Counter(w.split("/")[0] for w in wavs) == {w: 3 if w in KEYWORDS else 1 for w in words}
    for rel in wavs:
        name = rel.split("/")[1]
        assert len(name.split("_nohash_")[0]) == 8 and name.split("_nohash_")[1][:-4].isdigit()
        info = soundfile.info(str(corpus / rel))
        assert (info.samplerate, info.channels, info.frames, info.subtype) == (16000, 1, 16000, "PCM_16")
        wave, _ = soundfile.read(corpus / rel, dtype="float32")
        peak = np.abs(wave).max()
        assert peak > 0.05 and np.sqrt(np.mean(wave**2)) > 1e-3  # real speech, not silence
        # the word lies inside the clip: both borders are (near) silent
        assert np.abs(wave[:8]).max() < 0.05 * peak and np.abs(wave[-8:]).max() < 0.05 * peak
    noise = sorted(p.name for p in (corpus / "_background_noise_").glob("*.wav"))
    assert noise == ["babble.wav", "brown_noise.wav", "pink_noise.wav", "white_noise.wav"]
    for name in noise:
        wave, rate = soundfile.read(corpus / "_background_noise_" / name, dtype="float32")
        assert rate == 16000 and wave.shape == (32000,) and np.sqrt(np.mean(wave**2)) > 0.01
    # list files: exactly which_set's choice, so no speaker spans two sets
    listed = {}
    for set_name, list_name in (("validation", "validation_list.txt"), ("testing", "testing_list.txt")):
        for rel in (corpus / list_name).read_text().split():
            listed[rel] = set_name
    assert listed == {rel: which_set(rel) for rel in wavs if which_set(rel) != "training"}
    meta = json.loads((corpus / "corpus.json").read_text())
    assert meta["num_clips"] == len(wavs) and meta["seed"] == 0 and meta["longest_speech_s"] <= 0.92
    assert (corpus / "README.txt").is_file()

    # same seed -> identical bytes
    again = spoken_keywords.synthesize_corpus(tmp_path / "again", **kwargs, log=lambda *_: None)
    for rel in (wavs[0], wavs[len(wavs) // 2], "_background_noise_/babble.wav"):
        assert (corpus / rel).read_bytes() == (again / rel).read_bytes(), rel

    # and the corpus feeds the Speech Commands recipe
    manifests = speech_commands.build_kws_shards(corpus, tmp_path / "shards", progress=False)
    assert set(manifests) == {"train", "validation", "test", "background_noise"}
    sets = {"train": "training", "validation": "validation", "test": "testing"}
    for split, set_name in sets.items():
        m = manifests[split]
        assert m.dataset == "spoken_keywords" and m.classes == list(KWS_CLASSES)
        samples = check_manifest_matches_tars(m)
        kw = [r for r in wavs if which_set(r) == set_name and r.split("/")[0] in KEYWORDS]
        assert sum(m.class_counts[2:]) == len(kw)
        assert m.class_counts[0] == math.ceil(len(kw) * 0.1)
        for r in kw:
            assert samples[speech_commands.sample_key(r)][0] == KWS_CLASSES.index(r.split("/")[0])
    assert manifests["background_noise"].num_samples == 4


@needs_espeak
def test_spoken_keywords_long_words_are_sped_up_and_failures_leave_nothing(monkeypatch, tmp_path: Path):
    exe = spoken_keywords.find_espeak()
    slow = spoken_keywords.Utterance(text="visual", voice="de", variant="Alicia", speed=80, pitch=50)
    speech, retries = spoken_keywords.speak(exe, slow, max_seconds=0.4)
    assert retries > 0 and 0.1 * 16000 < speech.size <= 0.4 * 16000

    calls = []

    def flaky(exe, utt, root):
        calls.append(utt)
        if len(calls) == 5:
            raise DataError("simulated failure")
        return {"speech_s": 0.5, "retries": 0}

    monkeypatch.setattr(spoken_keywords, "render_clip", flaky)
    with pytest.raises(DataError, match="simulated"):
        spoken_keywords.synthesize_corpus(tmp_path / "c", clips_per_keyword=2, clips_per_unknown_word=0,
                                          jobs=1, noise_seconds=2, progress=False, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []  # no corpus, no temp dir


# ---------------------------------------------------------------------- TC-ResNet's fixed lists
def tc_resnet_lists(folder: Path, src: Path) -> dict[str, list[str]]:
    """TC-ResNet-format train.txt / valid.txt / test.txt over ``src``: every file of a set's speakers, some
    ``_silence_/...`` placeholder lines, shuffled; returns the non-silence lines by set."""
    rng = random.Random(1)
    sets = {"train.txt": SPEAKERS[4:], "valid.txt": VAL_SPEAKERS, "test.txt": TEST_SPEAKERS}
    named = {}
    folder.mkdir()
    for name, speakers in sets.items():
        rels = [f"{w}/{s}_nohash_0.wav" for w in WORDS for s in speakers]
        lines = rels + ["_silence_/721f767c_nohash_2.wav"] * (len(speakers) + 1)
        rng.shuffle(lines)
        (folder / name).write_text("".join(f"{line}\n" for line in lines))
        named[name] = rels
    return named


def test_speech_commands_split_lists_are_used_exactly(sc_folder: Path, tmp_path: Path):
    named = tc_resnet_lists(tmp_path / "lists", sc_folder)
    # the Speech Commands list files and the percentages play no part once the fixed lists are given
    (sc_folder / "validation_list.txt").unlink()
    (sc_folder / "testing_list.txt").write_text("")
    manifests = speech_commands.build_kws_shards(sc_folder, tmp_path / "out", split_lists=tmp_path / "lists",
                                                 silence_percentage=50, unknown_percentage=0, progress=False)
    for split, name, speakers in (("train", "train.txt", SPEAKERS[4:]), ("validation", "valid.txt", VAL_SPEAKERS),
                                  ("test", "test.txt", TEST_SPEAKERS)):
        samples = check_manifest_matches_tars(manifests[split])
        silence = {k: v for k, v in samples.items() if k.startswith(SILENCE)}
        assert len(silence) == len(speakers) + 1, "one _silence_ clip per _silence_ line"
        assert all(label == KWS_CLASSES.index(SILENCE) and len(w) == 16000 and not w.any()
                   for label, w, _ in silence.values()), "TC-ResNet's silence: an all-zero clip"
        words = {k: v for k, v in samples.items() if not k.startswith(SILENCE)}
        assert set(words) == {speech_commands.sample_key(rel) for rel in named[name]}, "exactly the listed files"
        for key, (label, wave, _) in words.items():
            word = key.split("__")[0]
            assert label == KWS_CLASSES.index(word if word in KEYWORDS else UNKNOWN) and len(wave) == 16000
        assert "fixed lists" in manifests[split].source
    (tmp_path / "lists" / "test.txt").write_text("yes/00000000_nohash_9.wav\n")
    with pytest.raises(DataError, match=r"test\.txt:1 names yes/00000000_nohash_9\.wav"):
        speech_commands.build_kws_shards(sc_folder, tmp_path / "bad", split_lists=tmp_path / "lists", progress=False)
    (tmp_path / "lists" / "test.txt").write_text(f"{named['train.txt'][0]}\n")
    with pytest.raises(DataError, match=r"already named by train\.txt"):
        speech_commands.build_kws_shards(sc_folder, tmp_path / "bad", split_lists=tmp_path / "lists", progress=False)
    (tmp_path / "lists" / "test.txt").unlink()
    with pytest.raises(DataError, match=r"has no test\.txt"):
        speech_commands.build_kws_shards(sc_folder, tmp_path / "bad", split_lists=tmp_path / "lists", progress=False)
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------- rehearsal: the layout as it ships
SHIPPED = REPO / "pipelines" / "configs"


def speech_commands_corpus(src: Path) -> None:
    """Speech Commands v1 as it ships, in miniature: the ten keywords and three auxiliary words, six speakers,
    16 kHz mono PCM16 clips of 0.4-1 s (a third shorter than 1 s, as in the real corpus), two long
    ``_background_noise_`` wavs, validation_list.txt / testing_list.txt naming two speakers each."""
    rng = np.random.default_rng(7)
    words = [*KEYWORDS, "bed", "cat", "marvin"]
    speakers = [f"{n:08x}" for n in (0x0a7c2a8d, 0x1b4c9e21, 0x2f0e5d43, 0x3c9a1f65, 0x4d2b8a87, 0x5e6f7c09)]
    for w, word in enumerate(words):
        (src / word).mkdir(parents=True)
        for s, spk in enumerate(speakers):
            for take in range(2):
                seconds = 1.0 if (s + take) % 3 else float(rng.uniform(0.4, 0.95))
                t = np.arange(int(16000 * seconds)) / 16000
                wave = 0.3 * np.sin(2 * np.pi * (200 + 90 * w) * t) * np.hanning(len(t))
                wave += 0.01 * rng.standard_normal(len(t))
                soundfile.write(src / word / f"{spk}_nohash_{take}.wav", wave.astype(np.float32), 16000,
                                subtype="PCM_16")
    (src / "_background_noise_").mkdir()
    for name, seconds in (("white_noise.wav", 6.0), ("running_tap.wav", 4.5)):
        soundfile.write(src / "_background_noise_" / name,
                        (0.2 * rng.standard_normal(int(16000 * seconds))).clip(-1, 1).astype(np.float32), 16000,
                        subtype="PCM_16")
    (src / "_background_noise_" / "README.md").write_text("the noise files\n")
    for name, spks in (("validation_list.txt", speakers[:2]), ("testing_list.txt", speakers[2:4])):
        (src / name).write_text("".join(f"{w}/{s}_nohash_{k}.wav\n" for w in words for s in spks for k in (0, 1)))
    (src / "LICENSE").write_text("CC BY 4.0\n")


def test_the_shipped_speech_configs_run_on_speech_commands_as_it_ships(tmp_path: Path, monkeypatch, capsys):
    """data/speech_commands.py with its defaults, then speech_commands_mp3_pretrain.yaml / _finetune.yaml with
    their own data paths, a few steps each: short clips padded at write, every split held in memory."""
    from patchplace.data.memory import InMemorySplit
    from patchplace.pipelines import finetune, pretrain

    src = tmp_path / "speech_commands_v0.01"
    speech_commands_corpus(src)
    monkeypatch.chdir(tmp_path)  # the configs' data paths are relative: shards/speech_commands/...
    assert subprocess.run([sys.executable, str(REPO / "data" / "speech_commands.py"), "--src", str(src)],
                          capture_output=True, text=True).returncode == 0
    shards = tmp_path / "shards" / "speech_commands"
    assert {p.name for p in shards.iterdir()} == {"train", "validation", "test", "background_noise"}
    for split in ("train", "validation", "test"):
        held = InMemorySplit.load(shards / split)
        assert held.inputs.shape[1:] == (16000,), "every clip 1 s: the in-memory path takes the split"
        assert Manifest.load(shards / split).recipe_version == speech_commands.RECIPE_VERSION
    quick = ["data.batch_size=8", "data.num_workers=0", "run.tensorboard=false", "run.log_every=1",
             "optim.warmup_steps=1", "run.checkpoint_every=2"]
    capsys.readouterr()
    assert pretrain.main(["--config", str(SHIPPED / "speech_commands_mp3_pretrain.yaml"), *quick,
                          "optim.max_steps=2", "model.overrides={depth: 2}", "run.output=runs/pt"]) == 0
    printed = capsys.readouterr().out
    assert "data.train: in memory" in printed and "data.val: in memory" in printed, printed
    assert finetune.main(["--config", str(SHIPPED / "speech_commands_mp3_finetune.yaml"), *quick,
                          "optim.max_steps=2", "run.eval_every=2", "model.checkpoint=runs/pt/checkpoint",
                          "run.output=runs/ft"]) == 0
    printed = capsys.readouterr().out
    assert "data.train: in memory" in printed and "data.val: in memory" in printed, printed
    assert (tmp_path / "runs" / "ft" / "checkpoint" / "config.json").is_file()
    # the export takes the front end the checkpoint recorded (mp3_speech: 100 frames of a 1 s clip) into its graph
    from patchplace.export.__main__ import main as export_main

    assert export_main(["runs/ft/checkpoint", "--out", "runs/kws.onnx", "--no-optimize", "--samples", "8"]) == 0
    sidecar = json.loads((tmp_path / "runs" / "kws.json").read_text())
    assert sidecar["inputs"][0]["shape"] == ["batch", 16000], sidecar["inputs"]
