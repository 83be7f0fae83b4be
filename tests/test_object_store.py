"""Splits in object stores: ``s3://`` against a real S3-protocol server on 127.0.0.1 (moto's server mode), read as the
local split and trained on; every way a bucket can fail (no such bucket or key, a server that stops answering, bytes
changed in the bucket, a backend not installed) is one line, transient failures retried, corruption still
corruption; a ``pipe:`` command that fails is named with its exit status."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch
import yaml
from fsspec.registry import _registry
from pipeline_args import TINY, run_log
from test_remote_data import FAST, read_all, served

from patchplace.data import DataError, Manifest, ShardDataset, SplitWriter
from patchplace.data.__main__ import main as data_main
from patchplace.data.memory import InMemorySplit
from patchplace.data.remote import CommandError, Network, RemoteError, Transient, fetch, is_remote
from patchplace.data.stores import backend_problem, failure, filesystem
from patchplace.pipelines import pretrain

BUCKET = "patchplace-test"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       # nothing of the machine's own AWS set-up (profiles, instance metadata) reaches the test
       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
       "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server:
    """moto's S3 server on a loopback port that stays the same across :meth:`stop` / :meth:`start` (its buckets live
    in this process, so they outlast a restart)."""

    def __init__(self) -> None:
        self.port = 0
        self.server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]

    def stop(self) -> None:
        self.server.stop()
        self.server._server.server_close()  # stop() leaves the socket listening: connections would hang, not fail


@pytest.fixture(scope="module")
def s3(shards: Path) -> Iterator[S3Server]:
    """The server, the environment pointing s3fs at it, and the test splits uploaded to s3://BUCKET/img/ (moto and
    s3fs come with the workspace's dev extra: `make test` installs them)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request
    server = S3Server()
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}"}.items():
            patch.setenv(key, value)
        fs, _ = filesystem("s3://", Network())
        fs.mkdir(BUCKET)
        fs.put(str(shards / "img"), f"{BUCKET}/img", recursive=True)
        try:
            yield server
        finally:
            server.stop()


def test_a_split_in_a_bucket_reads_the_samples_of_the_local_one_bit_for_bit(s3, shards, capsys):
    local, url = shards / "img" / "train", f"s3://{BUCKET}/img/train"
    remote = Manifest.load(url, FAST)
    assert remote == Manifest.load(local) and remote.fingerprint() == Manifest.load(local).fingerprint()
    assert remote.location == url and remote.shard_urls()[0] == f"{url}/train-000000.tar"
    a, b = read_all(ShardDataset(url, return_key=True)), read_all(ShardDataset(local, return_key=True))
    assert [s[:2] for s in a] == [s[:2] for s in b] and len(a) == 64
    assert all(torch.equal(x, y) for (*_, x), (*_, y) in zip(a, b, strict=True))
    assert torch.equal(InMemorySplit.load(url, progress=False).inputs, InMemorySplit.load(local, progress=False).inputs)
    assert data_main(["verify", url]) == 0 and "shards: OK" in capsys.readouterr().out
    # a second fsspec backend through the same path: memory://, and file:// (read by fsspec, shards as local files)
    memory = fsspec.filesystem("memory")
    if memory.exists("/split"):  # (the memory filesystem lives as long as the process)
        memory.rm("/split", recursive=True)
    memory.put(str(local), "/split/train", recursive=True)
    for other in ("memory://split/train", local.as_uri()):
        assert is_remote(other) and Manifest.load(other).fingerprint() == remote.fingerprint()
        assert [s[:2] for s in read_all(ShardDataset(other, return_key=True))] == [s[:2] for s in b]


