"""The reproduction study; ``pipelines/study.py`` is its command line.

    plan.py     the budget knobs (``StudyConfig``), the groups, one ``Run`` per table row, ``CONFIGS``
    runner.py   the stages of each (run, seed) below ``runs/``: pretrain.py, finetune.py, evaluate.py,
                controls.py (the gate), each its command line, in this process or as one of its own; each stage
                resumable
    metrics.py  the numbers the stages left (results.json, logs), merged with an earlier <name>.json
    corpora.py  the corpus a row was made on (manifest fingerprints), so no row is merged for another
    stats.py    seed-paired tests, Holm, Welch, a paired test's power and the effect it detects at 80%
    gate.py     the learned gate: a feature counts as learned by a one-sided Welch test on validation
    claims.py   the protocol's claims, each decided in its regime by its Holm family
    report.py   results/<name>.{json,md} of a protocol: claims, rows, corrections (corrections.py), minutes
                (wallclock.py)
    protocol.py a pre-registered protocol (research/protocols/): its hash and commit, each row's provenance, the
                rows refused and the pairs never formed, the PE-free position ceiling, the doubling rule
    schedule.py the order a protocol's rows run in: seed 0, the doubling rule on validation (recorded), the rest

Nothing here imports an entry point: the stages are processes (tests/test_layout.py checks it).
"""
