"""Light where it can be: the audio stack (librosa, scipy, soundfile: patchplace-data[audio]), the corruption stack
(imagecorruptions, scikit-image: patchplace-export[corruptions]) and the privacy metrics (scikit-image:
patchplace-finetune[privacy]) are extras, imported where used; an image-only export installs and imports none of
them, and a missing extra is one line naming the pip command (docs/design.md#packaging)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"patchplace-data": "packages/data", "patchplace-models": "packages/models",
         "patchplace-objectives": "packages/objectives", "patchplace-finetune": "packages/finetune",
         "patchplace-export": "export", "patchplace-pipelines": "pipelines", "patchplace-research": "research"}
# what an image-only export must not bring: the audio stack (librosa brings numba and scikit-learn) and the
# corruption one (imagecorruptions brings opencv and scikit-image); tests/test_install.py checks that what pip resolves
# for the README's `./export[cpu]` holds none of them, transitively
HEAVY = {"librosa", "numba", "scikit-learn", "soundfile", "soxr", "imagecorruptions", "scikit-image", "opencv-python",
         "opencv-python-headless"}
# their import names, for the runtime checks
HEAVY_MODULES = ("librosa", "numba", "sklearn", "soundfile", "soxr", "imagecorruptions", "skimage", "cv2")


def parse(requirement: str) -> tuple[str, set[str]]:
    """(normalized name, extras) of a requirement, a sibling's hatch context-formatted one included."""
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", requirement)
    assert match, requirement
    name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
    return name, {e.strip() for e in (match.group(2) or "").split(",") if e.strip()}


