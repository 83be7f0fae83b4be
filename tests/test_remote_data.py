"""Splits served over HTTP (a loopback server over the test shards): read as the local split, trained on, and every
way a server can fail — one line naming the URL and the cause, transient failures retried, corruption still
corruption."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from pipeline_args import TINY, run_log

from patchplace.data import DataError, Manifest, ShardDataset
from patchplace.data.__main__ import main as data_main
from patchplace.data.memory import InMemorySplit
from patchplace.data.remote import Network, RemoteError
from patchplace.pipelines import pretrain

ROOT = Path(__file__).resolve().parents[1]

FAST = Network(timeout=5, retries=2, backoff=0.01)


class _Handler(SimpleHTTPRequestHandler):
    """Serves a directory; ``server.plan[path]`` lists what the next requests of ``path`` get instead (an HTTP
    status, "hang": no answer until the test ends, "cut": half the file then the connection closed, "reset": half
    then a TCP reset, "trickle": 64 bytes every 20 ms); ``server.requests`` records every path asked for."""

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        steps = self.server.plan.get(self.path)
        if steps:
            step = steps.pop(0)
            if step == "hang":
                self.server.release.wait(10)
                return
            if step in ("cut", "reset", "trickle"):
                self.faulty_body(step)
                return
            self.send_error(step)
            return
        super().do_GET()

    def faulty_body(self, step: str) -> None:
        data = Path(self.translate_path(self.path)).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if step == "trickle":
            for start in range(0, len(data), 64):
                if self.server.release.wait(0.02):
                    break
                self.wfile.write(data[start:start + 64])
                self.wfile.flush()
            return
        self.wfile.write(data[:len(data) // 2])
        self.wfile.flush()
        if step == "reset":  # SO_LINGER 0: close() sends an RST
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def served(directory: Path) -> Iterator[tuple[ThreadingHTTPServer, str]]:
    """A loopback HTTP server over ``directory`` for the block: (server, its base URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(directory)))
    server.daemon_threads = True
    server.plan, server.requests, server.release = {}, [], threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_all(dataset: ShardDataset) -> list[tuple]:
    return [(key, label, x) for x, label, key in dataset]


def test_a_served_split_reads_the_samples_of_the_local_one_bit_for_bit(shards, capsys):
    local = shards / "img" / "train"
    with served(shards / "img") as (server, base):
        url = f"{base}/train"
        remote = Manifest.load(url, FAST)
        assert remote == Manifest.load(local) and remote.fingerprint() == Manifest.load(local).fingerprint()
        assert remote.shard_urls()[0] == f"{url}/train-000000.tar"
        a, b = read_all(ShardDataset(url, return_key=True)), read_all(ShardDataset(local, return_key=True))
        assert [s[:2] for s in a] == [s[:2] for s in b]
        assert all(torch.equal(x, y) for (*_, x), (*_, y) in zip(a, b, strict=True))
        for rank in (0, 1):  # ranks split remote shards as they split local ones
            keys = [[k for _, _, k in ShardDataset(s, return_key=True, shuffle_buffer=8, seed=3, rank=rank,
                                                   world_size=2)] for s in (url, local)]
            assert keys[0] == keys[1]
        memory = InMemorySplit.load(url, num_workers=0, progress=False)
        assert torch.equal(memory.inputs, InMemorySplit.load(local, progress=False).inputs)
        assert data_main(["verify", url]) == 0 and "shards: OK" in capsys.readouterr().out
        assert all(path.endswith((".tar", ".json")) for path in server.requests)


def test_a_pretraining_run_trains_on_splits_served_over_http(shards, tmp_path):
    """Streaming (2 worker processes) from the server takes the steps a run on the local split takes."""
    args = [*TINY, "optim.max_steps=2", "data.in_memory=false", "data.num_workers=2", "method=supervised"]
    with served(shards / "img") as (server, base):
        assert pretrain.main([f"data.train={base}/train", f"data.val={base}/test", *args,
                              f"run.output={tmp_path / 'remote'}"]) == 0
        assert sum(p.endswith(".tar") for p in server.requests) == 4 + 2  # every shard of train and test, once
    assert pretrain.main([f"data.train={shards / 'img' / 'train'}", f"data.val={shards / 'img' / 'test'}", *args,
                          f"run.output={tmp_path / 'local'}"]) == 0
    remote, local = run_log(tmp_path / "remote"), run_log(tmp_path / "local")
    assert [r["loss"] for r in remote] == [r["loss"] for r in local] and remote[0]["data"]["train"] == "streaming"


