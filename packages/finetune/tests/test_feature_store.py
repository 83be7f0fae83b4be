"""The feature store: one forward pass gives the probes' features (last layer, last-4 concatenation, every block),
parts written by several processes merge in manifest order, and subset lists (ImageNet 1% / 10%) match the keys."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from patchplace.finetune import (
    FeatureStore,
    FeatureWriter,
    StoreError,
    extract_features,
    feature_names,
    layer_features,
    match_subset,
    merge_parts,
    pooled_features,
    read_subset_file,
)
from patchplace.finetune.feature_store import as_key, key_stem, name_stem
from patchplace.models import create_model


@pytest.fixture
def backbone():
    torch.manual_seed(0)
    return create_model("vit_micro", img_size=16, patch_size=4, in_chans=1, pos_embed="sincos2d", depth=5).eval()


@pytest.mark.parametrize("pool", ["cls", "mean", "patch_mean"])
def test_one_pass_gives_the_last_layer_the_last_4_concatenated_and_every_block(backbone, pool):
    x = torch.randn(6, 1, 16, 16)
    names = feature_names(5, last=True, last4=True, blocks=True)
    assert names == ["last", "last4", "block1", "block2", "block3", "block4", "block5"]
    got = pooled_features(backbone, x, pool, names)
    normed = layer_features(backbone, x, [1, 2, 3, 4], pool=pool, norm=True)
    torch.testing.assert_close(got["last4"], torch.cat([normed[i] for i in (1, 2, 3, 4)], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(got["last"], layer_features(backbone, x, [-1], pool=pool)[4], rtol=0, atol=0)
    knn_pool = "mean" if pool == "cls" else pool  # the layer-wise kNN averages the patch outputs (MP3 App. C)
    blocks, _ = extract_features(backbone, [(x, torch.zeros(6))], layers=range(5), pool=knn_pool, norm=False)
    for i in range(5):
        torch.testing.assert_close(got[f"block{i + 1}"], blocks[i], rtol=0, atol=0)
    assert got["last4"].shape == (6, 4 * backbone.embed_dim)


def test_a_shallower_backbone_concatenates_all_its_blocks():
    torch.manual_seed(0)
    model = create_model("vit_micro", img_size=16, patch_size=4, in_chans=1).eval()  # 2 blocks
    x = torch.randn(3, 1, 16, 16)
    got = pooled_features(model, x, "mean", ["last4"])["last4"]
    assert got.shape == (3, 2 * model.embed_dim)
    with pytest.raises(StoreError, match="unknown feature"):
        pooled_features(model, x, "mean", ["block3"])


def write_parts(folder, parts: list[list[int]], dim: int = 3) -> dict[int, np.ndarray]:
    """One part per process, each holding the given positions (any order); row of position p = p + [0, .1, .2]."""
    rows = {}
    for rank, positions in enumerate(parts):
        with FeatureWriter(folder, rank) as writer:
            for chunk in (positions[:2], positions[2:]):
                if not chunk:
                    continue
                p = torch.tensor(chunk)
                feats = p[:, None].float() + torch.arange(dim) / 10
                writer.append({"last": feats, "block1": -feats}, p % 3, p, [f"k{i:03d}" for i in chunk])
                rows.update({i: f.numpy() for i, f in zip(chunk, feats, strict=True)})
    return rows


def test_parts_merge_in_manifest_order_whichever_process_read_what(tmp_path):
    one = tmp_path / "one"
    write_parts(one, [list(range(10))])
    merge_parts(one, 1, 10, "toy")
    two = tmp_path / "two"
    rows = write_parts(two, [[7, 0, 3, 9, 4], [8, 1, 2, 6, 5]])
    merge_parts(two, 2, 10, "toy", rank=0, meta=True)  # process 0: 'block1' and the labels / keys
    merge_parts(two, 2, 10, "toy", rank=1, meta=False)  # process 1: 'last'
    store = FeatureStore(two)
    assert list(store.positions) == list(range(10)) and list(store.labels) == [i % 3 for i in range(10)]
    assert [k.decode() for k in store.keys] == [f"k{i:03d}" for i in range(10)]
    np.testing.assert_array_equal(store.features("last"), np.stack([rows[i] for i in range(10)]))
    for name in ("last", "block1", "labels", "keys", "positions"):
        np.testing.assert_array_equal(np.load(two / f"{name}.npy"), np.load(one / f"{name}.npy"), err_msg=name)
    x, y = store.rows("last", np.array([2, 5]))
    assert torch.equal(y, torch.tensor([2, 2])) and torch.allclose(x[:, 0], torch.tensor([2.0, 5.0]))
    assert [len(y) for _, y in store.chunks("block1", np.arange(10), size=4)] == [4, 4, 2]
    assert json.loads((two / "store.json").read_text())["dims"] == {"last": 3, "block1": 3}


def test_a_count_that_differs_a_sample_read_twice_or_a_missing_part_is_refused(tmp_path):
    write_parts(tmp_path / "a", [[0, 1, 2], [3, 4]])
    with pytest.raises(StoreError, match=r"read 5 samples .* but 6 were asked"):
        merge_parts(tmp_path / "a", 2, 6, "toy")
    write_parts(tmp_path / "b", [[0, 1, 2], [2, 3]])
    with pytest.raises(StoreError, match=r"\(1 twice\)"):
        merge_parts(tmp_path / "b", 2, 5, "toy")
    write_parts(tmp_path / "c", [[0, 1]])
    with pytest.raises(StoreError, match=r"part-1/part\.json is missing.*shared filesystem"):
        merge_parts(tmp_path / "c", 2, 4, "toy")
    with pytest.raises(StoreError, match="no complete feature store"):
        FeatureStore(tmp_path / "c")


def test_a_part_cut_short_is_never_merged(tmp_path):
    with pytest.raises(RuntimeError), FeatureWriter(tmp_path, 0) as writer:
        writer.append({"last": torch.ones(2, 3)}, torch.zeros(2), torch.arange(2), ["a", "b"])
        raise RuntimeError("killed mid-split")
    assert not (tmp_path / "part-0" / "part.json").exists()
    with pytest.raises(StoreError, match="missing"):
        merge_parts(tmp_path, 1, 2, "toy")


# ImageNet train keys as data/image_folder.py writes them (relative path, '/' -> '__', '.' -> '_')
KEYS = ["n01440764__n01440764_10026_JPEG", "n01440764__n01440764_10027_JPEG", "n01443537__n01443537_2_JPEG",
        "n01443537__n01443537_10007_JPEG", "n09999999__n01440764_10026_JPEG"]


def chunks(keys, size=2):
    return [(i, keys[i:i + size]) for i in range(0, len(keys), size)]


def test_simclr_subset_names_match_image_folder_keys_with_or_without_folder_and_extension(tmp_path):
    assert as_key("n01440764/n01440764_10026.JPEG") == KEYS[0]
    assert key_stem(KEYS[2]) == "n01443537_2" and name_stem("train/n01443537/n01443537_2.JPEG") == "n01443537_2"
    assert key_stem("0003") == "0003" and key_stem("a__img_7_png") == "img_7" and key_stem("x_JPEGs") == "x_JPEGs"
    listed = tmp_path / "1percent.txt"
    listed.write_text("n01443537_10007.JPEG\n\nn01443537/n01443537_2.JPEG\n  n01440764_10027  \n")
    names = read_subset_file(listed)
    assert names == ["n01443537_10007.JPEG", "n01443537/n01443537_2.JPEG", "n01440764_10027"]
    assert list(match_subset(chunks(KEYS), names)) == [1, 2, 3]
    # a stem two keys share (two folders) matches by its folder only
    assert list(match_subset(chunks(KEYS), ["n01440764/n01440764_10026.JPEG"])) == [0]
    assert list(match_subset(chunks(["0000", "0001", "0002"]), ["0002.png", "0000"])) == [0, 2]


def test_subset_names_the_split_lacks_or_that_are_ambiguous_are_refused_in_one_line(tmp_path):
    with pytest.raises(StoreError, match=r"2 of the 3 names in 10percent.txt are not samples of the split \(e\.g\. "
                                         r"n0_1\.JPEG, n0_2\.JPEG\)") as missing:
        match_subset(chunks(KEYS), ["n0_1.JPEG", "n01443537_2.JPEG", "n0_2.JPEG"], "10percent.txt")
    assert "\n" not in str(missing.value)
    with pytest.raises(StoreError, match=r"1 names in the list match several samples .*n01440764_10026\.JPEG"):
        match_subset(chunks(KEYS), ["n01440764_10026.JPEG"])
    # one sample twice (two names of one file): refused, never trained on as one sample fewer than listed
    with pytest.raises(StoreError, match=r"1 of the 3 names in 1percent.txt name a sample an earlier line names too "
                                         r"\(e\.g\. n01443537_2\)"):
        match_subset(chunks(KEYS), ["n01443537/n01443537_2.JPEG", "n01443537_10007.JPEG", "n01443537_2"],
                     "1percent.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(StoreError, match="names no sample"):
        read_subset_file(tmp_path / "empty.txt")
    with pytest.raises(StoreError, match="cannot be read"):
        read_subset_file(tmp_path / "absent.txt")


def test_the_logistic_regression_read_chunk_by_chunk_from_a_store_is_scikit_learns(tmp_path):
    """StoP's probe summed over 17-row chunks of a memory-mapped store reaches the full-batch optimum (scikit-learn's
    LogisticRegression on all rows in memory): bounded memory changes no number."""
    from patchplace.finetune.probe_recipes import logistic_objective_grad, logistic_regression_chunked

    g = torch.Generator().manual_seed(5)
    y = torch.arange(120) % 3
    x = (torch.randn(3, 6, generator=g)[y] + torch.randn(120, 6, generator=g)) * torch.tensor([1, 10, .1, 3, 1, 5]) + 2
    with FeatureWriter(tmp_path, 0) as writer:
        writer.append({"last": x}, y, torch.arange(120), [str(i) for i in range(120)])
    merge_parts(tmp_path, 1, 120, "train")
    store = FeatureStore(tmp_path)
    rows = np.arange(0, 120, 2)  # a subset, as a label fraction
    lambd = 0.0025 * 400
    model = logistic_regression_chunked(lambda: store.chunks("last", rows, size=17), 3, lambd, tolerance=1e-10)
    sub_x, sub_y = x[rows], y[rows]
    assert logistic_objective_grad(model, sub_x, sub_y, lambd).abs().max() < 1e-6
    sklearn = pytest.importorskip("sklearn.linear_model")
    z = ((sub_x.double() - model.mean) / model.std).numpy()
    reference = sklearn.LogisticRegression(C=1 / lambd, fit_intercept=False, tol=1e-12, max_iter=10000).fit(z, sub_y)
    np.testing.assert_allclose(model.weight.numpy(), reference.coef_, rtol=1e-4, atol=1e-6)


def test_a_chunk_of_a_wide_feature_holds_a_bounded_number_of_bytes(tmp_path):
    from patchplace.finetune.feature_store import CHUNK_BYTES, MERGE_ROWS

    with FeatureWriter(tmp_path, 0) as writer:
        writer.append({"narrow": torch.zeros(2, 8), "wide": torch.zeros(2, 5120)}, torch.zeros(2), torch.arange(2),
                      ["a", "b"])
    merge_parts(tmp_path, 1, 2, "train")
    store = FeatureStore(tmp_path)
    assert store.chunk_rows("narrow") == MERGE_ROWS
    assert store.chunk_rows("wide") * 5120 * 4 <= CHUNK_BYTES < (store.chunk_rows("wide") + 1) * 5120 * 4
