"""MJP: Masked Jigsaw Puzzle position embedding (Ren et al., CVPR 2023, "Masked Jigsaw Puzzle: A Versatile Position
Embedding for Vision Transformers", arXiv:2205.12551).

Supervised training in which, per sample, a block-wise selected subset of patches is shuffled among itself (Alg. 1),
the shuffled positions get one shared learnable *unknown* PE ``E_unk`` instead of their own (Eq. 4-5; CLS keeps its
PE), and a dense absolute localization (DAL) regressor maps the PE rows of the unshuffled positions back to their
(row, col) grid coordinates (Eq. 1-2): ``L_all = L_CE + lambda L_DAL`` (§4.2). docs/methods/mjp.md is the precise
spec; the comments below say where we deviate from the official code (github.com/yhlleo/MJP).

Usage::

    backbone = create_model("vit_small", num_classes=1000, pos_embed="learned")
    objective = MJP(backbone, MJPConfig())                    # adds backbone.unknown_pos_embed (E_unk)
    out = objective((images, labels), progress=step / total_steps)  # {"loss", "ce", "dal", "acc", "jigsaw", ...}
    out["loss"].backward()
    shuffled, unknown_pos = jigsaw(images, patch_size=16, ratio=0.15)  # evaluation (consistency, Eq. 6-7)
    logits = backbone(shuffled, unknown_pos=unknown_pos)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchplace.models import Backbone

from .blockwise import blockwise_masks, target_count
from .common import (
    BackboneObjective,
    ObjectiveError,
    check_ratio,
    gather_rows,
    grid_coords,
    image_to_patches,
    noise_device,
    patches_to_image,
    split_batch,
)
from .configs import DAL_KINDS, MJPConfig
from .registry import register_method
from .supervised import classification_loss


# ---------------------------------------------------------------------------------------------- Alg. 1
def permute_selected(mask: torch.Tensor, generator: torch.Generator | None = None,
                     derange: bool = True) -> torch.Tensor:
    """Per sample, a random permutation of the selected positions among themselves (Alg. 1 ``JigsawPuzzle``).

    ``mask`` (B, N) bool -> ``source`` (B, N) long: position i receives the patch of position ``source[b, i]``;
    unselected positions map to themselves, selected ones to selected ones (a bijection per sample).

    ``derange=True`` (default): a uniformly random single cycle through the m selected positions (Sattolo's
    permutation, built from a random order), so *every* selected patch moves whenever m >= 2. The official code
    applies ``np.random.shuffle`` to the selected indices, a uniform permutation that leaves on average one patch
    in place — it then carries ``E_unk`` although nothing moved. Both give each selected position a patch drawn
    uniformly from the *other* selected positions (the cycle) / from all of them (official), so the per-position
    marginal is what the model sees either way; the cycle just guarantees that the unknown PE always marks a
    displaced patch. ``derange=False`` is the official uniform permutation. m = 1 cannot move (identity).
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ObjectiveError(f"the jigsaw mask must be a (B, N) bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    b, n = mask.shape
    device = mask.device
    rank = torch.arange(n, device=device).expand(b, n)
    noise = torch.rand(b, n, generator=generator, device=noise_device(device, generator)).to(device)
    # Selected positions first in random order (keys in [0, 1)), then the unselected ones in raster order (keys
    # 1 + i), so the tail of ``order`` is the identity part of the permutation.
    order = torch.where(mask, noise, 1.0 + rank.float()).argsort(dim=1)
    count = mask.sum(dim=1, keepdim=True)
    if derange:
        # order[k] receives the patch of order[k + 1 mod m]: one m-cycle, no fixed point for m >= 2.
        nxt = torch.where(rank < count, (rank + 1) % count.clamp_min(1), rank)
        src_sorted = torch.gather(order, 1, nxt)
        dest = order
    else:
        # selected positions in raster order receive the patches of ``order`` (a uniformly random arrangement).
        dest = torch.where(mask, rank, n + rank).argsort(dim=1)
        src_sorted = order
    return torch.empty_like(order).scatter_(1, dest, src_sorted)


def jigsaw(images: torch.Tensor, patch_size: int, ratio: float, *, min_block: int = 8, min_aspect: float = 0.3,
           count_rule: str = "int", generator: torch.Generator | None = None, mask: torch.Tensor | None = None,
           derange: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise random jigsaw puzzle shuffle (MJP Alg. 1) of a batch of images.

    Per sample, BEiT's block-wise generator selects up to int(``ratio`` N) patches (``count_rule="round"``:
    round(``ratio`` N); Alg. 1 line 3; per sample, where the official code draws one mask for the whole batch:
    docs/methods/mjp.md), and the selected patches are permuted among themselves (line 4; see
    :func:`permute_selected` for ``derange``); all other patches stay bit-identical.

    ``images`` (B, C, H, W) with H, W multiples of ``patch_size`` -> ``(shuffled, unknown_pos)``: the shuffled
    images (same shape and dtype) and the (B, N) bool mask of the selected positions, raster order — the
    ``unknown_pos`` input of the backbone / ONNX model (Eq. 4). A precomputed ``mask`` (B, N) skips the generator.
    Everything is drawn for the whole batch with tensor ops on ``images.device`` (no host sync): from ``generator``
    on its own device when given (deterministic: mask, then permutation; the same on any device), else from the
    device's default generator. Pure: usable in evaluation (consistency, Eq. 7).
    """
    if images.dim() != 4:
        raise ObjectiveError(f"jigsaw expects images (B, C, H, W), got shape {tuple(images.shape)}")
    b, _, h, w = images.shape
    if patch_size < 1 or h % patch_size or w % patch_size:
        raise ObjectiveError(f"patch_size {patch_size} must divide the image size {h} x {w}")
    grid = (h // patch_size, w // patch_size)
    if mask is None:
        check_ratio("ratio", ratio)
        mask = blockwise_masks(b, grid, ratio, min_block=min_block, min_aspect=min_aspect, count_rule=count_rule,
                               device=images.device, generator=generator)
    elif tuple(mask.shape) != (b, grid[0] * grid[1]) or mask.dtype != torch.bool:
        raise ObjectiveError(f"mask must be a bool tensor of shape {(b, grid[0] * grid[1])}, got {mask.dtype} "
                             f"{tuple(mask.shape)}")
    mask = mask.to(images.device)
    source = permute_selected(mask, generator, derange)
    shuffled = patches_to_image(gather_rows(image_to_patches(images, patch_size), source), grid)
    return shuffled, mask


# ---------------------------------------------------------------------------------------------- DAL (§4.2)
class DALRegressor(nn.Module):
    """The map g: PE row -> (row, col) of Eq. 1, as the three variants of §5.3 / Table 4.

    * ``pca``: no parameters — project the rows on their top-2 principal directions (``torch.pca_lowrank``, 5
      iterations as the official code; differentiable w.r.t. the PE rows). As the official code, the basis comes
      from the centred rows but the *uncentred* rows are projected. Added here: each direction's sign is fixed
      (largest-magnitude score positive, sklearn's ``svd_flip``) so the randomized PCA does not flip the map
      between steps.
    * ``linear``: one Linear(D, 2) (LN).
    * ``mlp``: Linear(D, D) - ReLU - Linear(D, D) - ReLU - Linear(D, 2), the paper's "3-layers MLP" (§5.3; the
      official ``nonlinear`` has 2 layers, docs/methods/mjp.md follows the paper). Hidden width D and ReLU as the
      official code;
      Linear weights trunc-normal(.02), zero biases (the official model's ``_init_vit_weights`` reaches them too).

    ``forward(pe_rows)``: (M, D) -> (M, 2) predicted (row, col).

    >>> g = DALRegressor(backbone.embed_dim, "mlp")
    >>> loss = dal_loss(g, backbone.pos_embed()[0], keep_mask=~unknown_pos, grid=backbone.grid)
    """

    def __init__(self, dim: int, kind: str = "mlp") -> None:
        super().__init__()
        if kind not in DAL_KINDS:
            raise ObjectiveError(f"DAL map must be one of {DAL_KINDS}, got {kind!r}")
        if dim < 2:
            raise ObjectiveError(f"DAL needs PE rows of width >= 2, got {dim}")
        self.kind, self.dim = kind, dim
        if kind == "linear":
            self.layers: nn.Module = nn.Linear(dim, 2)
        elif kind == "mlp":
            self.layers = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(),
                                        nn.Linear(dim, 2))
        else:
            self.layers = nn.Identity()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, pe_rows: torch.Tensor) -> torch.Tensor:
        if pe_rows.dim() != 2 or pe_rows.shape[1] != self.dim:
            raise ObjectiveError(f"DAL expects PE rows (M, {self.dim}), got {tuple(pe_rows.shape)}")
        if self.kind != "pca":
            return self.layers(pe_rows)
        rows = pe_rows.float()
        u, _, v = torch.pca_lowrank(rows, q=2, center=True, niter=5)
        with torch.no_grad():
            sign = torch.sign(torch.gather(u, 0, u.abs().argmax(dim=0, keepdim=True)))
            sign = sign + (sign == 0)  # a zero score keeps its direction (arithmetic: no boolean-index sync)
        return (rows @ (v * sign)).to(pe_rows.dtype)


def dal_loss(regressor: DALRegressor, pe_table: torch.Tensor, keep_mask: torch.Tensor | None = None,
             grid: tuple[int, int] | None = None, coords: torch.Tensor | None = None) -> torch.Tensor:
    """L_DAL (Eq. 2): mean L1 between g(E_pos^{i,j}) and the integer grid coordinate (i, j) of each kept position.

    ``pe_table`` (N, D) or (1, N, D): the PE rows of the patch positions in raster order (``backbone.pos_embed()``;
    no CLS row) — image-independent. ``grid`` (h, w); None = a square grid. ``keep_mask``: None (all positions),
    (N,) or (B, N) bool — the *unshuffled* positions (Alg. 2 line 3). With per-sample masks (B, N) the loss is the
    mean over samples of each sample's mean over its kept positions (with one mask for the batch, as the official
    code, this is exactly its loss). The L1 is averaged over the two coordinates as the official ``F.l1_loss``
    (lambda = 0.01 was tuned with it), i.e. half of Eq. 2's ||.||_1. For ``pca`` the basis is fitted on all N rows
    (the official code fits it on the kept rows of its one batch mask; per-sample masks have no single kept set).
    ``coords``: the (N, 2) float targets (:func:`grid_coords` of ``grid``) already on the table's device — a
    training step passes its registered buffer; None builds them here.
    """
    table = pe_table[0] if pe_table.dim() == 3 and pe_table.shape[0] == 1 else pe_table
    if table.dim() != 2:
        raise ObjectiveError(f"pe_table must be (N, D) or (1, N, D), got {tuple(pe_table.shape)}")
    n = table.shape[0]
    if grid is None:
        side = math.isqrt(n)
        if side * side != n:
            raise ObjectiveError(f"{n} PE rows are not a square grid: pass grid=(h, w)")
        grid = (side, side)
    if len(grid) != 2 or grid[0] * grid[1] != n:
        raise ObjectiveError(f"grid {tuple(grid)} does not have {n} positions (the PE rows)")
    if coords is None:
        coords = grid_coords(tuple(grid)).to(table.device, torch.float32)
    err = F.l1_loss(regressor(table).float(), coords, reduction="none").mean(dim=1)  # (N,)
    if keep_mask is None:
        return err.mean()
    keep = keep_mask if keep_mask.dim() == 2 else keep_mask.unsqueeze(0)
    if keep.dtype != torch.bool or keep.shape[-1] != n:
        raise ObjectiveError(f"keep_mask must be bool (N={n},) or (B, {n}), got {keep_mask.dtype} "
                             f"{tuple(keep_mask.shape)}")
    keep = keep.to(err.device).float()
    count = keep.sum(dim=1)
    per_sample = (keep * err).sum(dim=1) / count.clamp_min(1.0)
    return per_sample.sum() / (count > 0).sum().clamp_min(1)  # samples with every position shuffled drop out


# ---------------------------------------------------------------------------------------------- objective
@register_method("mjp")
class MJP(BackboneObjective):
    """MJP objective (Alg. 2) on an image backbone with an additive PE (``learned`` or ``sincos2d``) and a head.

    Calls ``backbone.enable_unknown_pos()``: the shared ``E_unk`` of Eq. 4 lives in the backbone (saved with the
    checkpoint, an input of the ONNX graph through ``unknown_pos``). The DAL regressor lives here: training only.
    With a fixed ``sincos2d`` table DAL trains g alone and cannot change the backbone; it acts on ``learned`` PEs.

    ``forward(batch, progress=None, generator=None)`` on ``(images, labels)`` (labels: indices or soft targets):
    in training mode, once ``progress >= warmup_fraction`` and with probability ``apply_prob`` per batch, the batch
    goes through :func:`jigsaw` and the shuffled positions get ``E_unk``; loss = CE (+ label smoothing, or soft
    targets, as :class:`Supervised`) + lambda(progress) * DAL over the unshuffled positions (all positions on steps
    without jigsaw). ``progress=None`` means "no schedule": past the warm-up, lambda = ``dal_weight``; a 0-d tensor
    (the trainer's) keeps the warm-up and the schedule on the device. The step is static: the jigsaw is computed on
    every training step and selected on the device (:meth:`apply_jigsaw`). In eval mode it is the plain classifier
    loss (no jigsaw, no DAL). Returns 0-d tensors: ``loss`` and detached ``ce``, ``dal``, ``acc``, ``jigsaw`` (1.0
    when this batch was shuffled) and ``dal_weight``.

    A training loop (``progress``: the fraction of training done, in [0, 1]; schedules read it):

    >>> import torch
    >>> from patchplace.models import create_model
    >>> from patchplace.objectives import MJP, MJPConfig
    >>> model = MJP(create_model("vit_micro", in_chans=1, num_classes=10, pos_embed="learned"),
    ...             MJPConfig(ratio=0.15, warmup_fraction=0.0))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    >>> steps = 3
    >>> for step in range(steps):
    ...     images, labels = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))
    ...     out = model((images, labels), progress=step / steps)  # loss, ce, dal, acc
    ...     opt.zero_grad(); out["loss"].backward(); opt.step()
    >>> bool(torch.isfinite(out["loss"]))
    True
    """

    # Every training step computes the jigsaw and passes a mask (all False on steps without it), so E_unk always
    # takes part in the graph, with a zero gradient where nothing is shuffled: no parameter is ever unused, and a DDP
    # trainer needs no find_unused_parameters traversal. docs/methods/mjp.md compares this with the official code.
    leaves_parameters_unused = False

    def __init__(self, backbone: Backbone | nn.Module, config: MJPConfig | None = None) -> None:
        super().__init__()
        self.config = c = self.setup_backbone(backbone, config or MJPConfig())  # the registration's facts
        backbone = self.backbone
        n = backbone.num_patches
        target = target_count(c.ratio, n, c.count_rule)
        if c.ratio > 0 and target < 2:
            least = math.ceil((2.0 if c.count_rule == "int" else 1.5) / n * 1e4) / 1e4
            raise ObjectiveError(f"ratio {c.ratio} selects {c.count_rule}({c.ratio} * {n}) = {target} of the {n} "
                                 f"patches: the jigsaw needs at least 2 to permute; use ratio >= {least}"
                                 + (" or count_rule='round'" if c.count_rule == "int" and round(c.ratio * n) >= 2
                                    else ""))
        backbone.enable_unknown_pos()
        self.patch_size = backbone.config.patch_size
        self.dal = DALRegressor(backbone.embed_dim, c.dal)
        # DAL's regression targets (Eq. 2): a constant table, moved with the model, not rebuilt per step
        self.register_buffer("dal_coords", grid_coords(tuple(backbone.grid)).float(), persistent=False)

    def no_weight_decay(self) -> set[str]:
        """The objective's no-decay set, without the PE table and ``E_unk`` under ``decay_pos_embed`` (the official
        code's groups: see :class:`MJPConfig`)."""
        names = super().no_weight_decay()
        if self.config.decay_pos_embed:
            names -= {"backbone.pos_table", "backbone.unknown_pos_embed"}
        return names

    # ------------------------------------------------------------------ schedules
    @staticmethod
    def _progress(progress: float | torch.Tensor | None) -> float | torch.Tensor | None:
        """Floats are checked to lie in [0, 1]; a tensor (the trainer's, on the step's device) is taken as is:
        checking its value would wait for the device."""
        if progress is None or isinstance(progress, torch.Tensor):
            return progress
        p = float(progress)
        if not 0.0 <= p <= 1.0:
            raise ObjectiveError(f"progress must be in [0, 1] (training fraction done), got {progress}")
        return p

    def dal_weight_at(self, progress: float | torch.Tensor | None) -> float | torch.Tensor:
        """lambda at training ``progress``: ``constant`` = ``dal_weight`` (§4.2); ``official`` = the official
        per-epoch ``utils.cosine_scheduler(lambda, lambda / 2, epochs, 1, warmup_epochs)``: with E =
        ``schedule_epochs`` and W = round(``warmup_fraction`` E) warm-up epochs, epoch e = floor(progress E) gets
        ``linspace(0, lambda, W)[e]`` during the warm-up (0 at epoch 0, lambda at epoch W - 1) and then
        lambda / 2 + lambda / 4 (1 + cos(pi (e - W) / (E - W))) (0.01 -> 0.005). A float ``progress`` gives a float;
        a tensor gives a tensor on its device (the same values, computed without leaving the device)."""
        c = self.config
        p = self._progress(progress)
        if c.dal_schedule == "constant" or p is None:
            return c.dal_weight
        epochs = c.schedule_epochs
        warmup = round(c.warmup_fraction * epochs)
        final = 0.5 * c.dal_weight
        if isinstance(p, torch.Tensor):
            # float32 progress: e / E * E is off by up to ~2e-5 epochs at E = 300, hence the larger guard
            epoch = torch.clamp(torch.floor(p.float() * epochs + 1e-4), max=epochs - 1)
            ramp = c.dal_weight * epoch / (warmup - 1) if warmup > 1 else torch.full_like(epoch, c.dal_weight)
            cosine = final + 0.5 * (c.dal_weight - final) * (1.0 + torch.cos(math.pi * (epoch - warmup)
                                                                             / (epochs - warmup)))
            return torch.where(epoch < warmup, ramp, cosine)
        epoch = min(math.floor(p * epochs + 1e-9), epochs - 1)  # e / E * E may round to just below e
        if epoch < warmup:
            return c.dal_weight * epoch / (warmup - 1) if warmup > 1 else c.dal_weight  # np.linspace(0, lambda, W)
        return final + 0.5 * (c.dal_weight - final) * (1.0 + math.cos(math.pi * (epoch - warmup) / (epochs - warmup)))

    def jigsaw_applies(self, progress: float | torch.Tensor | None, generator: torch.Generator | None = None,
                       device: torch.device | str | None = None) -> torch.Tensor:
        """Whether this batch is shuffled, a 0-d bool tensor on ``device`` (None: the model's): training mode, past
        the warm-up, and a coin with ``apply_prob`` (the official ``torch.rand(1) > AUG.JIGSAW``: a random half of
        the batches), tossed on the device every step (from ``generator`` on its own device when given), so the step
        has the same ops and draws whatever the outcome."""
        c = self.config
        device = self.dal_coords.device if device is None else torch.device(device)
        if not self.training or c.ratio == 0:
            return torch.zeros((), dtype=torch.bool, device=device)
        p = self._progress(progress)
        coin = torch.rand((), generator=generator, device=noise_device(device, generator)).to(device) < c.apply_prob
        if p is None:
            return coin
        return coin & (p >= c.warmup_fraction)

    # ------------------------------------------------------------------ steps (Alg. 2)
    def apply_jigsaw(self, images: torch.Tensor, progress: float | torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Alg. 2 line 1 -> ``(images, unknown_pos)``. In training, every step computes ``jigsaw(images)`` (mask,
        then permutation, then the coin of :meth:`jigsaw_applies`) and selects it with ``torch.where``: the shuffled
        images and their mask where the jigsaw applies, else the images and an all-False (B, N) mask. In eval mode
        ``(images, None)``."""
        if not self.training:
            return images, None
        c = self.config
        if c.ratio == 0:  # nothing to shuffle; the all-False mask still gives E_unk its (zero) gradient
            return images, torch.zeros(images.shape[0], self.backbone.num_patches, dtype=torch.bool,
                                       device=images.device)
        shuffled, mask = jigsaw(images, self.patch_size, c.ratio, min_block=c.min_block, min_aspect=c.min_aspect,
                                count_rule=c.count_rule, generator=generator)
        applies = self.jigsaw_applies(progress, generator, images.device)
        return torch.where(applies, shuffled, images), mask & applies

    def dal_term(self, unknown_pos: torch.Tensor | None) -> torch.Tensor:
        """Alg. 2 line 3: L_DAL on the PE table rows of the positions not shuffled (per sample)."""
        keep = None if unknown_pos is None else ~unknown_pos
        return dal_loss(self.dal, self.backbone.pos_embed()[0], keep, grid=self.backbone.grid, coords=self.dal_coords)

    def forward(self, batch: Any, progress: float | torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        images, labels = split_batch(batch)
        if labels is None:
            raise ObjectiveError("MJP is supervised: it needs (inputs, labels) batches")
        shuffled, unknown_pos = self.apply_jigsaw(images, progress, generator)
        logits = self.backbone(shuffled, unknown_pos=unknown_pos)  # Eq. 5: E_unk where shuffled, CLS keeps its PE
        ce, acc = classification_loss(logits, labels, self.config.label_smoothing)
        weight = self.dal_weight_at(progress)
        if self.training and self.config.dal_weight > 0:
            dal = self.dal_term(unknown_pos)
            loss = ce + weight * dal
        else:
            dal, loss = ce.new_zeros(()), ce
        shuffled_any = unknown_pos.any().float() if unknown_pos is not None else ce.new_zeros(())
        weight = weight.detach().float() if isinstance(weight, torch.Tensor) else ce.new_full((), weight)
        return {"loss": loss, "ce": ce.detach(), "dal": dal.detach(), "acc": acc, "jigsaw": shuffled_any.detach(),
                "dal_weight": weight}
