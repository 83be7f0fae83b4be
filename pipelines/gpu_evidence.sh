#!/usr/bin/env bash
# The GPU evidence plan (docs/benchmarks.md): research/gpu/gpu_evidence.sh, run from the repository root.
exec bash "$(dirname "$0")/../research/gpu/gpu_evidence.sh" "$@"
