"""The suites of ``pipelines/benchmark.py`` (its docstring documents each; that file is the command line).

    common.py     what the suites share: the study's model and loader sizes (``STUDY``), the device, a preset's
                  image setting
    compute.py    matmul (the peak), objectives (every pretraining step vs supervised), masks, models (the
                  context-only attention block)
    steps.py      what a pretraining step costs: the objectives at the study's / the papers' widths, step times,
                  memory in a fresh process, saved activation bytes, mask-generator times
    flops.py      FLOPs of a training step, counted on the step (FlopCounterMode); one block's closed form
    data.py       data (shard reads, batched augmentation, MFCC) and the loader vs training consumption
    onnx.py       onnx: PyTorch eager vs ONNX Runtime inference
    pipelines.py  pipelines (end-to-end pretrain.py per data path against the pure step), ddp (1 vs 2 processes),
                  anchor (finetune.py vs a plain timm loop): the suites that run the entry points
    activation_memory.py  activation_memory: run.activation_checkpointing's memory per method (held for the
                  backward, peak), ViT-B / ViT-L widths
    mp3.py        mp3_table2 (MP3 Table 2 on a GPU, both attention kernels), saved_bytes (its memory column on
                  any machine) and the paper's ratios
    gpu.py        gpu: every objective's step on a CUDA machine, eager and compiled, a process per row (busy
                  time, peak memory, TFLOP/s vs the bf16 peak), bounded and resumable
    speed.py      speed: the study ViT's images/s per method up a ladder of GPU settings (fused AdamW, batch,
                  compiled blocks, processes sharing the device), through pretrain.py / finetune.py
    profile.py    profile: torch.profiler's top operators per training step and the share outside compute
    report.py     benchmark.md: one table per suite with its hardware line and note, the GPU section, the figure
    suites.py     the registry (``SUITES``: name -> function(args, state) -> rows) and ``all``
"""
