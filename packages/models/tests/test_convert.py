"""``python -m patchplace.models.convert``: the authors' released layouts, converted and checked against a reference
that is not the converter.

Each layout's file is built here from the authors' key names and shapes, written down below as data (the authors'
model files are cited per builder), randomly initialised, at the real widths (ViT-B 768, DeiT-S 384, ViT-H 1280)
and a reduced depth. The reference loads the same file by another route: timm's own loader of that layout where timm
has one (MAE: ``checkpoint['model']``; I-JEPA: the ``encoder`` entry with DDP names; DeiT), else a forward written
from the authors' model definition (:func:`authors_encoder`: DropPos, StoP, MJP with its unknown-position row).
Features compared: the final-normed token sequence and the head's logits, float32, eval mode, within 1e-5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import checkpoint_filter_fn

from patchplace.models import ModelError, load_pretrained, sincos_2d, timm_data_config, timm_transform
from patchplace.models.convert import convert_checkpoint, main, read_file


@pytest.fixture(autouse=True)
def _no_grad():
    """Forward passes only: no autograd graph (scoped to each test, so other files in the process keep grad on)."""
    with torch.no_grad():
        yield


# ------------------------------------------------------------------------------------ the authors' layouts
def _randn(*shape: int, scale: float = 0.02) -> torch.Tensor:
    return torch.randn(*shape) * scale


def _norm(prefix: str, d: int) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": 1 + _randn(d, scale=0.1), f"{prefix}.bias": _randn(d)}


def vit_block(prefix: str, d: int, hidden: int) -> dict[str, torch.Tensor]:
    """timm 0.3.2's Block (MAE / DropPos), I-JEPA src/models/vision_transformer.py Block, StoP src/deit.py Block,
    MJP models/vit_timm.py Block: norm1, attn.qkv (bias), attn.proj, norm2, mlp.fc1, mlp.fc2."""
    return {**_norm(f"{prefix}norm1", d), f"{prefix}attn.qkv.weight": _randn(3 * d, d),
            f"{prefix}attn.qkv.bias": _randn(3 * d), f"{prefix}attn.proj.weight": _randn(d, d),
            f"{prefix}attn.proj.bias": _randn(d), **_norm(f"{prefix}norm2", d),
            f"{prefix}mlp.fc1.weight": _randn(hidden, d), f"{prefix}mlp.fc1.bias": _randn(hidden),
            f"{prefix}mlp.fc2.weight": _randn(d, hidden), f"{prefix}mlp.fc2.bias": _randn(d)}


def vit_encoder(d: int, depth: int, patch: int, grid: int, *, cls: bool = True, chans: int = 3,
                pos: torch.Tensor | None = None, final: str = "norm", classes: int = 0) -> dict[str, torch.Tensor]:
    """The encoder every layout shares: patch_embed.proj (Conv2d), [cls_token], pos_embed, blocks.{i}, norm or
    fc_norm, [head]. ``pos`` defaults to MAE's fixed 2-D sin-cos table (util/pos_embed.py, zero class-token row)."""
    table = torch.cat([torch.zeros(int(cls), d), sincos_2d((grid, grid), d)]) if pos is None else pos
    out = {"patch_embed.proj.weight": _randn(d, chans, patch, patch), "patch_embed.proj.bias": _randn(d),
           **({"cls_token": _randn(1, 1, d)} if cls else {}), "pos_embed": table.reshape(1, -1, d)}
    for i in range(depth):
        out.update(vit_block(f"blocks.{i}.", d, 4 * d))
    out.update(_norm(final, d))
    if classes:
        out.update({"head.weight": _randn(classes, d), "head.bias": _randn(classes)})
    return out


