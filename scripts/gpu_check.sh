#!/bin/bash
# looptrain's CUDA check in one call, for a GPU machine lent for a few minutes (docs/testing.md, "On a GPU"):
# the environment, the gpu tests, the estimator against the caching allocator, Trainer beside looptrain, the
# planner at 4 GiB, then the whole suite. Each step has its own time limit, and writes under $OUT as it goes.
#
# Prepared beforehand on any machine (nothing needs the GPU):
#   .gpu/site/                  bitsandbytes unpacked from its manylinux wheel, if the GPU machine lacks it
#   .gpu/cuda_estimates.json    PYTHONPATH=. python scripts/bench_cuda.py estimate --out .gpu/cuda_estimates.json
# Then, on the GPU machine, from the repository's root:  OUT=gpu-out bash scripts/gpu_check.sh
# Each step's limit is a variable (WORKSPACE_S, GPU_TESTS_S, BERT_S, DECODER_S, MACBERT_S, PLAN_S, SUITE_S); 0 skips it.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD/.gpu/site:$PWD
started=$(date +%s)
step() { echo "$1 done at $(( $(date +%s) - started )) s" >> "$OUT/env.txt"; }
# limited SECONDS COMMAND...: the command under a time limit; a limit of 0 skips it (`timeout 0` would not limit)
limited() { local seconds=$1; shift; [ "$seconds" -gt 0 ] && timeout -s INT "$seconds" "$@"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import sys, torch, transformers, peft, bitsandbytes; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__, bitsandbytes.__version__)"
} > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1 || echo "editable install failed" >> "$OUT/env.txt"
step setup
limited "${WORKSPACE_S:-30}" python3 scripts/bench_cuda.py workspace --out "$OUT/workspace.json" > "$OUT/workspace.log" 2>&1
limited "${GPU_TESTS_S:-330}" python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_cuda.py > "$OUT/gpu_tests.log" 2>&1
step "gpu tests"
bench="python3 scripts/bench_cuda.py measure --estimates .gpu/cuda_estimates.json --updates 2"
limited "${BERT_S:-120}" $bench --sections ladder,trainer --shapes bert-large --out "$OUT/bert.json" > "$OUT/bench.log" 2>&1
limited "${DECODER_S:-45}" $bench --sections decoder --out "$OUT/decoder.json" >> "$OUT/bench.log" 2>&1
limited "${MACBERT_S:-90}" $bench --sections ladder --shapes macbert-large --out "$OUT/macbert.json" >> "$OUT/bench.log" 2>&1
limited "${PLAN_S:-150}" $bench --sections plan --out "$OUT/plan.json" > "$OUT/plan.log" 2>&1
step bench
OMP_NUM_THREADS=2 limited "${SUITE_S:-130}" python3 -m pytest -q -rfE -m "not slow" -p no:cacheprovider -n 8 \
    --timeout 120 > "$OUT/suite.log" 2>&1
step suite
cat "$OUT/env.txt" "$OUT/workspace.log"; tail -5 "$OUT/gpu_tests.log"; grep -v "Warning\|warn\|train_runtime" "$OUT/bench.log" | tail -45
tail -3 "$OUT/plan.log"; tail -15 "$OUT/suite.log"