@pytest.mark.parametrize("failure", ["404 shard", "404 manifest", "refused", "timeout"])
def test_an_unreachable_split_is_one_line_naming_the_url_and_the_cause(shards, tmp_path, capsys, failure):
    with served(shards / "img") as (server, base):
        train, extra = f"{base}/train", ["data.retries=1"]
        if failure == "404 shard":
            server.plan["/train/train-000002.tar"] = [404]
            url, cause = f"{train}/train-000002.tar", "HTTP 404"
        elif failure == "404 manifest":
            train = f"{base}/nowhere"
            url, cause = f"{train}/manifest.json", "HTTP 404"
        elif failure == "refused":
            train = f"http://127.0.0.1:{closed_port()}/train"
            url, cause = f"{train}/manifest.json", "Connection refused (2 attempts"
        else:
            server.plan["/train/manifest.json"] = ["hang"] * 3  # 2 attempts, then the command line's 1
            url, cause = f"{train}/manifest.json", "no answer within 0.2 s (2 attempts"
            extra.append("data.timeout=0.2")
        code = pretrain.main([f"data.train={train}", f"data.val={shards / 'img' / 'test'}", *TINY, *extra,
                              "optim.max_steps=1", f"run.output={tmp_path}"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        if failure == "404 shard":
            assert server.requests.count("/train/train-000002.tar") == 1, "a 404 is not retried"
    assert code == 2, err
    assert err.startswith(f"error: cannot fetch {url}: {cause}") and err.endswith("retry / check the server" + (
        " and the URL" if "404" in cause else "")), err
    assert "corrupt" not in err and "rebuild" not in err
    if failure != "404 shard":
        assert data_main(["show", "--retries", "0", "--timeout", "0.2", train]) == 2
        assert capsys.readouterr().err.startswith(f"error: cannot fetch {url}: ")


def test_transient_failures_are_retried_and_exhausted_retries_name_the_status(shards):
    with served(shards / "img") as (server, base):
        server.plan["/train/train-000001.tar"] = [503, 503]
        server.plan["/train/train-000003.tar"] = [429]
        dataset = ShardDataset(f"{base}/train", return_key=True, network=FAST)
        assert len(read_all(dataset)) == 64
        assert server.requests.count("/train/train-000001.tar") == 3 and server.plan["/train/train-000001.tar"] == []
        server.plan["/train/train-000000.tar"] = [503, 503, 503]
        with pytest.raises(RemoteError, match=r"train-000000.tar: HTTP 503 .*\(3 attempts over .*retry / check"):
            read_all(dataset)
        server.plan["/train/train-000002.tar"] = [404]
        with pytest.raises(RemoteError, match=r"train-000002.tar: HTTP 404 .*retry / check the server and the URL"):
            InMemorySplit.load(Manifest.load(f"{base}/train", FAST), skip_corrupt=True, progress=False)


def test_a_served_shard_with_other_bytes_is_reported_corrupt_by_name(shards, tmp_path, capsys):
    copy = tmp_path / "img"
    shutil.copytree(shards / "img" / "train", copy / "train")
    shard = copy / "train" / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload: the same size, another sha256
    shard.write_bytes(bytes(data))
    with served(copy) as (_, base):
        url = f"{base}/train/train-000001.tar"
        with pytest.raises(DataError, match=rf"^corrupt shard {url}: sha256 .* differs .*rebuild the split with its "
                                            rf"data/ recipe, check all shards with `python -m patchplace.data verify "
                                            rf"{base}/train`") as caught:
            read_all(ShardDataset(f"{base}/train", return_key=True, network=FAST))
        assert not isinstance(caught.value, RemoteError)
        assert data_main(["verify", f"{base}/train"]) == 1
        assert f"! {url}: sha256" in capsys.readouterr().out


def test_a_local_manifest_streams_its_shards_from_train_urls_over_http(shards):
    """``data.train_urls`` keeps naming the same shards elsewhere, ``http(s)`` ones fetched with retries."""
    with served(shards / "img") as (server, base):
        server.plan["/train/train-000000.tar"] = [503]
        urls = f"{base}/train/train-{{000000..000003}}.tar"
        local = Manifest.load(shards / "img" / "train", FAST)
        assert len(read_all(ShardDataset(local, urls=urls, return_key=True))) == 64
        assert server.requests.count("/train/train-000000.tar") == 2


def test_the_onnx_runtime_evaluator_reads_its_test_split_by_url(shards, tmp_path):
    from patchplace.export import export_checkpoint
    from patchplace.export.evaluate import main as ort_evaluate
    from patchplace.models import create_model, save_pretrained

    torch.manual_seed(0)
    model = create_model("vit_micro", img_size=32, in_chans=1, num_classes=3).eval()
    save_pretrained(model, tmp_path / "model", metadata={"classes": ["a", "b", "c"], "pad_to": 32,
                                                         "normalization": {"mean": [0.5], "std": [0.25]}})
    export_checkpoint(tmp_path / "model", tmp_path / "model.onnx")
    options = ["--robustness-limit", "0", "--consistency-limit", "4", "--latency-repeats", "0"]
    with served(shards / "img") as (_, base):
        assert ort_evaluate([str(tmp_path / "model.onnx"), "--data", f"{base}/test", "--out", str(tmp_path / "remote"),
                             *options]) == 0
    assert ort_evaluate([str(tmp_path / "model.onnx"), "--data", str(shards / "img" / "test"), "--out",
                         str(tmp_path / "local"), *options]) == 0
    remote, local = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("remote", "local"))
    assert remote["accuracy"] == local["accuracy"] and remote["accuracy"]["count"] == 32


def test_a_shard_cut_short_mid_transfer_is_retried_not_reported_corrupt(shards, tmp_path, capsys):
    """Fewer bytes than Content-Length, or a reset while reading, is a network fault: retried (logged), and when
    the retries run out one line naming the URL and the bytes received, never "corrupt shard ... rebuild"."""
    with served(shards / "img") as (server, base):
        server.plan["/train/train-000001.tar"] = ["cut"]
        server.plan["/train/train-000002.tar"] = ["reset"]
        assert len(read_all(ShardDataset(f"{base}/train", return_key=True, network=FAST))) == 64
        assert server.requests.count("/train/train-000001.tar") == 2
        assert server.requests.count("/train/train-000002.tar") == 2
        err = capsys.readouterr().err
        size = (shards / "img" / "train" / "train-000001.tar").stat().st_size
        assert (f"fetching {base}/train/train-000001.tar: the connection closed after {size // 2} of {size} bytes; "
                "retry 1 of 2 in ") in err, err
        assert f"fetching {base}/train/train-000002.tar: " in err and "retry 1 of 2" in err, err
        server.plan["/train/train-000001.tar"] = ["cut"]  # a run: it succeeds, the retry logged
        assert pretrain.main([f"data.train={base}/train", f"data.val={shards / 'img' / 'test'}", *TINY,
                              "optim.max_steps=1", "method=supervised", f"run.output={tmp_path / 'run'}"]) == 0
        assert f"fetching {base}/train/train-000001.tar: the connection closed after" in capsys.readouterr().err
        server.plan["/train/train-000003.tar"] = ["cut"] * 3
        with pytest.raises(RemoteError, match=r"^cannot fetch .*train-000003.tar: the connection closed after \d+ of "
                                              r"\d+ bytes \(3 attempts over .*retry / check the server$") as caught:
            read_all(ShardDataset(f"{base}/train", return_key=True, network=FAST))
        assert "corrupt" not in str(caught.value) and "rebuild" not in str(caught.value)


def test_a_server_trickling_bytes_meets_the_shard_deadline_in_one_line(shards, tmp_path, capsys):
    with served(shards / "img") as (server, base):
        url = f"{base}/train/train-000000.tar"
        server.plan["/train/train-000000.tar"] = ["trickle"]
        started = time.monotonic()
        with pytest.raises(RemoteError, match=r"^cannot fetch .*train-000000.tar: \d+ bytes of \d+ in .* past its "
                                              r"deadline of 0.4 s .*raise data.shard_deadline"):
            read_all(ShardDataset(f"{base}/train", network=Network(timeout=5, retries=2, backoff=0.01, deadline=0.4,
                                                                    progress=0.1)))
        assert time.monotonic() - started < 5 and server.requests.count("/train/train-000000.tar") == 1
        progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"fetching {url}: ")]
        assert progress and all("MiB/s" in line and "data.shard_deadline" in line for line in progress), progress
        server.plan["/train/train-000000.tar"] = ["trickle"]
        started = time.monotonic()
        code = pretrain.main([f"data.train={base}/train", f"data.val={shards / 'img' / 'test'}", *TINY,
                              "data.shard_deadline=0.3", "optim.max_steps=1", f"run.output={tmp_path}"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and time.monotonic() - started < 10, err
        assert err.startswith(f"error: cannot fetch {url}: ") and "past its deadline of 0.3 s" in err, err
        assert err.endswith("raise data.shard_deadline, or check the server"), err
        for bad in ("0", "-1"):
            assert pretrain.main([f"data.train={base}/train", f"data.shard_deadline={bad}", *TINY]) == 2
            assert "data.shard_deadline must be > 0" in capsys.readouterr().err