def mae_decoder(d: int, dd: int, depth: int, n: int, out: int) -> dict[str, torch.Tensor]:
    """MAE models_mae.py MaskedAutoencoderViT's decoder: decoder_embed, mask_token, decoder_pos_embed,
    decoder_blocks.{i}, decoder_norm, decoder_pred (P * P * C pixels)."""
    dec = {"decoder_embed.weight": _randn(dd, d), "decoder_embed.bias": _randn(dd), "mask_token": _randn(1, 1, dd),
           "decoder_pos_embed": _randn(1, n + 1, dd), **_norm("decoder_norm", dd),
           "decoder_pred.weight": _randn(out, dd), "decoder_pred.bias": _randn(out)}
    for i in range(depth):
        dec.update(vit_block(f"decoder_blocks.{i}.", dd, 4 * dd))
    return dec


def mae_file(depth: int = 2, *, decoder: bool = False, finetuned: bool = False) -> dict:
    """MAE ViT-B/16 (models_vit.vit_base_patch16 / models_mae.mae_vit_base_patch16_dec512d8b), as released:
    {'model': ...}; the fine-tuned one (main_finetune.py --global_pool) has fc_norm + head and no norm."""
    enc = vit_encoder(768, depth, 16, 14, final="fc_norm" if finetuned else "norm", classes=1000 if finetuned else 0)
    if finetuned:
        enc["pos_embed"] = enc["pos_embed"] + _randn(1, 197, 768)  # fine-tuning trains the (learned) pos_embed
    return {"model": {**enc, **(mae_decoder(768, 512, 1, 196, 16 * 16 * 3) if decoder else {})}}


def droppos_file(depth: int = 2) -> dict:
    """DropPos ViT-B/16 (models_DropPos_mae.py DropPositionMaskedAutoEncoderViT, multi_task=True): encoder,
    mask_pos_token, decoder_* predicting one of N positions, aux_decoder_* + mask_token (MAE's decoder); saved by
    main_pretrain.py as {'epoch', 'state_dict' (DDP: 'module.' names), 'optimizer', 'model': the model's name}."""
    enc = vit_encoder(768, depth, 16, 14)
    dec = mae_decoder(768, 512, 1, 196, 196)
    dec = {k: v for k, v in dec.items() if k not in ("mask_token", "decoder_pos_embed")}  # no decoder PE (DropPos)
    aux = {("aux_" + k if k.startswith("decoder") else k): v for k, v in mae_decoder(768, 512, 1, 196, 768).items()}
    state = {**enc, "mask_pos_token": _randn(1, 1, 768), **dec, **aux}
    return {"epoch": 800, "state_dict": {f"module.{k}": v for k, v in state.items()},
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]},
            "model": "DropPos_mae_vit_base_patch16"}


def ijepa_file(d: int = 1280, patch: int = 14, grid: int = 16, depth: int = 1) -> dict:
    """I-JEPA (src/models/vision_transformer.py VisionTransformer: no class token, fixed sin-cos pos_embed (1, N, D);
    VisionTransformerPredictor: predictor_embed, mask_token, predictor_pos_embed, predictor_blocks, predictor_norm,
    predictor_proj) saved by src/train.py: encoder, predictor, target_encoder (DDP 'module.' names), opt, scaler,
    epoch, loss, batch_size, world_size, lr. StoP (src/deit.py, main.py) writes the same."""
    def ddp(state: dict) -> dict:
        return {f"module.{k}": v for k, v in state.items()}

    pd = 384
    predictor = {"predictor_embed.weight": _randn(pd, d), "predictor_embed.bias": _randn(pd),
                 "mask_token": _randn(1, 1, pd), "predictor_pos_embed": _randn(1, grid * grid, pd),
                 **vit_block("predictor_blocks.0.", pd, 4 * pd), **_norm("predictor_norm", pd),
                 "predictor_proj.weight": _randn(d, pd), "predictor_proj.bias": _randn(d)}
    return {"encoder": ddp(vit_encoder(d, depth, patch, grid, cls=False)), "predictor": ddp(predictor),
            "target_encoder": ddp(vit_encoder(d, depth, patch, grid, cls=False)),
            "opt": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]}, "scaler": None, "epoch": 300,
            "loss": 0.25, "batch_size": 128, "world_size": 16, "lr": 1e-3}


