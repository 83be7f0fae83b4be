"""patchplace.research: the project's own evidence, a client of patchplace.pipelines (its public API and its
command lines as subprocesses), never a part of it.

    study.py        the reproduction study (``python pipelines/study.py``; reproduction/: plan, runner, claims,
                    report, protocol, schedule)
    controls.py     raw-pixel and random-init controls for a study row (``python pipelines/controls.py``)
    benchmark.py    speed and memory suites (``python pipelines/benchmark.py``; benchmarks/: one module a family)

On a CUDA machine the GPU work is ``pytest -m gpu``, ``python pipelines/benchmark.py --suite gpu`` and the study's
own resumable command (``python pipelines/study.py --config pipelines/configs/study_v5_gpu4px.yaml``).
"""
