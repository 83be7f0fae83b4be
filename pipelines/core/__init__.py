"""The pipelines' machinery, imported by the entry points beside this package (``pipelines/*.py``) as
``from core.config import ...`` / ``from core import engine``: a script's directory is ``sys.path[0]``, so nothing
needs installing.

    config.py      YAML configs in ``pipelines/configs/`` + ``section.field=value`` overrides -> validated
                   dataclasses; ``--help`` with every field
    engine.py      the shared training engine: Accelerate set-up, data readers, optimizer and schedule, the training
                   loop, evaluation, logs, checkpoints and exact resume
    rundir.py      one run per directory, and the crash-consistent checkpoint protocol (write, verify, resume)
    stages.py      resumable multi-stage jobs (demo, study: ``DONE`` records, locks) and the hardware line of tables
    evaluation.py  what evaluate.py, controls.py and the study's report share: the first images of a split, the
                   linear probe with a progress bar, MJP's Fig. 5 grid of gradient-inversion reconstructions

Nothing here imports an entry point (tests/test_layout.py checks it).
"""
