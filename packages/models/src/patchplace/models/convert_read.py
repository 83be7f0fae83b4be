"""Reading an authors' released file without running any of its code (:mod:`patchplace.models.convert`):
safetensors as they are (a patchplace checkpoint's own weights refused), pickles disassembled first
(:mod:`pickletools`: a class or function beyond tensors, containers and the two training-record classes is refused
by name before anything is unpickled), then ``torch.load(weights_only=True)``."""

from __future__ import annotations

import hashlib
import io
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from .errors import ModelError
from .hub import CONFIG_NAME, FORMAT

Weights = dict[str, torch.Tensor]


class TrainingRecord:
    """What an ``argparse.Namespace`` in an authors' file is read as: its attributes as plain data (no code of the
    file's class runs; see :func:`read_file`)."""


# Classes the authors' training checkpoints pickle beside the weights (MAE / DeiT: the argparse Namespace 'args';
# MJP, a Swin-Transformer code base: the yacs CfgNode 'config'), mapped to inert stand-ins. CfgNode is a dict
# subclass: an OrderedDict takes its items and attributes exactly as the weights-only unpickler fills a dict.
RECORD_CLASSES = {"argparse.Namespace": TrainingRecord, "yacs.config.CfgNode": OrderedDict}


def read_file(path: str | Path) -> Any:
    """The object in a released file, loaded without running any of its code: safetensors as they are (a
    patchplace checkpoint's own ``model.safetensors`` is refused: it needs no conversion); pickles with
    ``torch.load(weights_only=True, mmap=True)`` after listing the classes they name (one not in
    :data:`RECORD_CLASSES` is refused by name before anything is unpickled; so is a plain pickle, which is not
    ``torch.save``'s format)."""
    path = Path(path)
    check_input(path)
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    refuse_foreign_classes(path)
    with warnings.catch_warnings():  # torch's "detected pickle protocol" warning: the refusal below says it all
        warnings.simplefilter("ignore")
        with torch.serialization.safe_globals([(cls, name) for name, cls in RECORD_CLASSES.items()]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
            except Exception as exc:  # pickle, zip and torch errors alike: the file is refused
                raise ModelError(f"{path} cannot be read as a PyTorch checkpoint with weights_only=True "
                                 f"({_first_line(exc)}): damaged, or not a torch.save file; download it again"
                                 ) from None


def check_input(path: Path) -> None:
    """Refuse, in one line with the fix, a FILE that is not a file to read: missing, a directory (a patchplace
    checkpoint directory needs no conversion), or empty (an interrupted download)."""
    if path.is_dir():
        if (path / CONFIG_NAME).is_file():
            raise ModelError(f"{path} is a patchplace checkpoint directory, which needs no conversion: pass it as it "
                             f"is (load_pretrained, model.checkpoint={path}, python -m patchplace.export {path})")
        raise ModelError(f"{path} is a directory, not a released weights file: give the .pth / .pth.tar / .bin / "
                         ".safetensors file itself")
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise ModelError(f"{path} is empty (0 bytes): an interrupted download or copy; download the file again")


def read_safetensors(path: Path) -> Weights:
    """A ``.safetensors`` file's tensors; a patchplace checkpoint's own weights (its header names the format) are
    refused: converted, they would be relabelled an authors' release (method, license, probe feature)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        weights = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise ModelError(f"{path} is not a readable safetensors file ({_first_line(exc)}): damaged; download it "
                         "again") from None
    if header.get("format") == FORMAT:
        raise ModelError(f"{path} is the weights file of a patchplace checkpoint (its header says {FORMAT}), not an "
                         f"authors' release: use its directory {path.parent} as it is (load_pretrained, "
                         f"model.checkpoint={path.parent}); converting it would relabel it")
    return weights


def refuse_foreign_classes(path: Path) -> None:
    """Refuse, naming them, the classes and functions a pickle would create or call beyond tensors and containers
    (e.g. ``posix.system``), read by disassembly (:func:`pickle_globals`): the file is not unpickled at all. Also
    refused: a plain pickle (``pickle.dump``, not ``torch.save``), and a pickle protocol above 3, which
    ``torch.load(weights_only=True)`` cannot read (its FRAME opcode)."""
    from torch._weights_only_unpickler import _get_allowed_globals  # torch's own allowlist of weights_only

    found, protocol = pickle_globals(path)
    foreign = sorted(found - set(_get_allowed_globals()) - set(RECORD_CLASSES))
    if foreign:
        raise ModelError(f"refusing {path}: its pickle names {', '.join(foreign)}, which loading would create or call "
                         "(only tensors, containers, argparse.Namespace and yacs CfgNode records are read); this is "
                         "not a released weights file, or one re-saved with other objects in it")
    if protocol > 3:
        raise ModelError(f"{path} was pickled with protocol {protocol}, which torch.load(weights_only=True) cannot "
                         "read (and nothing here unpickles a file otherwise): re-save it where it was made with "
                         "torch.save(obj, FILE) at torch's default protocol, or with safetensors.torch.save_file")


TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of torch.save(_use_new_zipfile_serialization=False)


def pickle_globals(path: Path) -> tuple[set[str], int]:
    """(the ``module.name`` globals a checkpoint's pickles name, their pickle protocol), read by
    :mod:`pickletools` (nothing runs): a zip checkpoint's ``data.pkl``; torch's legacy format, four pickles
    (magic number, protocol, system info, the object). A file whose first pickle is not torch's magic number is a
    plain pickle, refused: ``torch.load`` reads none without unpickling it."""
    if _is_zip(path):
        try:
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                data = archive.read(name)
        except Exception as exc:  # a damaged archive, or one without data.pkl
            raise ModelError(f"{path} is not a readable PyTorch checkpoint ({_first_line(exc)}): damaged; download "
                             "it again") from None
        _, found, protocol = _pickle_globals(io.BytesIO(data), path)
        return found, protocol
    with open(path, "rb") as f:
        first, found, protocol = _pickle_globals(f, path)
        if first != TORCH_LEGACY_MAGIC:
            raise ModelError(f"refusing {path}: a plain pickle (pickle.dump, not torch.save's format)"
                             + (f" naming {', '.join(sorted(found))}" if found else "")
                             + ", which only running its code could read; re-save the weights where they were made "
                             "with torch.save(state_dict, FILE) or safetensors.torch.save_file")
        for _ in range(3):  # protocol version, system info, the object
            _, more, protocol = _pickle_globals(f, path)
            found |= more
    return found, protocol


def _pickle_globals(f: Any, path: Path) -> tuple[Any, set[str], int]:
    """(the last integer constant of one pickle read from ``f`` up to its STOP, the globals it names, its protocol)
    by :func:`pickletools.genops`, which disassembles and runs nothing."""
    import pickletools

    found: set[str] = set()
    strings: list[str] = []  # STACK_GLOBAL takes module and name from the two strings pushed before it
    memo: dict[int, Any] = {}
    last: Any = None  # the value the last op pushed (what MEMOIZE / PUT store)
    constant, protocol = None, 2
    try:
        for op, arg, _ in pickletools.genops(f):
            if op.name == "PROTO":
                protocol = arg
            elif op.name == "GLOBAL":
                found.add(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.add(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "MEMOIZE":
                memo[len(memo)] = last
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = last
            elif op.name in ("GET", "BINGET", "LONG_BINGET") and isinstance(memo.get(arg), str):
                strings.append(memo[arg])
            if op.name not in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                last = arg
            if isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name):
                strings.append(arg)
            elif isinstance(arg, int) and op.name in ("LONG1", "LONG4", "LONG", "INT", "BININT", "BININT1",
                                                      "BININT2"):
                constant = arg
    except Exception as exc:  # not a pickle at all (or cut short)
        raise ModelError(f"{path} is not a PyTorch checkpoint (neither torch.save's zip archive nor a pickle: "
                         f"{_first_line(exc)}): damaged, or another format; download it again") from None
    return constant, found, protocol


def _is_zip(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = [line for line in text if "GLOBAL" in line or "Unsupported" in line]
    return (detail or text or [type(exc).__name__])[0][:300]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()
