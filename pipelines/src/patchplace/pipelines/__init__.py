"""patchplace.pipelines: the training engine over Accelerate and the command lines built on it.

    pretrain.py / finetune.py / evaluate.py / demo.py   the command lines (``python pipelines/<name>.py``, or
                                                        ``accelerate launch pipelines/<name>.py``; console scripts
                                                        ``patchplace-<name>``)
    config.py      YAML configs + ``section.field=value`` overrides -> validated dataclasses; ``--help``
    sections.py    the training sections (data, model, optim, run): each field's type, range and meaning
    commands.py    the config classes of pretrain / finetune / evaluate (no torch: ``--help`` answers in a second)
    cli.py         the scripts' and console scripts' entry: ``--help`` without torch, else the command's ``main``
    engine/        the training engine, its run directories and checkpoints (see
                   docs/design.md#5-pipelines-and-run-directories)
    stages.py      resumable multi-stage jobs (the demo; the study in patchplace.research)
    evaluation.py  the first images of a split, the linear probe, MJP's gradient-inversion grid
    datasets/      recipes that turn on-disk datasets into WebDataset shards (``python data/<recipe>.py``)

Only this package (and patchplace.research, its client) imports accelerate.
"""

from pathlib import Path


def _configs() -> Path:
    """The shipped configs: inside the installed package (a wheel carries them), else beside its source
    (``pipelines/configs/`` of a checkout, for an editable install)."""
    here = Path(__file__).resolve().parent
    packaged = here / "configs"
    found = packaged if packaged.is_dir() else here.parents[2] / "configs"
    try:  # as a user types it (pipelines/configs/...) when it lies below the working directory
        return found.relative_to(Path.cwd())
    except ValueError:
        return found


CONFIGS = _configs()
