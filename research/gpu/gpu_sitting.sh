#!/usr/bin/env bash
# One sitting of the GPU study on a lent, bare GPU machine (its python3 has torch, timm, accelerate,
# onnx, ...; not webdataset / braceexpand): put the carried wheels and this repository's packages on
# PYTHONPATH, build the Fashion-MNIST shards from the carried IDX files, run the pending units of
# study_gpu.yaml that fit MINUTES (the committed bundles say which are done), and write a bundle per
# finished unit to results/study_gpu_bundles and $OUT.
#
#   make gpu-carry                 # here, once: .gpu/ = the wheels + the four Fashion-MNIST IDX files
#   device run: bash research/gpu/gpu_sitting.sh 7 [study overrides]    carry: [".gpu"]
#   then here: copy the returned bundles into results/study_gpu_bundles/, `make study-gpu-merge`,
#   commit.
#   bash research/gpu/gpu_sitting.sh --help     this text
set -euo pipefail
case "${1:-}" in  # before anything runs or is written
  -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-; exit 0 ;;
esac
minutes=${1:-7}
shift || true
source research/gpu/gpu_env.sh gpu-sitting
out=${OUT:-/tmp/sitting-out}
mkdir -p "$out"
# the sitting ends a minute before the command's limit: the bundles are written as each unit finishes
"$PY" pipelines/study.py --config pipelines/configs/study_gpu.yaml --sitting "$minutes" \
  --bundles results/study_gpu_bundles --bundles-out "$out" "$@" 2>&1 | tee "$out/sitting.log"
