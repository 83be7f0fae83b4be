"""An exported image classifier under ONNX Runtime, as the evaluator runs it: the provider asked for (a CUDA
session that falls back to the CPU is refused), the pair's checks (:func:`~.pair.load_export`), the data it takes
and the preprocessing its sidecar records (padding, or the resize and centre crop)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from patchplace.data import Manifest
from patchplace.data.manifest import class_list, first_difference

from .choices import PROVIDERS
from .errors import ExportError, non_finite
from .pair import load_export
from .runtime import ort

SIDECAR_FORMATS = ("patchplace.export/1",)  # the model.json layouts this evaluator reads


CUDA_LIBRARIES = "libcublas(Lt).so.13, libcudart.so.13, libcurand.so.10, cuDNN 9"


def ort_package() -> str:
    """``onnxruntime-gpu 1.31.1`` / ``onnxruntime 1.30.0``: the ONNX Runtime build imported (not the one pip lists)."""
    try:
        from onnxruntime.capi.build_and_package_info import package_name
    except ImportError:
        package_name = "onnxruntime"
    return f"{package_name} {ort.__version__}"


def prepare_provider(provider: str) -> None:
    """Before a CUDA session: refuse at once when nothing can give one (no GPU, or a CPU build of ONNX Runtime), and
    load the CUDA / cuDNN libraries (``onnxruntime.preload_dlls``, ONNX Runtime >= 1.21; torch is imported first,
    so the libraries of its nvidia-* packages are found)."""
    if provider != "cuda":
        return
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise ExportError(f"CUDAExecutionProvider not active: {ort_package()} (from {Path(ort.__file__).parent}) "
                          f"has no CUDA provider (available: {', '.join(available)}): replace onnxruntime with "
                          "onnxruntime-gpu (pip uninstall onnxruntime, then pip install onnxruntime-gpu: "
                          "patchplace-export[gpu]), or evaluate on the CPU with --provider cpu")
    if not torch.cuda.is_available():
        raise ExportError("CUDAExecutionProvider not active: torch sees no CUDA device here (no GPU, or no driver)")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    import onnx  # a one-node graph: does a CUDA session come up at all (it raises or falls back to the CPU if not)?

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    probe = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])],
                                                          "probe", [x], [y]),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=PROVIDERS["cuda"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"CUDAExecutionProvider not active: ONNX Runtime could not create a CUDA session "
                          f"({' '.join(str(exc).split())[:300]}; {ort_package()}; {CUDA_FIX})") from None
    check_provider(session, "cuda")


CUDA_FIX = (f"onnxruntime-gpu could not load its CUDA libraries ({CUDA_LIBRARIES}): import torch first, call "
            "onnxruntime.preload_dlls(), or put the nvidia/*/lib directories of torch's nvidia-* packages on "
            "LD_LIBRARY_PATH; ONNX Runtime's log above names the library")


def check_provider(session: Any, provider: str) -> None:
    """Refuse a session that does not run on the provider asked for: ONNX Runtime falls back to the CPU without an
    error when the CUDA provider's libraries fail to load."""
    wanted = PROVIDERS.get(provider)
    got = session.get_providers()
    if wanted and got[0] != wanted[0]:
        why = CUDA_FIX if wanted[0].startswith("CUDA") else "the provider asked for is not available in this build"
        raise ExportError(f"{wanted[0]} not active: the session runs on {got[0]} ({ort_package()}; {why})")


