"""The files of an export and their names (``NAME.onnx``, ``NAME.json``, ``NAME.int8.onnx``, ``NAME.fp16.onnx``,
``NAME.onnx.data``), saving a graph (with external data over protobuf's 2 GiB), the checks of an ``--out`` before
any work, and the removal of temporary directories killed exports left behind."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import onnx
from torch import nn

from patchplace.data.atomic import path_problem, pid_alive

from .errors import ExportError

INT8_SUFFIX = ".int8.onnx"
FP16_SUFFIX = ".fp16.onnx"
PROTOBUF_LIMIT = 2**31  # one protobuf message (a .onnx file with its weights inside) holds at most 2 GiB
# weights above this go to an external data file NAME.onnx.data beside NAME.onnx (headroom for the graph itself)
EXTERNAL_DATA_THRESHOLD = PROTOBUF_LIMIT - 2**28


def data_of(model: str | os.PathLike) -> Path:
    """The external data file of ``NAME.onnx`` (models whose weights exceed :data:`EXTERNAL_DATA_THRESHOLD`):
    ``NAME.onnx.data`` beside it, named in the graph relative to it (the pair moves together)."""
    model = Path(model)
    return model.with_name(model.name + ".data")


def weight_bytes(model: onnx.ModelProto | nn.Module) -> int:
    """Bytes of the weights (a module's parameters and buffers, or a graph's initializers) — what decides whether
    the graph is saved with external data."""
    if isinstance(model, nn.Module):
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return sum(len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def save_graph(graph: onnx.ModelProto, path: Path, external: bool) -> None:
    """``onnx.save`` of ``graph`` to ``path``: one file, or (``external``) the graph with its tensors in
    :func:`data_of` ``(path)`` (which is written anew, never appended to). ``graph`` keeps its weights in memory
    (onnx's external-data save moves them out of the proto: they are read back)."""
    data = data_of(path)
    data.unlink(missing_ok=True)
    if not external:
        onnx.save(graph, str(path))
        return
    onnx.save_model(graph, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    from onnx.external_data_helper import load_external_data_for_model

    load_external_data_for_model(graph, str(path.parent))


def sidecar_of(model: str | os.PathLike) -> Path:
    """The sidecar of an exported ``NAME.onnx``: ``NAME.json`` beside it (``model.v1.onnx`` -> ``model.v1.json``),
    the one rule the exporter and every reader use; distinct model names never share a sidecar."""
    model = Path(model)
    stem = model.name[: -len(".onnx")] if model.name.endswith(".onnx") else model.name
    return model.with_name(f"{stem}.json")


def int8_of(model: str | os.PathLike) -> Path:
    """The int8 copy ``--quantize`` writes of ``NAME.onnx``: ``NAME.int8.onnx`` beside it."""
    model = Path(model)
    return model.with_name(sidecar_of(model).name[: -len(".json")] + INT8_SUFFIX)


def fp16_of(model: str | os.PathLike) -> Path:
    """The fp16 copy ``--fp16`` writes of ``NAME.onnx``: ``NAME.fp16.onnx`` beside it."""
    model = Path(model)
    return model.with_name(sidecar_of(model).name[: -len(".json")] + FP16_SUFFIX)


def copy_suffix(path: str | os.PathLike) -> str:
    """``.int8.onnx`` / ``.fp16.onnx`` for a copy the exporter writes beside an export (no sidecar of its own),
    else ""."""
    return next((suffix for suffix in (INT8_SUFFIX, FP16_SUFFIX) if Path(path).name.endswith(suffix)), "")


def fp32_of(copy: str | os.PathLike) -> Path:
    """``NAME.onnx``, the exported model whose int8 / fp16 copy is ``NAME.int8.onnx`` / ``NAME.fp16.onnx``."""
    copy = Path(copy)
    return copy.with_name(copy.name[: -len(copy_suffix(copy) or ".onnx")] + ".onnx")


def check_writable(directory: Path, what: str) -> None:
    """Refuse, before any work, a ``directory`` to write into that cannot be: under a file, or in a place this
    process may not create files (read-only file system, permissions: tried by creating and removing a file in the
    nearest existing ancestor, which creates nothing that stays)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ExportError(f"{what}: {probe} is a file, not a directory: choose a path in a directory")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".patchplace-write-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ExportError(f"{what}: cannot create files in {probe} ({exc.strerror or exc}): choose a writable "
                          "directory") from None


def check_out(out: str | os.PathLike) -> Path:
    """Refuse, before any work, an export ``--out`` that could not be committed: not named ``NAME.onnx`` (the
    sidecar ``NAME.json`` and the int8 copy ``NAME.int8.onnx`` are named from it), an int8 copy's name, a directory
    where the model, its sidecar or its int8 copy go, or a place that cannot be written. -> ``out`` as a Path."""
    out = Path(out)
    if problem := path_problem("--out", out):
        raise ExportError(problem)
    if not out.name.endswith(".onnx") or out.name == ".onnx":
        raise ExportError(f"--out {out}: name the model NAME.onnx (e.g. --out {out.with_name(out.name + '.onnx')}"
                          f"): its sidecar NAME.json and int8 copy NAME.int8.onnx are named from it")
    if suffix := copy_suffix(out):
        kind, flag = ("int8", "--quantize") if suffix == INT8_SUFFIX else ("fp16", "--fp16")
        raise ExportError(f"--out {out}: NAME{suffix} is the name of the {kind} copy {flag} writes of NAME.onnx; "
                          f"choose another name (e.g. --out {fp32_of(out)} {flag})")
    for path in (out, sidecar_of(out), int8_of(out), fp16_of(out)):
        if path.is_dir():
            raise ExportError(f"--out {out}: {path} is a directory: give the model file's path, e.g. --out "
                              f"{out / 'model.onnx'}" if path == out else
                              f"--out {out}: {path} is a directory where the export writes a file: remove it")
    check_writable(out.parent, f"--out {out}")
    return out


def temporary_prefix(out: Path) -> str:
    """``.NAME.HOST.PID.``: the prefix of an export's temporary directory beside ``out``, naming its owner."""
    return f".{out.name}.{re.sub(r'[^A-Za-z0-9-]', '-', socket.gethostname())}.{os.getpid()}."


STALE_AFTER_S = 24 * 3600  # a temporary directory whose owner cannot be checked is removed after this


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary directories that killed exports to ``out`` left beside it: those of a dead process on
    this host, and those whose owner cannot be checked (another host's, or named before owners were) once older than
    a day; a running export's stays. -> the directories removed."""
    own = temporary_prefix(out)
    here = own[: own.rstrip(".").rindex(".") + 1]  # .NAME.HOST.
    removed = []
    for entry in out.parent.iterdir():
        if not entry.name.startswith(f".{out.name}.") or entry.is_symlink() or not entry.is_dir():
            continue
        pid = entry.name[len(here):].split(".")[0] if entry.name.startswith(here) else ""
        try:
            stale = not pid_alive(int(pid)) if pid.isdigit() else time.time() - entry.stat().st_mtime > STALE_AFTER_S
        except FileNotFoundError:  # its export just finished
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
