"""Each objective's docstring shows a training loop (including what must be called per step: ``progress`` for the
schedules, I-JEPA's ``update_target``); these tests run those loops as written."""

from __future__ import annotations

import doctest

import pytest
import torch

from patchplace import objectives

OBJECTIVES = ("MP3", "DropPos", "MAE", "IJEPA", "RandSAC", "MJP", "Supervised")


@pytest.mark.parametrize("name", OBJECTIVES)
def test_the_docstring_training_loop_runs(name):
    torch.manual_seed(0)
    cls = getattr(objectives, name)
    tests = doctest.DocTestFinder(recurse=False).find(cls, name, globs={})
    assert tests and tests[0].examples, f"{name}'s docstring has no training loop"
    source = "".join(example.source for example in tests[0].examples)
    assert "for step in range(steps)" in source and "progress=" in source and ".backward()" in source
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(tests[0])
    assert runner.failures == 0, f"{name}'s docstring loop failed (see the output above)"