def mjp_file(depth: int = 2) -> dict:
    """MJP DeiT-S/16 (models/vit_timm.py VisionTransformer, use_unk + use_dlocr): pos_embed = nn.Embedding(196 + 2,
    384) (row 0: class token, 1..196: patches, 197: unknown), dlocr = ssl/dlocr.py DenseLocRegress (linear:
    layers.weight (2, D)); utils.py save_checkpoint: model, optimizer, lr_scheduler, max_accuracy, epoch, config
    (a yacs CfgNode)."""
    enc = vit_encoder(384, depth, 16, 14, pos=_randn(197, 384), classes=1000)
    enc.pop("pos_embed")
    enc["pos_embed.weight"] = _randn(198, 384)
    state = {**enc, "dlocr.layers.weight": _randn(2, 384), "dlocr.layers.bias": _randn(2)}
    return {"model": state, "optimizer": {"state": {}, "param_groups": []}, "lr_scheduler": {"last_epoch": 299},
            "max_accuracy": 79.1, "epoch": 299, "config": yacs_config()}


class CfgNode(dict):
    """yacs' CfgNode as MJP's config.py builds it: a dict subclass of module yacs.config (pickled by that name)."""

    def __init__(self, init: dict | None = None) -> None:
        super().__init__(init or {})
        self.__dict__["__immutable__"] = False


CfgNode.__module__, CfgNode.__qualname__ = "yacs.config", "CfgNode"


def yacs_config() -> CfgNode:
    return CfgNode({"MODEL": CfgNode({"TYPE": "vit_s_16"}), "TRAIN": CfgNode({"USE_UNK_POS": True})})


def deit_file(depth: int = 2) -> dict:
    """DeiT-S/16 (facebookresearch/deit models.py deit_small_patch16_224 = timm's VisionTransformer keys, learned
    pos_embed), released as {'model': ...}."""
    return {"model": vit_encoder(384, depth, 16, 14, pos=_randn(197, 384), classes=1000)}


def save(obj: dict, path: Path) -> Path:
    """torch.save as the authors' code ran it (yacs.config importable while a CfgNode is pickled)."""
    added = {name: module for name, module in (("yacs", types.ModuleType("yacs")),
                                               ("yacs.config", types.ModuleType("yacs.config")))
             if name not in sys.modules}
    if "yacs.config" in added:
        added["yacs.config"].CfgNode = CfgNode
    sys.modules.update(added)
    try:
        torch.save(obj, path)
    finally:
        for name in added:
            del sys.modules[name]
    return path


