"""The ImageNet data path rehearsed end to end, the way a user with 1.28M images runs it, on 2 CPU processes:

a generated ImageNet-like tree (10 wnid classes, RGB JPEGs of varying non-square sizes, the validation split in
ILSVRC's flat layout with its label file) -> class-mixed shards written by 2 processes (``data/image_folder.py
--workers 2 --val-labels``) -> a short MAE pretraining on 2 processes -> the streamed linear / kNN probe across 2
processes (the same numbers as on 1) -> a short fine-tuning on 2 processes -> ONNX export with its parity gate ->
ONNX Runtime accuracy, patch-shuffle consistency and corruption robustness (all 15 ImageNet-C corruptions) on the
variable-size validation shards, resized and centre-cropped as the checkpoint's evaluation transform says.

Only the model and the run length shrink (tests/test_scale_rehearsal.py's ``SHRINK``); every other field is the
shipped config's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_scale_rehearsal import CONFIGS, ENV, ENV_ONE, LAUNCH, ROOT, SHRINK, TIMEOUT, WNIDS, write_image_folder

from patchplace.data import Manifest

pytestmark = pytest.mark.slow

VAL_IMAGES = 30
PRETRAIN, FINETUNE, LINPROBE = (f"imagenet_mae_vitb16_{s}.yaml" for s in ("pretrain", "finetune", "linprobe"))
LOADER = [f"data.batch_size={SHRINK['data.batch_size']}", f"data.num_workers={SHRINK['data.num_workers']}"]
TRAINING = [*LOADER, f"optim.max_steps={SHRINK['optim.max_steps']}"]
MODEL = [f"model.overrides.embed_dim={SHRINK['model.overrides.embed_dim']}",
         f"model.overrides.depth={SHRINK['model.overrides.depth']}",
         f"objective.decoder_dim={SHRINK['objective.decoder_dim']}"]


def write_flat_val(root: Path, n: int, seed: int = 1) -> Path:
    """ILSVRC2012's validation layout: ``val/ILSVRC2012_val_%08d.JPEG`` in one folder, the classes in a label file
    (``LOC_val_solution.csv``'s form); images of varying sizes, each drawn like its class's train images."""
    rng = np.random.default_rng(seed)
    (root / "val").mkdir(parents=True)
    rows = ["ImageId,PredictionString"]
    for i in range(1, n + 1):
        c = i % len(WNIDS)
        w, h = (int(v) for v in rng.integers(48, 201, 2))
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.array([(c * 73) % 256, (c * 151) % 256, (c * 29 + 100) % 256], np.float32)
        stripes = 60 * np.sin(2 * np.pi * (xx * np.cos(c) + yy * np.sin(c)) / (8 + 3 * c))
        pixels = np.clip(base + stripes[..., None] + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        name = f"ILSVRC2012_val_{i:08d}"
        Image.fromarray(pixels).save(root / "val" / f"{name}.JPEG", quality=90)
        rows.append(f"{name},{WNIDS[c]} 1 2 30 40 ")
    labels = root / "LOC_val_solution.csv"
    labels.write_text("\n".join(rows) + "\n")
    return labels


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(command[:6])} ...: {result.stderr[-4000:]}"
    return result


def pipeline(script: str, config: str, *args: str, processes: int = 2) -> subprocess.CompletedProcess:
    command = [*LAUNCH] if processes == 2 else [sys.executable]
    return run([*command, str(ROOT / "pipelines" / f"{script}.py"), "--config", str(CONFIGS / config), *args],
               ENV if processes == 2 else ENV_ONE)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("datapath")
    write_image_folder(root / "imagenet", {"train": 24})
    labels = write_flat_val(root / "imagenet", VAL_IMAGES)
    run([sys.executable, str(ROOT / "data" / "image_folder.py"), "--src", str(root / "imagenet"), "--out",
         str(root / "shards"), "--workers", "2", "--val-labels", str(labels), "--max-count", "64"], ENV_ONE)
    return root / "shards"


def test_imagenet_data_path_from_flat_val_folder_to_onnx_runtime_on_two_processes(shards, tmp_path):
    train, val = Manifest.load(shards / "train"), Manifest.load(shards / "val")
    assert (train.num_samples, val.num_samples, len(train.shards)) == (240, VAL_IMAGES, 4)
    assert train.info == {"image_size": None, "channels": 3}, "the sizes vary"
    data = [f"data.train={shards / 'train'}", f"data.val={shards / 'val'}"]

    pretrained = tmp_path / "pretrain"
    pipeline("pretrain", PRETRAIN, *data, *TRAINING, *MODEL, f"run.output={pretrained}")
    checkpoint = pretrained / "checkpoint"

    # the streamed probes across 2 processes give one process's numbers
    probed = {}
    for processes in (1, 2):
        out = tmp_path / f"probe{processes}"
        pipeline("evaluate", LINPROBE, *data, *LOADER, f"model.checkpoint={checkpoint}", "eval.knn=true",
                 f"run.output={out}", processes=processes)
        probed[processes] = json.loads((out / "results.json").read_text())
    for key in ("linear_probe", "knn_per_layer"):
        assert probed[1][key] == probed[2][key], (key, probed[1][key], probed[2][key])
    assert 0.0 <= probed[2]["linear_probe"]["top1"] <= 1.0

    tuned = tmp_path / "finetune"
    pipeline("finetune", FINETUNE, *data, *TRAINING, f"model.checkpoint={checkpoint}", f"run.output={tuned}")
    model = tmp_path / "onnx" / "model.onnx"
    run([sys.executable, "-m", "patchplace.export", str(tuned / "checkpoint"), "--out", str(model)], ENV_ONE)
    sidecar = json.loads(model.with_suffix(".json").read_text())
    assert max(sidecar["parity"]["max_abs_diff"].values()) <= sidecar["parity"]["tolerance"]
    transform = sidecar["preprocessing"]["eval_transform"]
    assert transform["mode"] == "resize_center_crop" and transform["crop_pct"] == 0.875, transform

    ort = tmp_path / "ort"
    run([sys.executable, "-m", "patchplace.export.evaluate", str(model), "--data", str(shards / "val"), "--out",
         str(ort), "--robustness-limit", "2", "--consistency-limit", "8", "--latency-repeats", "0"], ENV_ONE)
    results = json.loads((ort / "results.json").read_text())
    assert results["accuracy"]["count"] == VAL_IMAGES and 0.0 <= results["accuracy"]["top1"] <= 1.0
    assert results["consistency"], "patch-shuffle consistency on the resized, centre-cropped images"
    errors = results["robustness"]["errors"]
    assert len(errors) == 15 and all(len(v["per_severity"]) == 5 for v in errors.values()), sorted(errors)
    print(json.dumps({"probe": {p: {k: r[k] for k in ("linear_probe", "knn_per_layer")} for p, r in probed.items()},
                      "ort": {k: results[k] for k in ("accuracy", "consistency")},
                      "robustness_mean_error": results["robustness"]["mean_error"]}))
