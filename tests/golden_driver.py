"""Runs a list of tiny pipeline runs in one process, for ``test_golden.py``: the same list against the reference
code and against the current code, each found through PYTHONPATH (the driver imports nothing of the repository by
path).

    python tests/golden_driver.py SPEC.json

SPEC.json: ``{"modules": {"pretrain": <module>, "finetune": <module>}, "runs": [{"name", "script", "args"}, ...],
"report": <path>, "prefixes": [<module name prefixes whose files are reported>]}``. Each run calls
``<module>.main(args)`` in the working directory; the report (JSON) holds every run's exit code (or traceback), the
file of every loaded module under ``prefixes``, so the test can check which code ran, the pretrain module's
``METHODS`` and the defaults of every objective config class ``patchplace.objectives`` exports.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import traceback
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    results: dict[str, dict] = {}
    modules = {}
    for script, name in spec["modules"].items():
        modules[script] = importlib.import_module(name)
    for run in spec["runs"]:
        print(f"=== golden run {run['name']}: {run['script']} {' '.join(run['args'])}", flush=True)
        try:
            args, stop = stopped_args(modules[run["script"]], list(run["args"]))
            code = modules[run["script"]].main(args) if stop is None else stopped_main(modules[run["script"]], args,
                                                                                         stop)
            results[run["name"]] = {"code": code}
        except SystemExit as exc:
            results[run["name"]] = {"code": exc.code}
        except Exception:
            results[run["name"]] = {"code": None, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        # Accelerate keeps one state per process, which refuses another mixed precision: each run starts afresh
        # (accelerate's own test idiom), as it would in a process of its own
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    loaded = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    files = {name: str(Path(file).resolve()) for name, file in loaded.items()
             if file and name.split(".")[0] in spec["prefixes"]}
    methods = sorted(getattr(modules.get("pretrain"), "METHODS", None) or [])
    report = {"runs": results, "modules": files, "methods": methods, "objective_defaults": objective_defaults()}
    Path(spec["report"]).write_text(json.dumps(report, indent=1))
    return 0


def stopped_args(module, args: list[str]) -> tuple[list[str], int | None]:
    """``run.stop_after=N`` (the reference's stop for tests) for a code without it: the arguments without it and N
    (the run is then stopped after N optimizer steps as a user stops one, by SIGTERM: :func:`stopped_main`)."""
    stop = next((a for a in args if a.startswith("run.stop_after=")), None)
    if stop is None or not module.__name__.startswith("patchplace.pipelines"):
        return args, None
    return [a for a in args if a != stop], int(stop.split("=", 1)[1])


def stopped_main(module, args: list[str], steps: int) -> int:
    """``module.main(args)`` with a SIGTERM agreed after ``steps`` optimizer steps (a checkpoint of that step, then
    the interruption): exit 0 where the run stopped there, as the reference's run.stop_after did."""
    import signal

    from patchplace.pipelines.engine import guards

    agreed, calls = guards.StopSignals.agreed, []

    def stop_after(self, accelerator):
        calls.append(1)
        return signal.SIGTERM if len(calls) >= steps else agreed(self, accelerator)

    guards.StopSignals.agreed = stop_after
    try:
        code = module.main(args)
    finally:
        guards.StopSignals.agreed = agreed
    return 0 if code == 128 + signal.SIGTERM and len(calls) == steps else code


def objective_defaults() -> dict[str, dict]:
    """{config class name: its default fields} of the objective configs ``patchplace.objectives`` exports (none in
    a tree without ``ObjectiveConfig``: the test that reads them says so)."""
    objectives = importlib.import_module("patchplace.objectives")
    base = getattr(objectives, "ObjectiveConfig", None)
    if base is None:
        return {}
    return {name: json.loads(json.dumps(dataclasses.asdict(cls())))
            for name, cls in sorted(vars(objectives).items())
            if isinstance(cls, type) and issubclass(cls, base) and cls is not base and dataclasses.is_dataclass(cls)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