def test_a_pretraining_run_trains_on_splits_in_a_bucket(s3, shards, tmp_path):
    """Streaming (2 forked DataLoader workers, each with its own S3 client) takes the steps a local run takes, and
    the run records the URLs as given (never turned into a local path)."""
    args = [*TINY, "optim.max_steps=2", "data.in_memory=false", "data.num_workers=2", "method=supervised"]
    train, val = f"s3://{BUCKET}/img/train", f"s3://{BUCKET}/img/test"
    assert pretrain.main([f"data.train={train}", f"data.val={val}", *args, f"run.output={tmp_path / 'remote'}"]) == 0
    assert pretrain.main([f"data.train={shards / 'img' / 'train'}", f"data.val={shards / 'img' / 'test'}", *args,
                          f"run.output={tmp_path / 'local'}"]) == 0
    remote, local = run_log(tmp_path / "remote"), run_log(tmp_path / "local")
    assert [r["loss"] for r in remote] == [r["loss"] for r in local] and remote[0]["data"]["train"] == "streaming"
    saved = yaml.safe_load((tmp_path / "remote" / "config.yaml").read_text())["data"]
    assert (saved["train"], saved["val"]) == (train, val)


def test_a_shard_changed_in_the_bucket_is_a_corrupt_shard_named(s3, shards, tmp_path, capsys):
    copy = tmp_path / "train"
    shutil.copytree(shards / "img" / "train", copy)
    data = bytearray((copy / "train-000001.tar").read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload: the same size, another sha256
    (copy / "train-000001.tar").write_bytes(bytes(data))
    fs, _ = filesystem("s3://", Network())
    fs.put(str(copy), f"{BUCKET}/flipped/train", recursive=True)
    split = f"s3://{BUCKET}/flipped/train"
    url = f"{split}/train-000001.tar"
    with pytest.raises(DataError, match=rf"^corrupt shard {url}: sha256 \w+ differs from the manifest's .*rebuild the "
                                        rf"split with its data/ recipe, check all shards with `python -m "
                                        rf"patchplace.data verify {split}`") as caught:
        read_all(ShardDataset(split, return_key=True, network=FAST))
    assert not isinstance(caught.value, RemoteError)
    assert data_main(["verify", split]) == 1 and f"! {url}: sha256" in capsys.readouterr().out


@pytest.mark.parametrize("missing", ["bucket", "manifest", "shard"])
def test_a_missing_bucket_or_key_is_one_line_at_once(s3, shards, tmp_path, capsys, missing):
    fs, _ = filesystem("s3://", Network())
    train = {"bucket": "s3://no-such-bucket/img/train", "manifest": f"s3://{BUCKET}/img/nowhere",
             "shard": f"s3://{BUCKET}/gap/train"}[missing]
    url = f"{train}/train-000002.tar" if missing == "shard" else f"{train}/manifest.json"
    if missing == "shard":
        fs.put(str(shards / "img" / "train"), f"{BUCKET}/gap/train", recursive=True)
        fs.rm(f"{BUCKET}/gap/train/train-000002.tar")
    code = pretrain.main([f"data.train={train}", f"data.val={shards / 'img' / 'test'}", *TINY, "optim.max_steps=1",
                          f"run.output={tmp_path}"])  # data.in_memory=auto: every shard read at start-up
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith(f"error: cannot fetch {url}: no such bucket or key ("), line
    assert line.endswith("check the URL, or upload the split (e.g. aws s3 sync <split directory> <its URL>)"), line
    assert "retry 1" not in err and "corrupt" not in line and "s3:/" + BUCKET not in line, err  # not retried
    assert data_main(["show", train]) == (0 if missing == "shard" else 2)
    if missing == "shard":
        assert data_main(["verify", train]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot fetch {url}: no such bucket or key")


def test_a_store_that_stops_answering_is_retried_then_one_line(s3, capsys):
    """The server stopped (connections refused): each attempt fails, is logged and retried; restarted, the read goes
    on; stopped for good, one line naming the URL, the error and the attempts."""
    dataset = ShardDataset(f"s3://{BUCKET}/img/train", return_key=True,
                           network=Network(timeout=5, retries=6, backoff=0.2))
    s3.stop()
    restart = threading.Timer(0.5, s3.start)
    restart.start()
    try:
        assert len(read_all(dataset)) == 64
    finally:
        restart.join()
    err = capsys.readouterr().err
    assert f"fetching s3://{BUCKET}/img/train/train-000000.tar: EndpointConnectionError: " in err, err
    assert "retry 1 of 6 in 0.2 s" in err, err
    s3.stop()
    try:
        with pytest.raises(RemoteError, match=rf"^cannot fetch s3://{BUCKET}/img/train/manifest.json: "
                                              r"EndpointConnectionError: .* \(2 attempts over .*retries=1, "
                                              r"timeout=5 s\); retry / check the network and the store's endpoint$"):
            Manifest.load(f"s3://{BUCKET}/img/train", Network(timeout=5, retries=1, backoff=0.01))
    finally:
        s3.start()


def test_the_shard_deadline_and_progress_lines_hold_for_stores(s3, capsys):
    url = f"s3://{BUCKET}/img/train/train-000000.tar"
    size, _ = fetch(url, Network(progress=1e-9))  # a progress line after every read (STORE_BLOCK bytes)
    assert f"fetching {url}: " in capsys.readouterr().err and size > 0
    with pytest.raises(RemoteError, match=rf"^cannot fetch {url}: {size} bytes of {size} in .* past its deadline of "
                                          r"1e-09 s .*raise data.shard_deadline"):
        fetch(url, Network(deadline=1e-9))


def test_a_split_is_never_written_to_a_url(tmp_path, capsys):
    """Writing goes to a local directory, then the user uploads it: a URL as --out is refused, not made a local
    "s3:" directory."""
    with pytest.raises(DataError, match=r"^cannot write a split to s3://b/fm: .*aws s3 sync shards/<dataset> s3://b/fm"):
        SplitWriter("s3://b/fm", "train", dataset="d", modality="image", classes=["a"], info={}, source="t",
                    recipe="t", recipe_version=1)
    from patchplace.pipelines.datasets.fashion_mnist import main as fashion_mnist

    with pytest.raises(SystemExit) as exit_code:
        fashion_mnist(["--out", "gs://b/fm"])
    assert exit_code.value.code == 2 and "cannot write a split to gs://b/fm" in capsys.readouterr().err
    assert not Path("gs:").exists()


def test_store_errors_are_sorted_into_transient_and_permanent():
    """Throttling and 5xx (botocore's ClientError, as s3fs raises it) are retried; 403 / 404 fail at once."""
    pytest.importorskip("s3fs")
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    def s3_error(code: str, status: int) -> BaseException:
        response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return translate_boto_error(ClientError(response, "GetObject"))

    for code, status in (("SlowDown", 503), ("InternalError", 500), ("ServiceUnavailable", 503)):
        assert isinstance(failure("s3://b/k", s3_error(code, status)), Transient), code
    denied = failure("s3://b/k", s3_error("AccessDenied", 403))
    assert isinstance(denied, RemoteError) and "access denied or no credentials (PermissionError: " in str(denied)
    assert "no such bucket or key" in str(failure("s3://b/k", s3_error("NoSuchKey", 404)))
    assert isinstance(failure("s3://b/k", s3_error("InvalidRange", 416)), RemoteError)
    assert isinstance(failure("s3://b/k", TimeoutError("read")), Transient)
    # other backends' types, known by name and by the status their response carries (hf:// raises httpx's)
    connect_error = type("ConnectError", (Exception,), {})
    assert isinstance(failure("hf://d/x", connect_error("[Errno -2] Name or service not known")), Transient)
    http_error = type("HfHubHTTPError", (Exception,), {})
    for status, kind in ((404, RemoteError), (403, RemoteError), (502, Transient)):
        error = http_error("...")
        error.response = SimpleNamespace(status_code=status)
        assert isinstance(failure("hf://d/x", error), kind), status


def test_a_scheme_whose_backend_is_missing_is_one_line_naming_the_package(tmp_path, capsys, monkeypatch):
    """gs:// (gcsfs), az:// (adlfs) and hf:// (huggingface_hub) with their backend not importable (made so here,
    whether or not it is installed): refused before anything starts, naming the package to install."""
    assert backend_problem("hf://datasets/someone/data/train") is None  # huggingface_hub is a dependency here
    for url, protocol, package in (("gs://bucket/train", "gs", "gcsfs"), ("az://container/train", "az", "adlfs"),
                                   ("hf://datasets/someone/data/train", "hf", "huggingface_hub")):
        monkeypatch.setitem(sys.modules, package, None)  # import gcsfs -> ImportError
        monkeypatch.delitem(_registry, protocol, raising=False)  # (fsspec keeps the classes it imported)
        assert pretrain.main([f"data.train={url}", *TINY, f"run.output={tmp_path}"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"error: data.train: {url}: reading {protocol}:// needs the {package} package, which "
                               "is not installed (") and line.endswith(f"pip install {package}"), line
        with pytest.raises(RemoteError, match=rf"^cannot fetch {url}/manifest.json: reading .* pip install {package}$"):
            Manifest.load(url)
    assert pretrain.main(["data.train=foo://bucket/train", *TINY, f"run.output={tmp_path}"]) == 2
    assert "data.train: foo://bucket/train: fsspec knows no foo:// filesystem" in capsys.readouterr().err


def test_a_failing_pipe_command_names_its_exit_status(shards, tmp_path, capsys):
    split = shards / "img" / "train"
    with pytest.raises(CommandError, match=r"^command `false` exited with status 1 after writing 0 bytes: the "
                                           r"command failed, not the shard; run it by hand"):
        read_all(ShardDataset(split, urls=["pipe:false"] * 4))
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the pipe:curl half of this test needs it")
    with served(shards / "img") as (_, base):
        urls = f"pipe:curl -sf {base}/nowhere/train-{{000000..000003}}.tar"
        code = pretrain.main([f"data.train={split}", f"data.train_urls={urls}", f"data.val={shards / 'img' / 'test'}",
                              *TINY, "optim.max_steps=1", "data.in_memory=false", f"run.output={tmp_path / 'f'}"])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and line.startswith(f"error: command `curl -sf {base}/nowhere/train-0000"), line
        assert " exited with status 22 " in line and "corrupt" not in line, line
        # without -f curl prints the server's 404 page and exits 0: the bytes differ, and the advice is the command's
        with pytest.raises(DataError, match=r"^corrupt shard pipe:curl -s .*: \d+ bytes, the manifest says .*the "
                                            r"command's output is not the shard: run it by hand \(.*curl -f"):
            read_all(ShardDataset(split, urls=f"pipe:curl -s {base}/nowhere/train-{{000000..000003}}.tar"))


@pytest.mark.slow
def test_two_processes_train_on_a_split_in_a_bucket_as_on_the_local_one(s3, shards, tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo): each rank reads its own shards from the
    bucket with its own S3 client and the run takes the steps the same launch takes on the local split."""
    launch = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
              # pretrain.py's runs one after the other in one launch (without run.fsdp: DDP, as pretrain.py runs)
              str(Path(__file__).resolve().parent / "fsdp_driver.py")]
    args = [*TINY, "optim.max_steps=2", "data.in_memory=false", "method=supervised"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}  # AWS_* from the fixture
    runs = [[f"data.train={where}/train", f"data.val={where}/test", *args, f"run.output={tmp_path / name}"]
            for name, where in (("remote", f"s3://{BUCKET}/img"), ("local", str(shards / "img")))]
    done = subprocess.run([*launch, *runs[0], "--then", *runs[1]], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0 and "run 0 exited 0" in done.stdout and "run 1 exited 0" in done.stdout, \
        done.stderr[-3000:]
    remote, local = run_log(tmp_path / "remote"), run_log(tmp_path / "local")
    assert len(remote) == 2 and [r["loss"] for r in remote] == [r["loss"] for r in local]
