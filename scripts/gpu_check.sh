#!/usr/bin/env bash
# One prepared device check for a lent GPU (see the device tool's README): the whole suite on
# the machine (CUDA tests included), then the benchmark in bf16. Run from the repo root.
set -uo pipefail
python3 -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m pytest -q -p no:warnings tests/gpu tests/attention/test_triton_paged.py tests/engine/test_engine.py tests/models/test_generate_parity.py 2>&1 | tail -5
omnivox bench --device cuda --dtype bfloat16 --num-requests 32 --concurrency 16 --reply-frames 50 2>&1 | tail -8
