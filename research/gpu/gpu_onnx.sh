#!/usr/bin/env bash
# ONNX Runtime on CUDA on a lent, bare GPU machine (its python3 has torch cu130 + the nvidia-* CUDA / cuDNN packages and
# the CPU build of onnxruntime): the onnxruntime-gpu wheel comes in parts (make gpu-ort-parts: .ort/p0/, .ort/p1/, ...,
# one part per call, the machine keeping what earlier calls left when the next comes within 30 s), is put back together
# and installed to /tmp/ort-site, first on PYTHONPATH (it shadows the CPU onnxruntime); a small classifier is trained on
# the GPU (finetune.py from scratch) and exported, and python -m patchplace.export.evaluate --provider cuda measures it
# on CUDAExecutionProvider against PyTorch eager on the same GPU: parity, test top-1, latency at batch 1 and 64.
# Results: $OUT/onnx_cuda.{json,md} on the device (else results/onnx_cuda.{json,md}). docs/study.md, "ONNX Runtime on
# CUDA, brought in parts", gives the call sequence:
#
#   here, once: make gpu-carry gpu-ort-parts
#   call 1, carry [".gpu"]:          bash research/gpu/gpu_onnx.sh --prepare     (wheels, shards, classifier, export)
#   calls 2-5, carry [".ort/pK"]:    python3 research/gpu/gpu_parts.py status    (K = 0 .. 3)
#   call 6, carry [".ort/p4"]:       bash research/gpu/gpu_onnx.sh               (wheel, install, evaluation)
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash research/gpu/gpu_onnx.sh [options] [section.field=value ...]

Options:
  --prepare          only what needs no onnxruntime-gpu: the carried wheels (.gpu/whl), the
                     Fashion-MNIST shards (from .gpu/fashion-mnist), the classifier trained and
                     exported; prints how far the parts have come; exit 0
  --provider P       cuda (default): onnxruntime-gpu from .ort/p*/, refused in one line unless the
                     session runs on CUDAExecutionProvider; cpu: the onnxruntime already installed,
                     on its CPU provider (no parts needed; results named onnx_cpu.*)
  --checkpoint DIR   evaluate this classifier checkpoint (exported into the run directory) instead
                     of training one
  --onnx PATH        evaluate this exported model.onnx (model.json beside it); with --checkpoint
                     for parity and PyTorch timing
  --epochs N         epochs of the classifier trained from scratch (default: 5)
  --run DIR          working directory: classifier, export, evaluation (default: runs/onnx_cuda)
  --limit N          evaluate the first N test images (default: all 10,000)
  --repeats N        timed runs per runner and batch size (default: 200; warm-up 20)
  -h, --help         this text
  section.field=value  passed to pipelines/finetune.py when it trains the classifier
                     (e.g. optim.max_steps=20)

Environment: OUT (results go to $OUT/onnx_<provider>.{json,md}, else results/), PYTHON (default:
python3, or .venv/bin/python where a .venv exists), ORT_SITE (default /tmp/ort-site), ORT_WHEEL_DIR
(default /tmp/ort-wheel).
EOF
}

prepare_only=0 provider=cuda checkpoint="" onnx="" epochs=5 run=runs/onnx_cuda limit="" repeats=200 trained=""
overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) prepare_only=1 ;;
    --provider) provider=${2:?--provider needs cuda or cpu}; shift ;;
    --checkpoint) checkpoint=${2:?--checkpoint needs a directory}; shift ;;
    --onnx) onnx=${2:?--onnx needs a path}; shift ;;
    --epochs) epochs=${2:?--epochs needs a number}; shift ;;
    --run) run=${2:?--run needs a directory}; shift ;;
    --limit) limit=${2:?--limit needs a number}; shift ;;
    --repeats) repeats=${2:?--repeats needs a number}; shift ;;
    -h|--help) usage; exit 0 ;;
    *=*) overrides+=("$1") ;;
    *) echo "error: unknown argument $1 (bash research/gpu/gpu_onnx.sh --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$provider" in cuda|cpu) ;; *) echo "error: --provider must be cuda or cpu, got $provider" >&2; exit 2 ;; esac

say() { echo "[gpu-onnx] $*"; }
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # progress bars: a line per 10 s, not per step
ORT_SITE=${ORT_SITE:-/tmp/ort-site}
ORT_WHEEL_DIR=${ORT_WHEEL_DIR:-/tmp/ort-wheel}

# the carried wheels, this repository's packages on PYTHONPATH, the shards (sets PY)
source research/gpu/gpu_env.sh gpu-onnx
# how far the wheel has travelled (every call prints it)
"$PY" research/gpu/gpu_parts.py status --parts .ort || true
test_split=shards/fashion_mnist/test
mkdir -p "$run"