class OnnxModel:
    """An exported classifier: its session (``threads`` intra-op threads, 0: ONNX Runtime's default; ``provider``:
    auto / cpu / cuda, see :data:`PROVIDERS` — a session not on the provider asked for is refused), sidecar and
    the preprocessing the sidecar describes. The pair is checked (:func:`~.exporter.load_export`): a model.onnx
    beside another export's model.json is refused; so are non-finite outputs, by :meth:`run`."""

    def __init__(self, path: str | Path, threads: int = 0, provider: str = "auto") -> None:
        if provider not in PROVIDERS:
            raise ExportError(f"provider must be one of {list(PROVIDERS)}, got {provider!r}")
        self.path = path = Path(path)
        prepare_provider(provider)
        self.meta, self.session = load_export(path, providers=PROVIDERS[provider], threads=threads)
        if self.meta.get("format") not in SIDECAR_FORMATS:  # another layout: its fields would be misread
            raise ExportError(f"{path.with_suffix('.json')} has format {self.meta.get('format')!r}, and this evaluator "
                              f"reads {', '.join(SIDECAR_FORMATS)}: evaluate it with the patchplace.export that wrote "
                              f"it, or re-export the checkpoint with this one (python -m patchplace.export CHECKPOINT "
                              f"--out {path})")
        check_provider(self.session, provider)
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        if self.meta.get("kind") != "classifier" or self.meta.get("modality") != "image":
            raise ExportError(f"{path}: this evaluator takes image classifiers, got {self.meta.get('modality')} "
                              f"{self.meta.get('kind')}")
        if self.meta.get("outputs") != ["logits", "pooled"]:
            raise ExportError(f"{path} has outputs {self.meta.get('outputs')}, expected ['logits', 'pooled']: "
                              "re-export it with this version of patchplace.export")
        self.inputs = [i["name"] for i in self.meta["inputs"]]
        self.channels, self.height, self.width = self.meta["inputs"][0]["shape"][1:]
        self.patch_size = self.meta["backbone"]["patch_size"]
        norm = self.meta.get("normalization") or {"mean": [0.5] * self.channels, "std": [0.5] * self.channels}
        self.mean = torch.tensor(norm["mean"]).view(1, -1, 1, 1)
        self.std = torch.tensor(norm["std"]).view(1, -1, 1, 1)
        # the checkpoint's evaluation transform (exports since it was recorded); older sidecars: pad / refuse
        self.eval_transform = (self.meta.get("preprocessing") or {}).get("eval_transform") or {}
        self.resizes = self.eval_transform.get("mode") == "resize_center_crop"

    def check_data(self, manifest: Manifest) -> None:
        """Refuse shards the model was not made for (class names and their order, channels, image size)."""
        classes = self.meta.get("classes") or []
        if classes and list(classes) != list(manifest.classes):  # label i must mean the class the model's i means
            dataset = ((self.meta.get("provenance") or {}).get("data") or {}).get("dataset") or "its training data"
            raise ExportError(f"the model's classes are {class_list(classes)} ({dataset}) but "
                              f"{manifest.dataset}/{manifest.split} holds {class_list(manifest.classes)} "
                              f"({first_difference(classes, manifest.classes)}): a top-1 would compare unrelated "
                              "labels; evaluate it on the dataset it was trained on")
        where = f"--data {manifest.location} ({manifest.dataset}/{manifest.split})"
        if manifest.modality != "image":
            raise ExportError(f"{where} holds {manifest.modality} but {self.path} is an image classifier: evaluate it "
                              "on an image split")
        channels = int(manifest.info.get("channels", 3))
        if channels != self.channels:
            kinds = {1: "grayscale", 3: "RGB"}
            raise ExportError(f"{where} holds {kinds.get(channels, 'multi-channel')} images ({channels} channel(s)) "
                              f"but {self.path} takes {kinds.get(self.channels, 'multi-channel')} ones "
                              f"({self.channels} channel(s)): evaluate it on a split written with {self.channels} "
                              "channel(s), as it was trained on")
        if self.resizes:  # any size: resized and centre-cropped as the checkpoint's evaluation transform does
            return
        native = manifest.info.get("image_size") or []
        if not native and not self.meta.get("pad_to"):
            raise ExportError(f"the shards of {manifest.dataset}/{manifest.split} hold images of varying sizes (no "
                              f"image_size in their manifest), and this evaluator only pads to the model's "
                              f"{self.height}x{self.width} input (no resize / centre crop): evaluate it on data of "
                              "one size it was trained on")
        if native and (native[0] > self.height or native[1] > self.width):
            # padding never crops: these images would be centre-cropped to the model's input (a silent wrong top-1)
            raise ExportError(f"the shards of {manifest.dataset}/{manifest.split} hold {native[0]}x{native[1]} "
                              f"images, larger than the model's {self.height}x{self.width} input: evaluate it on "
                              "data of the size it was trained on")
        side = self.meta.get("pad_to") or max(native or [0])
        if side != self.height:
            raise ExportError(f"{where} gives {side} px images after padding but {self.path} takes "
                              f"{self.height}x{self.width} pixels: evaluate it on data of the size it was trained on")

    def resize_crop(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (C, h, w) -> uint8 (C, H, W) by the recorded evaluation transform: PIL resize (its interpolation)
        of the short side to ``floor(H / crop_pct)`` (as torchvision's ``Resize(int)`` computes the long side),
        centre crop as torchvision's ``CenterCrop`` — :mod:`.preprocess`'s numpy reference, the one the docs' ONNX
        Runtime snippet runs; :meth:`normalize` then gives timm's eval tensor bit for bit."""
        from .preprocess import center_crop, resize_short_side

        record = self.eval_transform
        try:
            resized = resize_short_side(image.numpy(), int(record["resize_short_side"]),
                                        record.get("interpolation", "bicubic"))
            cropped = center_crop(resized, self.height, self.width)
        except ValueError as exc:
            raise ExportError(f"{exc} (the evaluation transform of {self.path})") from None
        return torch.from_numpy(np.ascontiguousarray(cropped))

    def pad(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, h, w) -> uint8 (B, C, H, W), zero-padded and centered like the data path's PadTo."""
        h, w = images.shape[-2:]
        top, left = (self.height - h) // 2, (self.width - w) // 2
        return F.pad(images, (left, self.width - w - left, top, self.height - h - top))

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - self.mean) / self.std

    def run(self, pixels: torch.Tensor, unknown_pos: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
        feed = {"pixels": pixels.numpy().astype(np.float32)}
        if "unknown_pos" in self.inputs:
            feed["unknown_pos"] = (unknown_pos if unknown_pos is not None else torch.zeros(
                pixels.shape[0], (self.height // self.patch_size) * (self.width // self.patch_size),
                dtype=torch.bool)).numpy()
        logits, pooled = self.session.run(None, feed)
        for name, value in (("logits", logits), ("pooled", pooled)):
            if kind := non_finite(value):
                raise ExportError(f"{self.path}: the model's {name} hold {kind} on {len(value)} inputs: its weights "
                                  "are damaged or its training diverged; re-export it from a good checkpoint (no "
                                  "top-1 is reported)")
        return logits, pooled

    def _device_zeros(self, batch: int, device: torch.device) -> torch.Tensor:
        """An all-False ``unknown_pos`` on the GPU per batch size, made once and synchronised (ONNX Runtime reads it
        on its own stream)."""
        cache = self.__dict__.setdefault("_unknown", {})
        if batch not in cache:
            positions = (self.height // self.patch_size) * (self.width // self.patch_size)
            cache[batch] = torch.zeros(batch, positions, dtype=torch.bool, device=device)
            torch.cuda.synchronize(device)
        return cache[batch]

    def run_on_device(self, pixels: torch.Tensor) -> Any:
        """One forward with the input and outputs bound on the GPU (IOBinding; ``pixels``: a CUDA tensor): ONNX
        Runtime without the host copies, as PyTorch eager runs on the same GPU. -> the binding (outputs on the GPU)."""
        pixels = pixels.contiguous()
        binding = self.session.io_binding()
        index = pixels.device.index or 0
        binding.bind_input("pixels", "cuda", index, np.float32, tuple(pixels.shape), pixels.data_ptr())
        if "unknown_pos" in self.inputs:
            unknown = self._device_zeros(pixels.shape[0], pixels.device)
            binding.bind_input("unknown_pos", "cuda", index, np.bool_, tuple(unknown.shape), unknown.data_ptr())
        for name in ("logits", "pooled"):
            binding.bind_output(name, "cuda", index)
        self.session.run_with_iobinding(binding)
        return binding
