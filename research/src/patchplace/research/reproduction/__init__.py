"""The reproduction study; ``pipelines/study.py`` is its command line.

    plan.py     the budget knobs (``StudyConfig``), the groups, one ``Run`` per table row, ``CONFIGS``
    runner.py   the stages of each (run, seed) below ``runs/``: pretrain.py, finetune.py, evaluate.py,
                controls.py, ONNX export + ONNX Runtime, each its command line as a process of its own
                (``python -m ...``); each stage resumable
    metrics.py  the numbers the stages left (results.json, logs), merged with an earlier study.json
    claims.py   the papers' claims as a table of specs (``PAPER_CLAIMS``) built in one loop and decided by
                seed-paired tests, the statistics helpers of the tables, the random-init control a row is read
                against
    report.py   markdown tables (one function per section), the claims table, PNG figures and
                ``results/<name>.{json,md}``
    protocol.py a pre-registered protocol (research/protocols/): its hash and commit, each row's provenance, the
                rows refused and the pairs never formed, the PE-free position ceiling, the doubling rule
    schedule.py the order a protocol's rows run in: seed 0, the doubling rule on validation (recorded), the rest

Nothing here imports an entry point: the stages are processes (tests/test_layout.py checks it).
"""
