"""The package is installed as a portion of the PEP 420 namespace `patchplace`."""

import importlib
from pathlib import Path


def test_installed_from_this_checkout_as_namespace_portion():
    module = importlib.import_module("patchplace.finetune")
    here = Path(__file__).resolve().parents[1] / "src" / "patchplace" / "finetune"
    assert Path(module.__file__).resolve().parent == here
    namespace = importlib.import_module("patchplace")
    assert getattr(namespace, "__file__", None) is None, "patchplace must stay a namespace (no __init__.py)"
