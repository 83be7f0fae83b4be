"""data.train_urls as a run reads it: a ``pipe:`` command's ``${VAR}`` is its shell's (webdataset would look up
``WDS_VAR`` instead), an unset one a line naming it; a shard the manifest lists that is gone from disk is named as
missing, not as corrupt. Each refusal is one ``error:`` line, exit 2, no traceback."""

from __future__ import annotations

import shutil

import pytest
from pipeline_args import TINY

from patchplace.pipelines import pretrain

RUN = [*TINY, "optim.max_steps=1", "data.in_memory=false", "method=supervised"]


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_pipe_commands_shell_variable_is_its_shells(shards, tmp_path, monkeypatch, capsys):
    split, val = shards / "img" / "train", shards / "img" / "test"
    urls = "pipe:cat ${SDIR}/train-{000000..000003}.tar"
    monkeypatch.setenv("SDIR", str(split))
    monkeypatch.delenv("WDS_SDIR", raising=False)
    assert pretrain.main([f"data.train={split}", f"data.train_urls={urls}", f"data.val={val}", *RUN,
                          f"run.output={tmp_path / 'set'}"]) == 0
    monkeypatch.delenv("SDIR")
    assert pretrain.main([f"data.train={split}", f"data.train_urls={urls}", f"data.val={val}", *RUN,
                          f"run.output={tmp_path / 'unset'}"]) == 2
    line = error_line(capsys)
    assert "uses ${SDIR}, which is not set in this environment" in line and "export SDIR=" in line, line


def test_a_shard_gone_from_disk_is_missing_not_corrupt(shards, tmp_path, capsys):
    split = tmp_path / "train"
    shutil.copytree(shards / "img" / "train", split)
    gone = sorted(split.glob("*.tar"))[1]
    gone.unlink()
    assert pretrain.main([f"data.train={split}", f"data.val={shards / 'img' / 'test'}", *RUN,
                          f"run.output={tmp_path / 'run'}"]) == 2
    line = error_line(capsys)
    assert line == f"error: missing shard {gone} (listed in the manifest): restore it, or rebuild the split", line


@pytest.mark.parametrize("verify", [True, False])
def test_the_reader_names_a_missing_shard_or_skips_it_counted(shards, tmp_path, verify):
    from patchplace.data import DataError, ShardDataset

    split = tmp_path / "train"
    shutil.copytree(shards / "img" / "train", split)
    gone = sorted(split.glob("*.tar"))[2]
    gone.unlink()
    with pytest.raises(DataError, match=rf"^missing shard {gone} \(listed in the manifest\): restore it, or rebuild "
                                        r"the split$"):
        list(ShardDataset(split, verify=verify))
    skipping = ShardDataset(split, verify=verify, skip_corrupt=True)
    with pytest.warns(UserWarning, match=f"skipping missing shard {gone}"):
        assert len(list(skipping)) > 0
    assert skipping.skipped == [str(gone)]
