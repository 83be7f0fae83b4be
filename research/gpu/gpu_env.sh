# Sourced by the gpu_*.sh scripts on a lent, bare GPU machine (its python3 has torch, timm,
# accelerate, onnx, ...; not webdataset / librosa / ...): the carried wheels (.gpu/whl, make
# gpu-carry) installed to /tmp/site, this repository's packages on PYTHONPATH, the Fashion-MNIST
# shards built from the carried IDX files when missing, and one line naming torch and the GPU. Sets
# PY (PYTHON, else .venv/bin/python where a .venv exists, else python3).
# Usage: source research/gpu/gpu_env.sh TAG
#        bash research/gpu/gpu_env.sh --help     this text
case "${1:-}" in  # before anything runs or is written; sourced, it returns to its caller
  -h|--help) sed -n '1,/^case /p' "${BASH_SOURCE[0]}" | grep '^#' | cut -c3-; return 0 2>/dev/null || exit 0 ;;
esac
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONUNBUFFERED=1
if [ -d .gpu/whl ] && [ "$PY" = python3 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for p in packages/data packages/models packages/objectives packages/finetune export pipelines research; do
  PYTHONPATH=$PWD/$p/src${PYTHONPATH:+:$PYTHONPATH}
done
export PYTHONPATH
"$PY" -c "import sys, torch; print(f'[{sys.argv[1]}] torch', torch.__version__, torch.cuda.get_device_name(0) if
torch.cuda.is_available() else 'no GPU', flush=True)" "${1:-gpu}"
if [ ! -f shards/fashion_mnist/test/manifest.json ]; then
  if [ ! -d .gpu/fashion-mnist ]; then
    echo "error: no Fashion-MNIST shards and no .gpu/fashion-mnist to build them from: carry .gpu (make gpu-carry)" >&2
    exit 2
  fi
  "$PY" data/fashion_mnist.py --src .gpu/fashion-mnist --out shards/fashion_mnist
fi
