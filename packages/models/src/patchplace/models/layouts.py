"""The checkpoint layouts of the authors' released weights that :mod:`patchplace.models.convert` reads, as data.

Each :class:`Layout` says, citing the authors' model file: where the encoder's weights sit in the file (``entries``,
or ``encoders`` for I-JEPA / StoP, whose files hold a context and a target encoder), the encoder's keys and shapes
(``keys`` + :data:`BLOCK` per block + a final norm + an optional classifier head), which other keys are dropped and
by which rule (decoders, predictors, auxiliary heads, optimizer state), and what the converted checkpoint records
for evaluation (method, paper, pooled features, license, where the files are published).

Shapes are tuples of symbols: ``D`` width, ``H`` MLP hidden width, ``C`` input channels, ``P`` patch side, ``N``
patches, ``K`` classes; ``3*D`` and ``N+1`` are what they read as. Every layout's encoder is a pre-norm ViT whose
block keys are timm's (MAE / DropPos build it from timm 0.3.2's ``Block``; I-JEPA's, StoP's and MJP's own ``Block``
use the same names), so a converted file goes "authors' keys -> timm keys -> patchplace" through
:func:`~patchplace.models.timm_interop.from_timm_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Shape = tuple[str, ...]

# timm's Block (MAE / DropPos: timm 0.3.2; I-JEPA src/models/vision_transformer.py, StoP src/deit.py and MJP
# models/vit_timm.py define a Block with the same names): keys under blocks.{i}.
BLOCK: dict[str, Shape] = {
    "norm1.weight": ("D",), "norm1.bias": ("D",),
    "attn.qkv.weight": ("3*D", "D"), "attn.qkv.bias": ("3*D",),
    "attn.proj.weight": ("D", "D"), "attn.proj.bias": ("D",),
    "norm2.weight": ("D",), "norm2.bias": ("D",),
    "mlp.fc1.weight": ("H", "D"), "mlp.fc1.bias": ("H",),
    "mlp.fc2.weight": ("D", "H"), "mlp.fc2.bias": ("D",),
}
PATCH_EMBED: dict[str, Shape] = {"patch_embed.proj.weight": ("D", "C", "P", "P"), "patch_embed.proj.bias": ("D",)}
# the one LayerNorm after the blocks: "norm" (before pooling) or "fc_norm" (after the average pooling: MAE's and
# DropPos's fine-tuning with --global_pool, models_vit.py, which deletes "norm")
FINAL_NORMS: dict[str, dict[str, Shape]] = {name: {f"{name}.weight": ("D",), f"{name}.bias": ("D",)}
                                            for name in ("norm", "fc_norm")}
HEAD: dict[str, Shape] = {"head.weight": ("K", "D"), "head.bias": ("K",)}
# the standard ViT widths' head counts (ViT-Ti/S/B/L/H, I-JEPA's and StoP's ViT-g); another width needs num_heads
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # every layout's evaluation transform
# Resize 256 + CenterCrop 224: MAE util/datasets.py build_transform (crop_pct = 224 / 256), DeiT datasets.py, StoP
# logistic_eval.py init_pipe; at other sides StoP's rule (and timm's in1k_ijepa 448 px cfg): no margin, crop_pct 1
CROP_PCT_224 = 0.875

# Top-level entries of the authors' training checkpoints that hold no encoder weights (dropped: training state)
TRAINING_STATE = {
    "optimizer": "optimizer state", "opt": "optimizer state", "lr_scheduler": "scheduler state",
    "scaler": "AMP loss-scaler state", "loss_scaler": "AMP loss-scaler state", "amp": "AMP state",
    "epoch": "training record", "loss": "training record", "batch_size": "training record",
    "world_size": "training record", "lr": "training record", "max_accuracy": "training record",
    "args": "training arguments (argparse.Namespace)", "config": "training config (yacs CfgNode)",
}


@dataclass(frozen=True)
class Release:
    """One published file: its name, where it is published, what it holds."""

    file: str
    url: str
    what: str


@dataclass(frozen=True)
class MethodFacts:
    """What a converted checkpoint of a method records for evaluation. The method's registration in
    ``patchplace.objectives`` states the same facts, but that package depends on this one, never the reverse: written
    here, held to the registration by tests/test_method_facts.py (``finetune_pool`` may be finer: ``mean_fc_norm``)."""

    paper: str | None
    probe_feature: str  # the pooled feature its pretraining trained (probes read it)
    finetune_pool: str  # the feature its authors' fine-tuning puts the classifier head on
    trains_head: bool = False  # the method trains the classifier itself (MJP, DeiT): its head is no fine-tune's


METHODS: dict[str, MethodFacts] = {
    "mae": MethodFacts("He et al. 2022, Masked Autoencoders Are Scalable Vision Learners (arXiv:2111.06377)", "cls",
                       "mean_fc_norm"),  # main_finetune.py: --global_pool (default) = fresh fc_norm, no norm
    "droppos": MethodFacts("Wang et al. 2023, DropPos: Pre-Training Vision Transformers by Reconstructing Dropped "
                           "Positions (arXiv:2309.03576)", "cls", "mean_fc_norm"),  # MAE's main_finetune.py
    "ijepa": MethodFacts("Assran et al. 2023, Self-Supervised Learning from Images with a Joint-Embedding Predictive "
                         "Architecture (arXiv:2301.08243)", "patch_mean", "mean"),
    "stop": MethodFacts("Bar et al. 2024, Stochastic positional embeddings improve masked image modeling "
                        "(arXiv:2308.00566)", "patch_mean", "mean"),  # logistic_eval.py: mean of the normed tokens
    "mjp": MethodFacts("Ren et al. 2023, Masked Jigsaw Puzzle: A Versatile Position Embedding for Vision "
                       "Transformers (arXiv:2205.12551)", "cls", "cls", trains_head=True),
    "supervised": MethodFacts("Touvron et al. 2021, Training data-efficient image transformers & distillation "
                              "through attention (DeiT, arXiv:2012.12877)", "cls", "cls", trains_head=True),
}


@dataclass(frozen=True)
class Layout:
    """One released layout (see the module docstring)."""

    name: str  # the converter's --from
    display: str
    method: str | None  # METHODS key the converted checkpoint records (timm: given by the user)
    source: str  # the authors' files this table is read from
    keys: dict[str, Shape]  # the encoder's keys outside the blocks
    pos_key: str | None  # the additive PE table among keys
    entries: tuple[str, ...] = ("model",)  # entries the weights sit in, first found wins (or the top level)
    encoders: dict[str, str] = field(default_factory=dict)  # I-JEPA / StoP: encoder choice -> entry
    optional: frozenset[str] = frozenset()  # keys of ``keys`` (or of every block) that may be absent
    unknown_row: bool = False  # MJP: the PE table's last row is the unknown-position PE
    dropped: tuple[tuple[str, str], ...] = ()  # (regex on the weights' keys, rule)
    other_entries: dict[str, str] = field(default_factory=dict)  # top-level entries besides the weights: rule
    refused: tuple[tuple[str, str], ...] = ()  # (regex on keys, what patchplace backbones lack)
    license: str = "unknown"  # Hugging Face Hub license id of the weights
    releases: tuple[Release, ...] = ()

    def encoder_keys(self, depth: int, final_norm: str, head: bool) -> dict[str, Shape]:
        """Every key of the encoder with ``depth`` blocks, its final norm and (``head``) its classifier."""
        keys = {**self.keys, **PATCH_EMBED}
        keys.update({f"blocks.{i}.{k}": v for i in range(depth) for k, v in BLOCK.items()})
        keys.update(FINAL_NORMS[final_norm])
        return {**keys, **(HEAD if head else {})}


MAE_DECODER = r"^(decoder_(embed|pos_embed|blocks|norm|pred)\b.*|mask_token)$"
# keys timm ViTs may hold that patchplace backbones do not express (timm_interop._refuse names the same features)
TIMM_REFUSED = (
    (r"^(dist_token|head_dist\..*)$", "DeiT's distillation token and head"),
    (r"^reg_token$", "register tokens"),
    (r"\.ls[12]\.(gamma|weight)$", "LayerScale"),
    (r"\.attn\.(q_norm|k_norm)\.", "q/k norm"),
    (r"^norm_pre\.", "a pre-norm after the embedding"),
    (r"^attn_pool\.", "attention pooling"),
    (r"^pre_logits\.", "a pre-logits layer"),
    (r"^index_embed$", "MJP's index embedding (use_idx_emb)"),
)

LAYOUTS: dict[str, Layout] = {
    "mae": Layout(
        "mae", "MAE", "mae",
        "facebookresearch/mae models_mae.py (MaskedAutoencoderViT: encoder + decoder_* / mask_token), models_vit.py "
        "(VisionTransformer: --global_pool replaces norm by fc_norm), main_finetune.py / util/misc.py "
        "(checkpoint['model'])",
        keys={"cls_token": ("1", "1", "D"), "pos_embed": ("1", "N+1", "D")}, pos_key="pos_embed",
        dropped=((MAE_DECODER, "MAE's decoder (pretraining only: reconstructs pixels)"),),
        refused=TIMM_REFUSED, license="cc-by-nc-4.0",
        releases=(
            Release("mae_pretrain_vit_base.pth", "https://dl.fbaipublicfiles.com/mae/pretrain/mae_pretrain_vit_base.pth",
                    "ViT-B/16 pretrained encoder (also _large, _huge: ViT-L/16, ViT-H/14)"),
            Release("mae_finetuned_vit_base.pth",
                    "https://dl.fbaipublicfiles.com/mae/finetune/mae_finetuned_vit_base.pth",
                    "ViT-B/16 fine-tuned on ImageNet-1k (fc_norm + head)"),
            Release("mae_visualize_vit_large.pth",
                    "https://dl.fbaipublicfiles.com/mae/visualize/mae_visualize_vit_large.pth",
                    "ViT-L/16 encoder with its decoder (the decoder is dropped)"))),
    "droppos": Layout(
        "droppos", "DropPos", "droppos",
        "Haochen-Wang409/DropPos models_DropPos_mae.py (DropPositionMaskedAutoEncoderViT: encoder, mask_pos_token, "
        "decoder_* predicting positions, aux_decoder_* / mask_token with --multi_task), models_vit.py "
        "(VisionTransformer, fc_norm with --global_pool), main_pretrain.py / main_finetune.py "
        "(checkpoint['state_dict'] with DDP 'module.' names, 'model' = the model's name)",
        keys={"cls_token": ("1", "1", "D"), "pos_embed": ("1", "N+1", "D")}, pos_key="pos_embed",
        entries=("state_dict", "model"),
        dropped=((r"^(decoder_(embed|blocks|norm|pred)\b.*|mask_pos_token)$",
                  "DropPos's position decoder and position mask token (pretraining only)"),
                 (r"^(aux_decoder_.*|mask_token)$", "DropPos's multi-task MAE decoder (pretraining only)")),
        other_entries={"model": "the model's name (args.model)",
                       "ema_state_dict": "the EMA teacher's weights (not converted)"},
        refused=TIMM_REFUSED, license="apache-2.0",
        releases=(Release("DropPos ViT-B/16 and ViT-L/16, pretrained and fine-tuned",
                          "https://pan.baidu.com/s/1xj9XiHgagKGJrJt88IfhLw?pwd=4gik",
                          "the link of the DropPos README (fetch code 4gik)"),)),
    "ijepa": Layout(
        "ijepa", "I-JEPA", "ijepa",
        "facebookresearch/ijepa src/models/vision_transformer.py (VisionTransformer: no class token, fixed 2-D "
        "sin-cos pos_embed; VisionTransformerPredictor), src/train.py save_checkpoint (encoder, predictor, "
        "target_encoder, opt, scaler, epoch, loss, batch_size, world_size, lr; DDP 'module.' names)",
        keys={"pos_embed": ("1", "N", "D")}, pos_key="pos_embed", entries=(),
        encoders={"target": "target_encoder", "context": "encoder"},
        other_entries={"predictor": "the predictor (pretraining only)"},
        refused=TIMM_REFUSED, license="cc-by-nc-4.0",
        releases=(
            Release("IN1K-vit.h.14-300e.pth.tar", "https://dl.fbaipublicfiles.com/ijepa/IN1K-vit.h.14-300e.pth.tar",
                    "ViT-H/14, ImageNet-1k, 300 epochs"),
            Release("IN1K-vit.h.16-448px-300e.pth.tar",
                    "https://dl.fbaipublicfiles.com/ijepa/IN1K-vit.h.16-448px-300e.pth.tar",
                    "ViT-H/16 at 448 px, ImageNet-1k"),
            Release("IN22K-vit.h.14-900e.pth.tar", "https://dl.fbaipublicfiles.com/ijepa/IN22K-vit.h.14-900e.pth.tar",
                    "ViT-H/14, ImageNet-22k"),
            Release("IN22K-vit.g.16-600e.pth.tar", "https://dl.fbaipublicfiles.com/ijepa/IN22K-vit.g.16-600e.pth.tar",
                    "ViT-g/16, ImageNet-22k"))),
    "stop": Layout(
        "stop", "StoP", "stop",
        "amirbar/StoP src/deit.py (VisionTransformer: I-JEPA's keys; VisionTransformerPredictor), main.py "
        "save_checkpoint (I-JEPA's entries), logistic_eval.py (evaluates checkpoint['target_encoder'])",
        keys={"pos_embed": ("1", "N", "D")}, pos_key="pos_embed", entries=(),
        encoders={"target": "target_encoder", "context": "encoder"},
        other_entries={"predictor": "the predictor (pretraining only)"},
        refused=TIMM_REFUSED,
        releases=(
            Release("vit-b16.pth.tar", "https://huggingface.co/amirbar1/StoP/resolve/main/vit-b16.pth.tar",
                    "ViT-B/16, ImageNet-1k, 600 epochs"),
            Release("vit-l16.pth.tar", "https://huggingface.co/amirbar1/StoP/resolve/main/vit-l16.pth.tar",
                    "ViT-L/16, ImageNet-1k, 600 epochs"),
            Release("vit-h16.pth.tar", "https://huggingface.co/amirbar1/StoP/resolve/main/vit-h16.pth.tar",
                    "ViT-H/16, ImageNet-1k, 300 epochs"))),
    "mjp": Layout(
        "mjp", "MJP", "mjp",
        "yhlleo/MJP models/vit_timm.py (VisionTransformer with use_unk: pos_embed = nn.Embedding(num_patches + 2, "
        "D), row 0 the class token's, the last the unknown position's; dlocr = ssl/dlocr.py DenseLocRegress), "
        "utils.py save_checkpoint (checkpoint['model'], 'config' a yacs CfgNode)",
        keys={"cls_token": ("1", "1", "D"), "pos_embed.weight": ("N+2", "D")}, pos_key="pos_embed.weight",
        unknown_row=True,
        dropped=((r"^dlocr\..*$", "MJP's dense localization head (DenseLocRegress: a training loss on the PE)"),),
        refused=TIMM_REFUSED,
        releases=(Release("MJP ViT-S/16 (DeiT-S) checkpoints",
                          "https://drive.google.com/drive/folders/1P6LnqhLTyG7CRcb7_NsFDVmQ1cOFoNeV",
                          "the folder of the MJP README"),)),
    "timm": Layout(
        "timm", "timm ViT", None,
        "timm models/vision_transformer.py (VisionTransformer; DeiT: facebookresearch/deit models.py, "
        "checkpoint['model'])",
        keys={"cls_token": ("1", "1", "D"), "pos_embed": ("1", "N+T", "D")}, pos_key="pos_embed",
        entries=("model", "state_dict"), optional=frozenset({"cls_token", "pos_embed", "attn.qkv.bias"}),
        refused=TIMM_REFUSED,
        releases=(Release("deit_small_patch16_224-cd65a155.pth",
                          "https://dl.fbaipublicfiles.com/deit/deit_small_patch16_224-cd65a155.pth",
                          "DeiT-S, ImageNet-1k (also deit_tiny / deit_base)"),)),
}