# the classifier: given, or trained here from scratch (the demo's short recipe), then exported once per checkpoint
if [ -z "$onnx" ]; then
  if [ -z "$checkpoint" ]; then
    checkpoint=$run/classifier/checkpoint
    if [ ! -f "$run/classifier/DONE" ]; then
      say "training the classifier: vit_cpu_narrow, patch 4, $epochs epochs from scratch"
      "$PY" pipelines/finetune.py --config pipelines/configs/finetune_fashion_mnist.yaml \
        "run.output=$run/classifier" run.resume=true model.preset=vit_cpu_narrow "optim.epochs=$epochs" \
        finetune.mixup=0.0 finetune.cutmix=0.0 optim.layer_decay=null "data.scale=[0.8, 1.0]" data.batch_size=256 \
        ${overrides[@]+"${overrides[@]}"}
      touch "$run/classifier/DONE"
    fi
    trained="vit_cpu_narrow, patch 4, trained from scratch by pipelines/finetune.py for $epochs epochs"
    trained+="${overrides[*]+ (${overrides[*]})}"
  fi
  onnx=$run/export/model.onnx
  exported=$(cat "$run/export/CHECKPOINT" 2>/dev/null || true)
  if [ ! -f "$onnx" ] || [ ! -f "${onnx%.onnx}.json" ] || [ "$exported" != "$checkpoint" ]; then
    say "exporting $checkpoint -> $onnx"
    rm -f "$run/export/CHECKPOINT"
    "$PY" -m patchplace.export "$checkpoint" --out "$onnx" --data $test_split >"$run/export.json"
    echo "$checkpoint" >"$run/export/CHECKPOINT"
  fi
fi

if [ "$prepare_only" = 1 ]; then
  say "prepared: $onnx${checkpoint:+ (from $checkpoint)}; the wheel's parts:"
  "$PY" research/gpu/gpu_parts.py status --parts .ort || true
  exit 0
fi

# onnxruntime-gpu: put back together from the parts (one line and exit 2 when one is missing or damaged), installed
# once per wheel into ORT_SITE, first on PYTHONPATH; the CUDA / cuDNN libraries of torch's nvidia-* packages on
# LD_LIBRARY_PATH (the evaluator also calls onnxruntime.preload_dlls() after importing torch)
if [ "$provider" = cuda ]; then
  wheel=$("$PY" research/gpu/gpu_parts.py reassemble --parts .ort --out "$ORT_WHEEL_DIR")
  marker=$ORT_SITE/.installed-$(basename "$wheel")
  here=$("$PY" -c 'import platform; print(platform.python_version(), platform.machine())')
  if [[ "$here" != "3.12."*" x86_64" ]]; then
    say "$(basename "$wheel") is for CPython 3.12 on x86_64, $PY is $here: not installed (the evaluation below says" \
      "what runs instead)"
  elif [ ! -f "$marker" ]; then
    rm -rf "$ORT_SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ORT_SITE" "$wheel"
    touch "$marker"
  fi
  export PYTHONPATH=$ORT_SITE:$PYTHONPATH
  nvlibs=$("$PY" - <<'EOF'
import glob
import os

try:
    import nvidia
except ImportError:
    raise SystemExit(0) from None
print(":".join(sorted({os.path.dirname(f) for base in nvidia.__path__
                       for f in glob.glob(os.path.join(base, "*", "lib", "lib*.so*"))})))
EOF
)
  if [ -n "$nvlibs" ]; then export LD_LIBRARY_PATH=$nvlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
  "$PY" -c "import onnxruntime as o; print('[gpu-onnx] onnxruntime', o.__version__, 'from', o.__file__,
o.get_available_providers())"
fi

name=onnx_$provider
say "evaluating $onnx on the $provider provider"
"$PY" -m patchplace.export.evaluate "$onnx" --data $test_split --out "$run/eval_$provider" --provider "$provider" \
  ${checkpoint:+--checkpoint "$checkpoint"} --robustness-limit 0 --consistency-limit 1000 --latency-batches 1 64 \
  --latency-repeats "$repeats" --latency-warmup 20 ${limit:+--limit "$limit"}

dest=${OUT:-results}
mkdir -p "$dest"
"$PY" - "$run/eval_$provider" "$dest/$name" "$checkpoint" "${trained:-given (--checkpoint / --onnx)}" <<'EOF'
import json
import sys
from pathlib import Path

src, dest, checkpoint, classifier = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
results = json.loads((src / "results.json").read_text())
results["recipe"] = {"command": "bash research/gpu/gpu_onnx.sh", "checkpoint": checkpoint or None,
                     "classifier": classifier}
manifest = Path(".ort/p0/MANIFEST.json")
if results["environment"]["provider"] == "CUDAExecutionProvider" and manifest.is_file():
    m = json.loads(manifest.read_text())
    results["recipe"]["onnxruntime_wheel"] = {"file": m["file"], "sha256": m["sha256"]}
Path(dest + ".json").write_text(json.dumps(results, indent=2) + "\n")
classifier_line = f"Classifier: {results['recipe']['classifier']}. Made by `bash research/gpu/gpu_onnx.sh`."
Path(dest + ".md").write_text((src / "results.md").read_text() + f"\n{classifier_line}\n")
EOF
say "results: $dest/$name.json, $dest/$name.md"
cat "$dest/$name.md"