def closure(requirement: str, seen: set[tuple[str, str]] | None = None) -> set[str]:
    """The third-party distributions the repository's pyproject files declare for ``requirement`` (a local package
    with extras, e.g. ``patchplace-export[cpu]``), following local packages and the extras they choose."""
    seen = set() if seen is None else seen
    name, extras = parse(requirement)
    if name not in LOCAL:
        return {name}
    project = tomllib.loads((ROOT / LOCAL[name] / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    found: set[str] = set()
    for group in ["", *sorted(extras)]:
        if (name, group) in seen:
            continue
        seen.add((name, group))
        assert not group or group in optional, f"{name} has no extra [{group}]"
        for dep in project["dependencies"] if not group else optional[group]:
            found |= closure(dep, seen)
    return found


def test_an_image_only_export_declares_neither_stack():
    assert not closure("patchplace-export[cpu]") & HEAVY
    assert not closure("patchplace-export[gpu]") & HEAVY
    for library in ("patchplace-data", "patchplace-models", "patchplace-objectives", "patchplace-finetune"):
        assert not closure(library) & HEAVY, library


def test_the_extras_bring_their_stacks_and_the_pipelines_every_one():
    assert {"librosa", "scipy", "soundfile"} <= closure("patchplace-data[audio]")
    assert {"imagecorruptions", "scikit-image", "setuptools"} <= closure("patchplace-export[corruptions]")
    assert "librosa" in closure("patchplace-export[audio]")
    assert "scikit-image" in closure("patchplace-finetune[privacy]")
    every = {"librosa", "soundfile", "imagecorruptions", "scikit-image"}
    assert every <= closure("patchplace-pipelines") and every <= closure("patchplace-research")
    for package, extras in {"patchplace-data": "audio", "patchplace-finetune": "privacy",
                            "patchplace-export": "corruptions,audio"}.items():  # each suite tests its extras
        assert closure(f"{package}[{extras}]") <= closure(f"{package}[test]"), package


def test_the_closure_walker_sees_what_it_should():
    # the base of patchplace-data, then with the extra: the walker follows extras, not only dependencies
    assert "webdataset" in closure("patchplace-data") and "librosa" not in closure("patchplace-data")
    assert "onnxruntime" in closure("patchplace-export[cpu]") and "onnxruntime-gpu" in closure("patchplace-export[gpu]")
    assert {"timm", "torch"} <= closure("patchplace-objectives")


BLOCKER = """
import importlib.abc, importlib.machinery, sys
BLOCKED, TRIED = set(sys.argv[1].split(",")), []

class Blocker(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # an environment without these packages: importing one fails as a missing package does. A spec without an
    # origin, not an error, for lookups that only probe (torch's dynamo asks importlib.util.find_spec for sklearn)
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] in BLOCKED else None

    def create_module(self, spec):
        TRIED.append(spec.name)
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("create_module raised")

sys.meta_path.insert(0, Blocker())
"""


def run_blocked(blocked: tuple[str, ...], body: str, tmp_path: Path) -> dict:
    """``body`` in a fresh interpreter where ``blocked`` cannot be imported; it prints one JSON line last."""
    script = tmp_path / "probe.py"
    script.write_text(BLOCKER + textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(script), ",".join(blocked), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_image_model_exports_and_evaluates_without_either_stack(tmp_path):
    """The export entry point's modules import, a tiny image classifier exports and its ONNX Runtime evaluation
    (robustness left out) runs, in an interpreter where none of the heavy packages can be imported; nothing even
    tries to import them. The default evaluation, which would add robustness, keeps what it computed and says in
    one line which part was skipped and the pip command that brings it (exit 0); ``--require robustness`` makes
    that skip exit 2, the results still written."""
    seen = run_blocked(HEAVY_MODULES, """
        import contextlib, io, json
        from pathlib import Path
        import numpy as np, torch
        import patchplace.data, patchplace.finetune
        from patchplace.data import SplitWriter
        from patchplace.export.__main__ import main as export_main
        from patchplace.export.evaluate import main as evaluate_main
        from patchplace.models import create_model, save_pretrained

        out = Path(sys.argv[2])
        with SplitWriter(out / "shards", "test", dataset="toy", modality="image", classes=["a", "b"],
                         info={"image_size": [32, 32], "channels": 1}, source="t", recipe="t", recipe_version=1) as w:
            for i in range(8):
                w.add_image(f"{i:03d}", i % 2, np.full((32, 32), 30 * i, dtype=np.uint8))
        torch.manual_seed(0)
        model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=2).eval()
        save_pretrained(model, out / "ckpt", metadata={"classes": ["a", "b"], "pad_to": 32,
                                                       "normalization": {"mean": [0.5], "std": [0.25]}})
        quiet = contextlib.redirect_stdout(io.StringIO())
        with quiet:
            exported = export_main([str(out / "ckpt"), "--out", str(out / "m.onnx")])
        args = [str(out / "m.onnx"), "--data", str(out / "shards" / "test"), "--out", str(out / "eval"),
                "--consistency-limit", "0", "--latency-repeats", "0"]
        err = io.StringIO()
        with quiet:
            light = evaluate_main([*args, "--robustness-limit", "0"])
        results = json.loads((out / "eval" / "results.json").read_text())
        with quiet, contextlib.redirect_stderr(err):
            robust = evaluate_main([*args, "--robustness-limit", "4"])
        kept = json.loads((out / "eval" / "results.json").read_text())
        with quiet, contextlib.redirect_stderr(io.StringIO()):
            required = evaluate_main([*args, "--robustness-limit", "4", "--require", "robustness"])
        print(json.dumps({"codes": [exported, light, robust, required], "tried": TRIED, "error": err.getvalue(),
                          "results": sorted(results), "kept": sorted(kept),
                          "written": (out / "eval" / "results.json").is_file(),
                          "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
    """, tmp_path)
    assert seen["codes"] == [0, 0, 0, 2] and "accuracy" in seen["results"], seen
    assert "accuracy" in seen["kept"] and seen["written"], "the top-1 computed before the skip is kept"
    lines = [line for line in seen["error"].splitlines() if line.startswith("[ort-eval] robustness skipped")]
    assert len(lines) == 1 and "pip install 'patchplace-export[corruptions]'" in lines[0], seen["error"]
    # only the robustness request reached for the corruption stack; the export never reached for anything
    assert set(seen["tried"]) <= {"imagecorruptions", "skimage", "skimage.filters"}, seen["tried"]
    assert seen["tried"] and not seen["loaded"]


def test_a_missing_extra_is_one_line_naming_its_pip_command(tmp_path):
    seen = run_blocked(("librosa", "soundfile", "scipy", "skimage", "imagecorruptions"), """
        import json
        import numpy as np, torch
        from patchplace.data import DataError, read_wav
        from patchplace.data.codecs import encode_wav, resample
        from patchplace.data.mfcc import MFCC
        from patchplace.export import ExportError
        from patchplace.export.evaluate import corrupt_batch
        from patchplace.finetune import image_similarity
        from patchplace.finetune.privacy import PrivacyError

        def message(call, kinds):
            try:
                call()
            except kinds as exc:
                return [type(exc).__name__, str(exc), isinstance(exc, ImportError)]
            return None

        audio = (DataError,)
        # the export's command line on a speech model: the MFCC frontend goes inside the graph
        import contextlib, io
        from pathlib import Path
        from patchplace.export.__main__ import main as export_main
        from patchplace.models import create_model, save_pretrained
        out = Path(sys.argv[2])
        save_pretrained(create_model("audio_mp3", depth=1), out / "speech", metadata={"classes": list("abcdefghijkl")})
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = export_main([str(out / "speech"), "--out", str(out / "speech.onnx")])
        print(json.dumps({
            "cli": [code, err.getvalue(), sorted(p.name for p in out.glob("speech.*"))],
            "mfcc": message(MFCC, audio),
            "read_wav": message(lambda: read_wav(b"RIFF"), audio),
            "encode_wav": message(lambda: encode_wav(np.zeros(16, np.float32), 16000), audio),
            "resample": message(lambda: resample(np.zeros(16, np.float32), 8000, 16000), audio),
            "corrupt": message(lambda: corrupt_batch(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), "fog", 1),
                               (ExportError,)),
            "privacy": message(lambda: image_similarity(torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8)),
                               (PrivacyError,)),
        }))
    """, tmp_path)
    for where, module, pip in [("mfcc", "librosa", "patchplace-data[audio]"),
                               ("read_wav", "soundfile", "patchplace-data[audio]"),
                               ("encode_wav", "soundfile", "patchplace-data[audio]"),
                               ("resample", "scipy", "patchplace-data[audio]"),
                               ("corrupt", "imagecorruptions", "patchplace-export[corruptions]"),
                               ("privacy", "skimage", "patchplace-finetune[privacy]")]:
        assert seen[where], f"{where}: no error of the expected type"
        kind, text, is_import_error = seen[where]
        assert "\n" not in text and f"needs {module}" in text and f"pip install '{pip}'" in text, (where, text)
        path = LOCAL[pip.split("[")[0]]
        assert f"pip install './{path}[{pip.split('[')[1]}" in text, (where, text)
        assert is_import_error == (kind == "MissingExtra"), (where, kind)
    assert seen["mfcc"][0] == "MissingExtra"  # a DataError (the entry points' one line) and an ImportError
    code, stderr, written = seen["cli"]
    assert code == 2 and written == [], seen["cli"]
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("error: the MFCC frontend needs librosa") and "'patchplace-data[audio]'" in line, line
