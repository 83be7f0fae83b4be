"""``run.model_ema``: an exponential moving average of the trained weights (DeiT's ``--model-ema``, "Training
data-efficient image transformers & distillation through attention", arXiv 2012.12877), kept by timm's
``timm.utils.ModelEmaV3``.

What ModelEmaV3 does (timm 1.0): it deep-copies the module (eval mode) and, at each ``update(model)``, lerps every
floating-point entry of the state dict, parameters *and* buffers, towards the model's (``ema += (1 - decay) (w -
ema)``), copying integer buffers; ``update(model)`` without a step uses the fixed decay (no warm-up, as DeiT's).

The average is of the whole objective (backbone, heads, decoders, target encoder), so the pipeline's own evaluation
runs on it unchanged; ``backbone`` is its copy of the trained backbone (saved in ``output/ema/``). Every rank keeps
and updates its own copy, as DeiT does: DDP keeps the weights identical on every rank, so the copies stay equal and
no rank waits for another; the checkpoint holds the main process's in ``state/model_ema.safetensors`` (read back
by safetensors: no pickle, unlike Accelerate's custom checkpoint state), and every rank resumes from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from timm.utils import ModelEmaV3
from torch import nn

from patchplace.models import save_pretrained
from patchplace.pipelines.engine.protocol import CheckpointError

STATE_FILE = "model_ema.safetensors"  # in a checkpoint's state/: the running average, for run.resume=true


class WeightsEma:
    """The EMA of ``model`` (an unwrapped objective: never the DDP wrapper, whose state-dict keys carry
    ``module.``) at ``decay``, with ``backbone``'s place in it. Made before ``run.compile`` compiles the blocks: a
    deep copy of a compiled block would call the original block's forward."""

    def __init__(self, model: nn.Module, decay: float, backbone: nn.Module) -> None:
        self.decay = decay
        self.ema = ModelEmaV3(model, decay=decay)
        self.ema.requires_grad_(False)  # never trained: the optimizer's groups were built before the copy
        self.backbone_name = next(name for name, module in model.named_modules() if module is backbone)

    def to(self, device: torch.device) -> WeightsEma:
        """Beside the prepared model (ModelEmaV3's foreach lerp needs both on one device)."""
        self.ema.module.to(device)
        return self

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """After an optimizer step: ``ema = decay x ema + (1 - decay) x weights`` (``model`` unwrapped)."""
        self.ema.update(model)

    @property
    def module(self) -> nn.Module:
        """The averaged objective (eval mode)."""
        return self.ema.module

    @property
    def backbone(self) -> nn.Module:
        """The averaged backbone (what ``output/ema/`` holds)."""
        return self.ema.module.get_submodule(self.backbone_name)

    def save(self, folder: Path, metadata: dict[str, Any]) -> None:
        """``output/ema/``: the averaged backbone's ``save_pretrained`` folder, and the objective's other averaged
        parameters in ``objective.safetensors`` (as a checkpoint/ folder holds them)."""
        save_pretrained(self.backbone, folder, metadata=metadata)
        skip = (f"{self.backbone_name}.", "target_encoder.")
        extras = {k: v.detach().contiguous().cpu() for k, v in self.module.state_dict().items()
                  if not k.startswith(skip)}
        if extras:
            save_file(extras, str(folder / "objective.safetensors"))

    def save_state(self, state: Path) -> None:
        """The running average into a checkpoint's ``state/`` (main process)."""
        save_file({k: v.detach().contiguous().cpu() for k, v in self.module.state_dict().items()},
                  str(state / STATE_FILE))

    def load_state(self, state: Path) -> None:
        """``run.resume=true``: the running average of the checkpoint in ``state/`` (every rank)."""
        path = state / STATE_FILE
        if not path.is_file():
            raise CheckpointError(f"run.model_ema={self.decay:g}: {path} is missing, so the checkpoint holds no EMA "
                                  "of the weights (trained without run.model_ema?): resume without it, or start a "
                                  "new run (another run.output, or run.overwrite=true)")
        device = next(iter(self.module.state_dict().values())).device
        self.module.load_state_dict(load_file(str(path), device=str(device)))
