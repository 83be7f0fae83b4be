"""The command lines' entry points (pipelines/*.py, the ``patchplace-*`` console scripts): ``--help`` is answered
from the torch-free config classes (:mod:`patchplace.pipelines.commands`) and the command module's docstring read
from its source, in about a second; anything else imports the command (torch, timm, accelerate) and runs it."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from patchplace.pipelines import commands
from patchplace.pipelines.config import ConfigError, one_line, precheck
from patchplace.pipelines.help import parser

CONFIGS = {"pretrain": commands.PretrainConfig, "finetune": commands.FinetuneConfig,
           "evaluate": commands.EvaluateConfig}


def help_asked(argv: list[str]) -> bool:
    """Whether argparse would print the help for ``argv`` (``-h`` / ``--help`` or an abbreviation of it)."""
    return any(arg == "-h" or (len(arg) > 3 and "--help".startswith(arg)) for arg in argv)


def description(command: str) -> str:
    """The docstring of ``patchplace.pipelines.<command>`` (or of the module a dotted ``command`` names in full, e.g.
    ``patchplace.research.study``), read from its source without running it."""
    spec = importlib.util.find_spec(command if "." in command else f"patchplace.pipelines.{command}")
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text()), clean=False) or ""


def main(command: str, argv: list[str] | None = None) -> int:
    """``command``'s main on ``argv`` (default: the process's arguments); ``--help`` without importing it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = commands.expand_flags(argv) if command == "evaluate" else argv
    if help_asked(argv):
        parser(CONFIGS[command], description(command), given).parse_args(given)  # prints the help, exits 0
    try:
        precheck(CONFIGS[command], given)
    except ConfigError as exc:  # every rank of a launch refuses alike; rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"patchplace.pipelines.{command}").main(argv)


# the console scripts (pipelines/pyproject.toml: patchplace-pretrain, patchplace-finetune, patchplace-evaluate)
pretrain, finetune, evaluate = (functools.partial(main, command) for command in ("pretrain", "finetune", "evaluate"))
