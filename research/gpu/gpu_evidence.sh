#!/usr/bin/env bash
# The GPU evidence on a lent, bare GPU machine, one device call at a time: each call runs the STEPs
# it is given in order, skips those that no longer fit its time (DEADLINE seconds, default 540: a
# call has 600), and leaves every result in $OUT as soon as it exists. Results accumulate in
# runs/gpu_evidence/ (ignored: it survives while the machine stays warm; seeded from results/ when
# absent, so copy $OUT's files into results/ after each call).
#
#   make gpu-carry                          here, once (.gpu/: wheels + Fashion-MNIST IDX files)
#   device run: bash research/gpu/gpu_evidence.sh STEP [STEP ...]
#               carry: [".gpu"] (+ one ".ort/pK" per call)
#   bash research/gpu/gpu_evidence.sh --help   this text
#
# Steps:
#   table2             MP3 Table 2 + every objective's step, ViT-B/16 224 px bf16, batch 128, both
#                      attention kernels (benchmark.py --suite mp3_table2): ~4 min on an H100
#   speed:M1,M2,...    the study ViT up the speed ladder for these methods (benchmark.py --suite
#                      speed --update; supervised mp3 droppos mae ijepa stop mjp randsac finetune):
#                      ~3 min per method
#   profile:OBJ,...    torch.profiler tables of these objectives' ViT-B steps (--suite profile)
#   sitting:MIN        a sitting of the GPU study (study_gpu.yaml) of MIN minutes; bundles to $OUT
#   position4px:W      study v5's 4 px position claims (study_v5_gpu4px.yaml, reproduction/
#                      waves.py): the study ViT's rate (~20 s, 4 processes sharing the GPU), the
#                      epochs sized once (sizing.json), then the first pending wave up to W (wave
#                      k: seed k - 1 of the four rows side by side), a bundle per finished unit
#                      to $OUT at once: ~9 min
#   onnx-prepare       what ONNX Runtime on CUDA needs besides the wheel: the classifier trained and
#                      exported
#   onnx               ONNX Runtime on CUDA (research/gpu/gpu_onnx.sh: needs every .ort/pK part here)
#
# The order: research/gpu/plan.txt (python -m patchplace.research.reproduction.gpu_plan next:
# the first line not done). After the call, here: cp the returned files into results/ (bundles into
# results/study_gpu_bundles/; position4px's bundles and sizing.json into
# results/study_v5_gpu4px_bundles/), commit.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;  # before anything runs or is written
  "") usage; exit 2 ;;
esac
start=$SECONDS deadline=${DEADLINE:-540}
out=${OUT:-/tmp/gpu-evidence-out} work=runs/gpu_evidence
mkdir -p "$out" "$work"
source research/gpu/gpu_env.sh gpu-evidence
for f in benchmark.md benchmark.json benchmark_mp3_table2.json benchmark_speed.json; do
  [ -f "$work/$f" ] || [ ! -f "results/$f" ] || cp "results/$f" "$work/$f"
done

fits() {  # fits NAME SECONDS: whether a step needing SECONDS still fits this call
  local left=$((deadline - (SECONDS - start)))
  if [ "$left" -lt "$2" ]; then
    echo "[gpu-evidence] $1: skipped, ~$2 s needed and $left s left in this call; give it the next one"
    return 1
  fi
  echo "[gpu-evidence] $1: starting ($left s left)"
}
keep() {  # copy results into $OUT as soon as they exist
  for f in "$@"; do [ -f "$f" ] && cp "$f" "$out/"; done
  return 0
}

for step in "$@"; do
  name=${step%%:*} arg=${step#*:}
  case "$name" in
    table2)
      fits table2 240 || continue
      "$PY" pipelines/benchmark.py --suite mp3_table2 --batch 128 --repeats 10 --mp3-etas 0.5 0.75 0.9 \
        --mae-ratios 0.75 --out "$work" 2>&1 | tee "$out/table2.log"
      keep "$work/benchmark_mp3_table2.json" "$work/benchmark_mp3_table2.md" "$work/benchmark.md" ;;
    speed)
      IFS=, read -ra methods <<< "$arg"
      fits "speed ${arg}" $((180 * ${#methods[@]})) || continue
      "$PY" pipelines/benchmark.py --suite speed --speed-methods "${methods[@]}" --update --out "$work" 2>&1 \
        | tee -a "$out/speed.log"
      keep "$work/benchmark_speed.json" "$work/benchmark_speed.md" ;;
    profile)
      IFS=, read -ra objectives <<< "$arg"
      fits "profile ${arg}" 90 || continue
      "$PY" pipelines/benchmark.py --suite profile --objectives "${objectives[@]}" --batch 128 --out "$work" 2>&1 \
        | tee "$out/profile.log"
      keep "$work/benchmark_profile.json" "$work/benchmark_profile.md" ;;
    sitting)
      minutes=$(( (deadline - (SECONDS - start)) / 60 - 1 ))
      [ "$minutes" -gt "$arg" ] && minutes=$arg
      fits "sitting" 120 || continue
      "$PY" pipelines/study.py --config pipelines/configs/study_gpu.yaml --sitting "$minutes" \
        --bundles results/study_gpu_bundles --bundles-out "$out" 2>&1 | tee "$out/sitting.log" ;;
    position4px)
      fits position4px 240 || continue
      "$PY" -m patchplace.research.reproduction.waves --config pipelines/configs/study_v5_gpu4px.yaml \
        --wave "$arg" --bundles results/study_v5_gpu4px_bundles --out "$out" \
        --seconds $((deadline - (SECONDS - start) - 10)) 2>&1 | tee "$out/position4px.log" ;;
    onnx-prepare)
      fits onnx-prepare 120 || continue
      bash research/gpu/gpu_onnx.sh --prepare 2>&1 | tee "$out/onnx_prepare.log" ;;
    onnx)
      fits onnx 150 || continue
      bash research/gpu/gpu_onnx.sh 2>&1 | tee "$out/onnx.log" ;;
    *)
      echo "[gpu-evidence] unknown step $step (table2 speed:M,.. profile:O,.. sitting:MIN position4px:W" \
        "onnx-prepare onnx)" >&2
      exit 2 ;;
  esac
done
echo "[gpu-evidence] done in $((SECONDS - start)) s; files in $out: $(ls "$out" | tr '\n' ' ')"