# ------------------------------------------------------------------------- the reference: the authors' forward
def authors_block(x: torch.Tensor, sd: dict, p: str, heads: int) -> torch.Tensor:
    """Block.forward of the authors' files: x + attn(norm1(x)); x + mlp(norm2(x)); attention as their Attention
    (qkv -> (3, B, heads, N, d), softmax(q k^T * d^-0.5) v, proj), GELU MLP, LayerNorm eps 1e-6."""
    b, n, c = x.shape
    y = F.layer_norm(x, (c,), sd[f"{p}norm1.weight"], sd[f"{p}norm1.bias"], 1e-6)
    qkv = F.linear(y, sd[f"{p}attn.qkv.weight"], sd[f"{p}attn.qkv.bias"])
    q, k, v = qkv.reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * (c // heads) ** -0.5).softmax(dim=-1)
    x = x + F.linear((attn @ v).transpose(1, 2).reshape(b, n, c), sd[f"{p}attn.proj.weight"], sd[f"{p}attn.proj.bias"])
    y = F.layer_norm(x, (c,), sd[f"{p}norm2.weight"], sd[f"{p}norm2.bias"], 1e-6)
    return x + F.linear(F.gelu(F.linear(y, sd[f"{p}mlp.fc1.weight"], sd[f"{p}mlp.fc1.bias"])),
                        sd[f"{p}mlp.fc2.weight"], sd[f"{p}mlp.fc2.bias"])


def authors_encoder(sd: dict, x: torch.Tensor, heads: int, unk_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The encoders' forward, as the authors wrote it: DropPos forward_encoder without masking (patches + pos[1:],
    cls + pos[:1]); StoP deit.py VisionTransformer.forward (patches + pos_embed, no class token, K=1); MJP
    vit_timm.py forward_features (cat(cls, patches) + pos_embed(seq_ord), seq_ord = the unknown row where
    ``unk_mask`` (B, 1 + N) is 1). Returns the final-normed tokens."""
    w = sd["patch_embed.proj.weight"]
    t = F.conv2d(x, w, sd["patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    if "pos_embed.weight" in sd:  # MJP: nn.Embedding rows indexed by position (last row: unknown)
        t = torch.cat([sd["cls_token"].expand(len(t), -1, -1), t], dim=1)
        order = torch.arange(t.shape[1])[None].expand(len(t), -1)
        if unk_mask is not None:
            order = order * (1 - unk_mask) + unk_mask * (sd["pos_embed.weight"].shape[0] - 1)
        t = t + F.embedding(order, sd["pos_embed.weight"])
    elif "cls_token" in sd:
        t = t + sd["pos_embed"][:, 1:]
        t = torch.cat([(sd["cls_token"] + sd["pos_embed"][:, :1]).expand(len(t), -1, -1), t], dim=1)
    else:
        t = t + sd["pos_embed"]
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        t = authors_block(t, sd, f"blocks.{i}.", heads)
    if "fc_norm.weight" in sd:  # models_vit.py with --global_pool: no norm; the tokens the pooling averages
        return t
    return F.layer_norm(t, (t.shape[-1],), sd["norm.weight"], sd["norm.bias"], 1e-6)


def converted(file: Path, layout: str, out: Path, **kwargs):
    conv = convert_checkpoint(file, layout, out, **kwargs)
    model, metadata = load_pretrained(out)
    return conv, model.eval(), metadata


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def timm_reference(name: str, file_obj: dict, **kwargs) -> torch.nn.Module:
    """timm's model of ``name`` loaded from the authors' file by timm's own checkpoint filter, strictly."""
    model = timm.create_model(name, pretrained=False, **kwargs)
    model.load_state_dict(checkpoint_filter_fn(file_obj, model), strict=True)
    return model.eval()


# -------------------------------------------------------------------------------------- per layout: exactness
def test_mae_pretrained_matches_timms_mae_route_and_drops_the_decoder(tmp_path):
    torch.manual_seed(0)
    released = mae_file()
    with_decoder = {"model": {**released["model"], **mae_decoder(768, 512, 1, 196, 768)}}
    conv, ours, meta = converted(save(with_decoder, tmp_path / "mae_visualize.pth"), "mae", tmp_path / "out")
    ref = timm_reference("vit_base_patch16_224", released, depth=2, num_classes=0)  # the encoder-only release
    x = torch.randn(2, 3, 224, 224)
    assert max_diff(ours.forward_features(x), ref.forward_features(x)) < 1e-5
    decoder = {k for k in with_decoder["model"] if k.startswith("decoder_") or k == "mask_token"}
    assert set(conv.dropped["MAE's decoder (pretraining only: reconstructs pixels)"]) == decoder
    assert set(conv.used) == set(released["model"]) and conv.config.pos_embed == "sincos2d"
    assert (meta["method"], meta["probe_feature"], meta["finetune_pool"]) == ("mae", "cls", "mean_fc_norm")
    assert meta["normalization"]["mean"] == [0.485, 0.456, 0.406] and meta["crop_pct"] == 0.875
    assert meta["license"] == "cc-by-nc-4.0" and "arXiv:2111.06377" in meta["paper"]
    assert meta["converted_from"]["sha256"].startswith("sha256:") and "classes" not in meta
    assert "license: cc-by-nc-4.0" in (tmp_path / "out" / "README.md").read_text()
    # the recorded eval transform is MAE's (util/datasets.py build_transform, is_train=False): Resize(256, bicubic),
    # CenterCrop(224), ToTensor, Normalize(ImageNet) — timm's transform of the checkpoint and ours give its tensor
    from PIL import Image
    from torchvision import transforms

    image = Image.fromarray(torch.randint(0, 256, (300, 400, 3), dtype=torch.uint8).numpy())
    authors = transforms.Compose([transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
                                  transforms.CenterCrop(224), transforms.ToTensor(),
                                  transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])(image)
    assert torch.equal(timm_transform(tmp_path / "out")(image), authors)
    assert torch.equal(timm.data.create_transform(**timm_data_config(tmp_path / "out"))(image), authors)


def test_mae_finetuned_fc_norm_and_head_match_timm(tmp_path):
    torch.manual_seed(1)
    file = mae_file(finetuned=True)
    conv, ours, meta = converted(save(file, tmp_path / "mae_finetuned.pth"), "mae", tmp_path / "out")
    ref = timm_reference("vit_base_patch16_224", file, depth=2, global_pool="avg", fc_norm=True)
    x = torch.randn(2, 3, 224, 224)
    assert max_diff(ours.forward_features(x), ref.forward_features(x)) < 1e-5
    assert max_diff(ours(x), ref(x)) < 1e-5
    c = conv.config
    assert (c.fc_norm, c.global_pool, c.num_classes, c.pos_embed) == (True, "mean", 1000, "learned")
    assert meta["method"] == "finetune:mae" and meta["finetune_pool"] == "mean_fc_norm"
    assert meta["pretrain_metadata"]["method"] == "mae" and meta["classes"][:2] == ["n01440764", "n01443537"]


@pytest.mark.parametrize("encoder", ["target", "context"])
def test_ijepa_vit_h_matches_timms_ijepa_route_for_either_encoder(tmp_path, encoder):
    torch.manual_seed(2)
    file = ijepa_file()
    conv, ours, meta = converted(save(file, tmp_path / "IN1K-vit.h.14-300e.pth.tar"), "ijepa", tmp_path / "out",
                                 **({"encoder": encoder} if encoder == "context" else {}))
    entry = {"target": "target_encoder", "context": "encoder"}[encoder]
    # timm's I-JEPA route reads the 'encoder' entry (the context encoder); the target encoder goes through it too
    ref = timm_reference("vit_huge_patch14_gap_224", {"encoder": file[entry]}, depth=1, num_classes=0)
    x = torch.randn(2, 3, 224, 224)
    assert max_diff(ours.forward_features(x), ref.forward_features(x)) < 1e-5
    other = {"target": "encoder", "context": "target_encoder"}[encoder]
    assert conv.entry == entry and conv.dropped[f"the {'context' if encoder == 'target' else 'target'} encoder "
                                                f"(--encoder {'context' if encoder == 'target' else 'target'} "
                                                "converts it)"] == [f"[{other}]"]
    assert conv.dropped["the predictor (pretraining only)"] == ["[predictor]"]
    assert conv.dropped["optimizer state"] == ["[opt]"] and meta["converted_from"]["epoch"] == 300
    c = conv.config
    assert (c.class_token, c.global_pool, c.pos_embed, c.embed_dim, c.num_heads) == (False, "mean", "sincos2d", 1280,
                                                                                     16)
    assert (meta["probe_feature"], meta["finetune_pool"]) == ("patch_mean", "mean")
    assert meta["converted_from"]["entry"] == entry


def test_stop_target_encoder_matches_the_authors_forward(tmp_path):
    torch.manual_seed(3)
    file = ijepa_file(d=768, patch=16, grid=14, depth=2)
    _, ours, meta = converted(save(file, tmp_path / "vit-b16.pth.tar"), "stop", tmp_path / "out")
    target = {k.removeprefix("module."): v for k, v in file["target_encoder"].items()}
    x = torch.randn(2, 3, 224, 224)
    assert max_diff(ours.forward_features(x), authors_encoder(target, x, heads=12)) < 1e-5
    assert meta["method"] == "stop" and "arXiv:2308.00566" in meta["paper"]


def test_droppos_matches_the_authors_forward_and_drops_both_decoders(tmp_path):
    torch.manual_seed(4)
    file = droppos_file()
    conv, ours, meta = converted(save(file, tmp_path / "droppos.pth"), "droppos", tmp_path / "out")
    state = {k.removeprefix("module."): v for k, v in file["state_dict"].items()}
    x = torch.randn(2, 3, 224, 224)
    assert max_diff(ours.forward_features(x), authors_encoder(state, x, heads=12)) < 1e-5
    dropped = {k for keys in conv.dropped.values() for k in keys}
    assert dropped == {k for k in state if k.startswith(("decoder_", "aux_decoder_", "mask"))} | {
        "[epoch]", "[optimizer]", "[model]"}
    assert conv.entry == "state_dict" and meta["license"] == "apache-2.0" and meta["finetune_pool"] == "mean_fc_norm"


def test_droppos_finetuned_fc_norm_head_matches_the_authors_forward(tmp_path):
    """DropPos main_finetune.py's checkpoint: models_vit.py VisionTransformer with --global_pool (fc_norm) and the
    fixed sin-cos pos_embed it keeps (fix_pos_emb=False), {'epoch', 'state_dict' (DDP), 'optimizer', 'model'}."""
    torch.manual_seed(11)
    state = vit_encoder(768, 1, 16, 14, final="fc_norm", classes=1000)
    file = {"epoch": 100, "state_dict": {f"module.{k}": v for k, v in state.items()}, "optimizer": {"state": {}},
            "model": "vit_base_patch16"}
    conv, ours, meta = converted(save(file, tmp_path / "droppos_ft.pth"), "droppos", tmp_path / "out")
    x = torch.randn(2, 3, 224, 224)
    tokens = authors_encoder(state, x, heads=12)
    pooled = F.layer_norm(tokens[:, 1:].mean(dim=1), (768,), state["fc_norm.weight"], state["fc_norm.bias"], 1e-6)
    assert max_diff(ours.forward_features(x), tokens) < 1e-5
    assert max_diff(ours(x), F.linear(pooled, state["head.weight"], state["head.bias"])) < 1e-5
    c = conv.config
    assert (c.fc_norm, c.global_pool, c.pos_embed, c.num_classes) == (True, "mean", "sincos2d", 1000)
    assert meta["method"] == "finetune:droppos" and meta["finetune_pool"] == "mean_fc_norm"


def test_mjp_unknown_row_and_head_match_the_authors_forward(tmp_path):
    torch.manual_seed(5)
    file = mjp_file()
    conv, ours, meta = converted(save(file, tmp_path / "mjp.pth"), "mjp", tmp_path / "out")
    state = file["model"]
    x = torch.randn(2, 3, 224, 224)
    unknown = torch.rand(2, 196) < 0.3
    mask = torch.cat([torch.zeros(2, 1, dtype=torch.long), unknown.long()], dim=1)  # MJP never hides the class token
    for patches, rows in ((None, None), (unknown, mask)):
        theirs = authors_encoder(state, x, heads=6, unk_mask=rows)
        assert max_diff(ours.forward_features(x, unknown_pos=patches), theirs) < 1e-5
        logits = F.linear(theirs[:, 0], state["head.weight"], state["head.bias"])
        assert max_diff(ours(x, unknown_pos=patches), logits) < 1e-5
    assert conv.config.unknown_pos and (tmp_path / "out" / "extras.safetensors").is_file()
    assert conv.dropped["MJP's dense localization head (DenseLocRegress: a training loss on the PE)"] == [
        "dlocr.layers.weight", "dlocr.layers.bias"]
    assert conv.dropped["training config (yacs CfgNode)"] == ["[config]"]
    assert meta["method"] == "mjp" and meta["probe_feature"] == "cls" and len(meta["classes"]) == 1000  # trained


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_deit_through_the_timm_layout_matches_timms_deit_route(tmp_path, suffix):
    torch.manual_seed(6)
    file = deit_file()
    path = tmp_path / f"deit_small_patch16_224{suffix}"
    if suffix == ".safetensors":  # a timm hub file: the flat state dict
        from safetensors.torch import save_file

        save_file(file["model"], str(path))
    else:
        save(file, path)
    conv, ours, meta = converted(path, "timm", tmp_path / "out")
    ref = timm_reference("deit_small_patch16_224", file, depth=2)
    x = torch.randn(2, 3, 224, 224)
    assert max_diff(ours.forward_features(x), ref.forward_features(x)) < 1e-5 and max_diff(ours(x), ref(x)) < 1e-5
    assert meta["method"] == "supervised" and conv.config.pos_embed == "learned"
    assert conv.entry == ("model" if suffix == ".pth" else "")


# ---------------------------------------------------------------------------------------------- safe loading
class Planted:
    """A pickle whose loading would run a shell command (creating ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_pickle_is_refused_in_one_line_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    file = save({"model": {"cls_token": torch.zeros(1, 1, 8)}, "args": Planted(marker)}, tmp_path / "evil.pth")
    with pytest.raises(ModelError, match=r"refusing .*evil.pth: its pickle names posix.system") as info:
        read_file(file)
    assert "\n" not in str(info.value)
    assert main([str(file), "--from", "mae", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "posix.system" in err and not (tmp_path / "out").exists()
    legacy = tmp_path / "legacy.pth"  # the pre-zip format: disassembled too, refused by name before torch.load
    torch.save({"x": Planted(marker)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(ModelError, match=r"refusing .*legacy.pth: its pickle names posix.system"):
        read_file(legacy)
    assert not marker.exists(), "the planted command ran"
    with pytest.raises(ModelError, match=r"python -m patchplace.models.convert FILE --from mae\|droppos"):
        load_pretrained(file)  # the checkpoint loader points at the converter


def test_training_records_are_read_as_data(tmp_path):
    """MAE / DeiT training checkpoints pickle the argparse Namespace 'args'; MJP's the yacs CfgNode 'config'."""
    torch.manual_seed(7)
    file = mae_file(depth=1)
    file.update(args=argparse.Namespace(model="vit_base_patch16", blr=1.5e-4), epoch=799,
                optimizer={"state": {}, "param_groups": []}, config=yacs_config())
    obj = read_file(save(file, tmp_path / "checkpoint-799.pth"))
    assert obj["args"].__dict__["blr"] == 1.5e-4 and obj["config"]["TRAIN"]["USE_UNK_POS"] is True
    conv = convert_checkpoint(tmp_path / "checkpoint-799.pth", "mae", tmp_path / "out")
    assert conv.dropped["training arguments (argparse.Namespace)"] == ["[args]"]
    assert conv.metadata["converted_from"]["epoch"] == 799


# ------------------------------------------------------------------------------------ refusals: one line each
def _refusal(tmp_path: Path, obj: dict, layout: str, **kwargs) -> str:
    path = save(obj, tmp_path / f"{layout}.pth")
    with pytest.raises(ModelError) as info:
        convert_checkpoint(path, layout, tmp_path / "out", **kwargs)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    return str(info.value)


def test_a_file_of_another_layout_is_named(tmp_path):
    torch.manual_seed(8)
    message = _refusal(tmp_path, ijepa_file(d=192, patch=16, grid=2), "mae")
    assert "no weights under 'model'" in message and "looks like a ijepa or stop checkpoint: --from ijepa" in message
    message = _refusal(tmp_path, mae_file(depth=1, decoder=True), "ijepa")
    assert "no 'target_encoder' entry" in message and "--from mae" in message
    message = _refusal(tmp_path, mjp_file(depth=1), "mae")
    assert "'pos_embed.weight' is not a key of the MAE layout" in message and "--from mjp" in message
    assert "--from droppos" in _refusal(tmp_path, droppos_file(depth=1), "mae")
    only_context = {k: v for k, v in ijepa_file(d=192, patch=16, grid=2).items() if k != "target_encoder"}
    assert "pass --encoder context" in _refusal(tmp_path, only_context, "ijepa")


def test_unknown_missing_and_misshapen_keys_are_named(tmp_path):
    torch.manual_seed(9)
    file = mae_file(depth=2)
    file["model"]["blocks.1.attn.q_norm.weight"] = torch.ones(64)
    assert "'blocks.1.attn.q_norm.weight' is q/k norm" in _refusal(tmp_path, file, "mae")
    file = mae_file(depth=2)
    file["model"]["blocks.0.extra"] = torch.ones(1)
    assert "'blocks.0.extra' is not a key of the MAE layout's encoder" in _refusal(tmp_path, file, "mae")
    file = mae_file(depth=2)
    del file["model"]["blocks.1.norm2.bias"]
    assert "missing 'blocks.1.norm2.bias' (D,)" in _refusal(tmp_path, file, "mae")
    file = mae_file(depth=2)
    file["model"]["blocks.1.mlp.fc1.weight"] = torch.zeros(1024, 768)
    message = _refusal(tmp_path, file, "mae")
    assert "'blocks.1.mlp.fc1.weight' has shape (1024, 768)" in message and "expects (3072, 768) (H, D)" in message
    file = deit_file(depth=1)
    file["model"]["dist_token"] = torch.zeros(1, 1, 384)
    assert "'dist_token' is DeiT's distillation token" in _refusal(tmp_path, file, "timm")
    file = mae_file(depth=1)
    file["model"]["pos_embed"] = file["model"]["pos_embed"][:, :190]
    assert "'pos_embed' (1, 190, 768) leaves 189 patch rows, not a square grid" in _refusal(tmp_path, file, "mae")
    small = {"model": vit_encoder(64, 1, 4, 8)}
    assert "embed_dim 64 is not a standard ViT width" in _refusal(tmp_path, small, "mae")
    assert "--encoder context: MAE files hold one encoder" in _refusal(tmp_path, small, "mae", encoder="context")
    three = {"model": vit_encoder(64, 1, 4, 8, chans=1)}
    assert "the model takes 1-channel images" in _refusal(tmp_path, three, "mae", num_heads=2)


def test_the_command_converts_and_refuses_a_directory_it_would_replace(tmp_path, capsys):
    torch.manual_seed(10)
    file = save({"model": vit_encoder(64, 1, 4, 8, chans=1)}, tmp_path / "small.pth")
    args = [str(file), "--from", "mae", "--num-heads", "2", "--mean", "0.5", "--std", "0.25", "--dataset", "toy"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "mae: model -> " in out and "64 wide, 1 blocks, 2 heads, patch 4, 32 px" in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["metadata"]["normalization"]["std"] == [0.25] and config["metadata"]["crop_pct"] == 1.0
    assert config["metadata"]["converted_from"]["file"] == "small.pth"
    assert main([*args, "--out", str(tmp_path / "out")]) == 0, "an existing checkpoint is replaced"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main([*args, "--out", str(tmp_path / "mine")]) == 2
    assert "exists and is not a checkpoint directory" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
