"""Gradient-inversion privacy evaluation of image classifiers (MJP paper §5.4, Table 5, Fig. 5; App. G).

A federated client shares the parameter gradients of one training step on its private images; an attacker who
knows the model reconstructs the images from those gradients. Two attacks:

- :func:`analytic_attack` — APRIL's closed form for ViTs with a learnable PE (Lu et al. 2022; MJP App. G Eq. 8-9):
  with z0 = x_p E + E_pos, dL/dE_pos[n] = dL/dz0[n] =: g_n, and dL/dE = sum_n g_n x_n^T, so the patches X solve
  the linear system G^T X = dL/dE (exact when the N patch gradients are independent, i.e. N <= D). One image per
  update. Shuffled MJP positions take the shared unknown PE, so their rows of dL/dE_pos are zero and the system
  loses those unknowns (App. G: "the random permutation will drastically change both E_pos and dL/dE_pos").
- :func:`gradient_matching_attack` — optimization-based inversion (Geiping et al. 2020, "Inverting Gradients"; the
  attack family of the ``breaching`` library the MJP code points to): dummy images are optimized so that their
  gradients match the shared ones (cosine or L2 distance over all parameters) plus a total-variation prior, with
  Adam on signed gradients and step decay, or L-BFGS; images boxed to the data range; best of ``restarts`` by the
  final gradient distance. Labels are known (the common strong-attacker setting) or inferred from the classifier
  bias gradient (iDLG: only the true classes get a negative bias gradient under cross-entropy).

:func:`privacy_settings` runs Table 5's settings on a batch: (a) attack on x with the model's normal PEs, compared
with x; (b) the client trains on the masked-jigsaw x~ (MJP models also receive the unknown-PE mask of the shuffled
positions), the reconstruction is compared with x~; (c) the same reconstruction compared with the original x.
:func:`image_similarity` measures reconstruction vs original in [0, 1] pixel space with scikit-image's MSE, PSNR and
SSIM and a cosine similarity of 2D FFT magnitude spectra (FFT2D). LPIPS is not computed: it needs pretrained
AlexNet/VGG weights that cannot be loaded offline. Paper direction: a model preserves privacy better when MSE and
FFT2D distance are high and PSNR / SSIM are low.

Usage::

    grads = client_gradients(model, images, labels)
    recon, info = gradient_matching_attack(model, grads, images.shape, labels=labels, bounds=(lo, hi))
    image_similarity(denormalize(recon), denormalize(images))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


class PrivacyError(ValueError):
    """A privacy evaluation that cannot run as asked (model without what the attack needs, bad settings)."""


def _skimage_metrics() -> ModuleType:
    """``skimage.metrics``: patchplace-finetune's ``[privacy]`` extra, imported on use (the rest of the package
    goes without it); missing, a one-line :class:`PrivacyError` with the pip command."""
    try:
        import skimage.metrics
    except ImportError as exc:
        raise PrivacyError(f"the privacy evaluation's SSIM / PSNR needs {exc.name or exc}, which is not installed; "
                           "it comes with the [privacy] extra: pip install 'patchplace-finetune[privacy]' (from a "
                           "checkout: pip install './packages/finetune[privacy]')") from exc
    return skimage.metrics


@dataclass
class AttackConfig:
    """Gradient-matching attack settings (defaults: Geiping et al.'s cosine attack, sized for a CPU budget)."""

    steps: int = 300
    lr: float = 0.1  # attack optimizer step size
    distance: str = "cosine"  # "cosine" (Geiping et al.) or "l2" (DLG)
    tv_weight: float = 1e-2  # total-variation prior on the dummy images
    optimizer: str = "adam"  # "adam" (signed gradients, lr x0.1 at 3/8, 5/8, 7/8 of the steps) or "lbfgs"
    restarts: int = 1  # independent random starts; the best final gradient distance wins
    known_labels: bool = True  # False: labels inferred from the classifier bias gradient (iDLG)
    seed: int = 0  # the dummy images' initialization

    def validate(self) -> AttackConfig:
        if self.steps < 1 or self.restarts < 1 or self.lr <= 0 or self.tv_weight < 0:
            raise PrivacyError(f"attack: steps, restarts >= 1, lr > 0, tv_weight >= 0; got {asdict(self)}")
        if self.distance not in ("cosine", "l2"):
            raise PrivacyError(f"attack.distance must be 'cosine' or 'l2', got {self.distance!r}")
        if self.optimizer not in ("adam", "lbfgs"):
            raise PrivacyError(f"attack.optimizer must be 'adam' or 'lbfgs', got {self.optimizer!r}")
        return self


# ---------------------------------------------------------------------------------------------- the client
def _forward(model: nn.Module, images: torch.Tensor, unknown_pos: torch.Tensor | None) -> torch.Tensor:
    return model(images) if unknown_pos is None else model(images, unknown_pos)


def client_gradients(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                     unknown_pos: torch.Tensor | None = None, create_graph: bool = False) -> dict[str, torch.Tensor]:
    """Gradients of the batch-mean cross-entropy w.r.t. every trainable parameter, by name: what a FedSGD client
    shares after one step. The model is used as given (call ``eval()`` for a deterministic client without
    dropout / drop path). ``unknown_pos`` (B, N) bool: MJP's shuffled positions (they get the unknown PE)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = F.cross_entropy(_forward(model, images, unknown_pos), labels)
    # parameters the forward did not use (an MJP unknown PE on an unshuffled batch) get zero gradients
    grads = torch.autograd.grad(loss, [p for _, p in named], create_graph=create_graph, allow_unused=True,
                                materialize_grads=True)
    return {n: g if create_graph else g.detach() for (n, _), g in zip(named, grads, strict=True)}


def infer_labels(model: nn.Module, grads: dict[str, torch.Tensor], batch_size: int) -> torch.Tensor:
    """iDLG label inference: dL/db = mean_b (softmax - onehot), so the true classes are the most negative entries
    of the classifier bias gradient (exact for one image; for a batch, one label per sample from the
    ``batch_size`` most negative entries, a common approximation when labels repeat)."""
    bias = next((n for n in ("head.bias", "fc.bias", "classifier.bias") if n in grads), None)
    if bias is None:
        raise PrivacyError("label inference needs a classifier bias gradient (head.bias); use known labels")
    order = grads[bias].argsort()
    return order[:batch_size].sort().values if batch_size <= len(order) else order[torch.arange(batch_size) %
                                                                                    len(order)]


def shuffled_positions(model: nn.Module, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The MJP unknown-PE mask a one-image update leaks: the patch rows of dL/dE_pos that are exactly zero (those
    positions used the unknown PE instead). -> (1, N) bool."""
    if "pos_table" not in grads:
        raise PrivacyError("the model has no learnable PE table (pos_table): nothing to read the mask from")
    rows = grads["pos_table"][0, model.num_prefix_tokens:]
    return (rows == 0).all(dim=-1).unsqueeze(0)


# ---------------------------------------------------------------------------------------------- attacks
def _patch_size(model: nn.Module) -> int:
    return int(model.patch_embed.proj.kernel_size[0])


def analytic_attack(model: nn.Module, grads: dict[str, torch.Tensor], image_size: tuple[int, int]) -> torch.Tensor:
    """APRIL's closed-form reconstruction of ONE image from its update (MJP App. G Eq. 9): solve
    (dL/dE_pos)^T X = dL/dE for the patches X in the least-squares / minimum-norm sense, then fold them back.
    Needs a learnable additive PE (``pos_table``) and the patch projection's weight gradient. -> (1, C, H, W)."""
    if "pos_table" not in grads or "patch_embed.proj.weight" not in grads:
        raise PrivacyError("the analytic (APRIL) attack needs a learnable PE table and the patch projection "
                           "gradients; this model has no learned PE — use the gradient-matching attack")
    w = grads["patch_embed.proj.weight"]  # (D, C, p, p)
    g = grads["pos_table"][0, model.num_prefix_tokens:]  # (N, D): dL/dz0 of each patch token
    patches = torch.linalg.lstsq(g.T.double().cpu(), w.flatten(1).double().cpu(), driver="gelsd").solution
    p = _patch_size(model)
    image = F.fold(patches.T.unsqueeze(0).to(w.dtype), output_size=image_size, kernel_size=p, stride=p)
    return image.to(w.device)


def gradient_distance(grads: dict[str, torch.Tensor], target: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """Geiping et al.'s cosine distance 1 - <g, t> / (|g| |t|) over all parameters jointly, or DLG's squared L2."""
    if kind == "l2":
        return sum(((grads[n] - t) ** 2).sum() for n, t in target.items())
    dot = sum((grads[n] * t).sum() for n, t in target.items())
    norm_g = torch.sqrt(sum((grads[n] ** 2).sum() for n in target))
    norm_t = torch.sqrt(sum((t ** 2).sum() for t in target.values()))
    return 1 - dot / (norm_g * norm_t + 1e-12)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels (anisotropic TV), the image prior of the attack."""
    return ((images[..., 1:, :] - images[..., :-1, :]).abs().mean()
            + (images[..., :, 1:] - images[..., :, :-1]).abs().mean())


def gradient_matching_attack(model: nn.Module, target: dict[str, torch.Tensor], shape: tuple[int, ...], *,
                             labels: torch.Tensor | None = None, config: AttackConfig | None = None,
                             unknown_pos: torch.Tensor | None = None, bounds: tuple[float, float] | None = None,
                             progress: Callable[[int], None] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Optimize dummy images of ``shape`` whose client gradients match ``target``. ``labels``: the true labels
    when ``config.known_labels``, else inferred (:func:`infer_labels`). ``unknown_pos``: the MJP mask the client
    used (a one-image update leaks it: :func:`shuffled_positions`). ``bounds``: the data range of the (normalized)
    images. -> (images, {"gradient_distance", "labels", "restart"})."""
    cfg = (config or AttackConfig()).validate()
    device = next(model.parameters()).device
    target = {n: t.detach() for n, t in target.items()}
    if cfg.known_labels:
        if labels is None:
            raise PrivacyError("known_labels=True needs the labels; pass labels= or set known_labels=False")
    else:
        labels = infer_labels(model, target, shape[0])
    labels = labels.to(device)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    best: tuple[float, torch.Tensor, int] | None = None
    for restart in range(cfg.restarts):
        x = torch.randn(shape, generator=gen).to(device)
        if bounds is not None:
            x = x.clamp(*bounds)
        x.requires_grad_(True)
        objective = _matching_objective(model, target, labels, unknown_pos, cfg)
        x = _optimize(x, objective, cfg, bounds, progress)
        with sdpa_kernel(SDPBackend.MATH):
            final = float(gradient_distance(client_gradients(model, x, labels, unknown_pos), target, cfg.distance))
        if best is None or final < best[0]:
            best = (final, x.detach(), restart)
    assert best is not None
    return best[1], {"gradient_distance": best[0], "labels": labels.tolist(), "restart": best[2]}


def _matching_objective(model, target, labels, unknown_pos, cfg: AttackConfig) -> Callable[[torch.Tensor], Any]:
    def objective(x: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU SDPA kernels have no double backward
            grads = client_gradients(model, x, labels, unknown_pos, create_graph=True)
        return gradient_distance(grads, target, cfg.distance) + cfg.tv_weight * total_variation(x)
    return objective


def _optimize(x: torch.Tensor, objective, cfg: AttackConfig, bounds, progress) -> torch.Tensor:
    if cfg.optimizer == "lbfgs":
        opt = torch.optim.LBFGS([x], lr=cfg.lr, max_iter=1, history_size=100, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = objective(x)
            loss.backward()
            return loss

        for step in range(cfg.steps):
            opt.step(closure)
            _box(x, bounds)
            if progress:
                progress(step)
        return x
    opt = torch.optim.Adam([x], lr=cfg.lr)
    milestones = [int(cfg.steps * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    schedule = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1)
    for step in range(cfg.steps):
        opt.zero_grad()
        x.grad = torch.autograd.grad(objective(x), x)[0].sign()  # signed gradients (Geiping et al. §4)
        opt.step()
        schedule.step()
        _box(x, bounds)
        if progress:
            progress(step)
    return x


def _box(x: torch.Tensor, bounds: tuple[float, float] | None) -> None:
    if bounds is not None:
        with torch.no_grad():
            x.clamp_(*bounds)


# ---------------------------------------------------------------------------------------------- metrics
def fft2d_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of the 2D FFT magnitude spectra of two (C, H, W) images (FFT2D of MJP Table 5). The MJP
    code takes a cosine of the raw complex spectra; with a Hermitian product that equals the pixel-space cosine
    (Parseval), so we compare magnitudes, which is what "similar in the Fourier space" can add to MSE."""
    fa, fb = np.abs(np.fft.fft2(a)).ravel(), np.abs(np.fft.fft2(b)).ravel()
    return float(fa @ fb / (np.linalg.norm(fa) * np.linalg.norm(fb) + 1e-12))


def image_similarity(reconstruction: torch.Tensor, original: torch.Tensor) -> dict[str, Any]:
    """MSE, PSNR (dB), SSIM (scikit-image, data range 1) and FFT2D between (B, C, H, W) images in [0, 1]; means
    over the batch plus the per-image values."""
    if reconstruction.shape != original.shape:
        raise PrivacyError(f"reconstruction {tuple(reconstruction.shape)} and original {tuple(original.shape)} "
                           "differ in shape")
    metrics = _skimage_metrics()
    rec = reconstruction.detach().float().cpu().clamp(0, 1).numpy().astype(np.float64)
    org = original.detach().float().cpu().clamp(0, 1).numpy().astype(np.float64)
    per: dict[str, list[float]] = {"mse": [], "psnr": [], "ssim": [], "fft2d": []}
    for r, o in zip(rec, org, strict=True):
        per["mse"].append(float(metrics.mean_squared_error(o, r)))
        # identical images: PSNR is infinite; capped at 100 dB so means stay finite
        per["psnr"].append(min(float(metrics.peak_signal_noise_ratio(o, r, data_range=1.0)), 100.0)
                           if per["mse"][-1] > 0 else 100.0)
        per["ssim"].append(float(metrics.structural_similarity(o, r, data_range=1.0, channel_axis=0)))
        per["fft2d"].append(fft2d_similarity(o, r))
    return {**{k: float(np.mean(v)) for k, v in per.items()}, "per_image": per}


# ---------------------------------------------------------------------------------------------- Table 5
@dataclass
class PrivacyResult:
    """Metrics per setting and attack, and the images in [0, 1] pixel space for a Fig. 5 style grid."""

    metrics: dict[str, dict[str, dict[str, Any]]]  # attack -> setting (a/b/c, random) -> image_similarity
    originals: torch.Tensor
    shuffled: torch.Tensor
    reconstructions: dict[str, dict[str, torch.Tensor]]  # attack -> "a" / "b" -> images
    info: dict[str, Any]


def privacy_settings(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, shuffled: torch.Tensor,
                     unknown_pos: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                     attack: AttackConfig | None = None, batch_size: int = 1, analytic: bool = True,
                     progress: Callable[[int], None] | None = None) -> PrivacyResult:
    """MJP Table 5 on ``images`` (normalized with ``mean`` / ``std`` per channel, (B, C, H, W)) and their masked
    jigsaw ``shuffled`` / ``unknown_pos`` (``patchplace.objectives.jigsaw``). Each client update holds
    ``batch_size`` images. (a) attack the update on x, compare with x; (b) attack the update on x~ (a model with an
    unknown PE gets ``unknown_pos``, as in its training; any other model just sees the shuffled images), compare
    with x~; (c) that reconstruction vs x. A random-image baseline (uniform noise vs the original) is scored for
    every setting. The analytic attack runs when ``analytic``, ``batch_size`` is 1 and the model has a learnable
    PE; the gradient-matching attack always."""
    cfg = (attack or AttackConfig()).validate()
    _skimage_metrics()  # before minutes of attack, not after them
    if batch_size < 1 or len(images) % batch_size:
        raise PrivacyError(f"batch_size {batch_size} must divide the {len(images)} images")
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    if m.shape[1] not in (1, images.shape[1]) or s.shape[1] != m.shape[1]:
        raise PrivacyError(f"mean / std need 1 or {images.shape[1]} values, got {len(mean)} / {len(std)}")

    def to_pixels(t: torch.Tensor) -> torch.Tensor:
        return t * s + m

    bounds = (float((-m / s).min()), float(((1 - m) / s).max()))  # normalized values of pixels 0 and 1
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    uses_unknown = getattr(model, "unknown_pos_embed", None) is not None
    attacks = ["gradient_matching"]
    if analytic and batch_size == 1 and "pos_table" in dict(model.named_parameters()):
        attacks.append("analytic")
    recon, distances = _attack_updates(model, images, labels, shuffled, unknown_pos if uses_unknown else None,
                                       batch_size, attacks, cfg, bounds, progress)
    stacked = {a: {k: torch.cat(v) for k, v in r.items()} for a, r in recon.items()}
    px, px_shuffled = to_pixels(images), to_pixels(shuffled)
    noise = torch.rand(px.shape, generator=torch.Generator().manual_seed(cfg.seed)).to(px.device)
    metrics = {a: {"a": image_similarity(to_pixels(r["a"]), px), "b": image_similarity(to_pixels(r["b"]), px_shuffled),
                   "c": image_similarity(to_pixels(r["b"]), px)} for a, r in stacked.items()}
    metrics["random"] = {"a": image_similarity(noise, px), "b": image_similarity(noise, px_shuffled),
                         "c": image_similarity(noise, px)}
    info = {"attack": asdict(cfg), "attacks": attacks, "batch_size": batch_size, "images": len(images),
            "unknown_pe_given": uses_unknown, "bounds": list(bounds),
            "gradient_distance": {k: float(np.mean(v)) for k, v in distances.items()}}
    return PrivacyResult(metrics, px.detach().cpu(), px_shuffled.detach().cpu(),
                         {a: {k: to_pixels(t).clamp(0, 1).detach().cpu() for k, t in r.items()}
                          for a, r in stacked.items()}, info)


def _attack_updates(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, shuffled: torch.Tensor,
                    unknown_pos: torch.Tensor | None, batch_size: int, attacks: list[str], cfg: AttackConfig,
                    bounds: tuple[float, float], progress: Callable[[int], None] | None
                    ) -> tuple[dict[str, dict[str, list[torch.Tensor]]], dict[str, list[float]]]:
    """Each client update of ``batch_size`` images attacked, setting (a) on ``images`` and (b) on ``shuffled``
    (with ``unknown_pos`` where the model has an unknown PE): the reconstructions per attack and setting, and the
    gradient-matching distance each reached."""
    recon: dict[str, dict[str, list[torch.Tensor]]] = {a: {"a": [], "b": []} for a in attacks}
    distances: dict[str, list[float]] = {"a": [], "b": []}
    updates = 0
    for start in range(0, len(images), batch_size):
        sl = slice(start, start + batch_size)
        for setting, x, mask in (("a", images[sl], None),
                                 ("b", shuffled[sl], unknown_pos[sl] if unknown_pos is not None else None)):
            grads = client_gradients(model, x, labels[sl], mask)
            rec, info = gradient_matching_attack(model, grads, tuple(x.shape), labels=labels[sl], config=cfg,
                                                 unknown_pos=mask, bounds=bounds)
            recon["gradient_matching"][setting].append(rec)
            distances[setting].append(info["gradient_distance"])
            if "analytic" in attacks:
                recon["analytic"][setting].append(analytic_attack(model, grads, tuple(x.shape[-2:])))
            updates += 1
            if progress:
                progress(updates)
    return recon, distances
