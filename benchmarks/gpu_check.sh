#!/usr/bin/env bash
# The GPU check, run first whenever a session is lent a GPU (docs/benchmarks.md records its figures with the GPU named):
# the CUDA tests, fp16 parity of every bundled family, offline throughput (BERT base and XLM-R large against
# sentence-transformers) and serving load. About 8 minutes on an H100 or H200; each step has its own time limit, so one that
# hangs costs its limit, not the lease, and the rest still run.
#
#     benchmarks/gpu_prepare.sh            # here, once: wheels the GPU image lacks + MiniLM's tokenizer into .gpu/
#     bash benchmarks/gpu_check.sh         # there, from the repository root (the device tool: carry [".gpu"])
#
# Output: one log per step under $OUT (or ./.gpu-out), and a summary of exit codes at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
# TOKENIZERS_PARALLELISM stays unset, as users run: set to false, single-threaded tokenizing bounded WDE on the H200
# at ~200k tokens/s for BERT base and XLM-R large alike (tests/conftest.py sets it for the tests).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
declare -A RC

STEPS=${STEPS:-}  # e.g. STEPS="cuda_tests gpu_parity" runs only those steps (a rerun within what is left of a lease)

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, keep the exit code
    local name=$1 limit=$2; shift 2
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    RC[$name]=$?
    echo "    rc ${RC[$name]} in $((SECONDS - t0)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c 'import torch, triton, transformers, sentence_transformers as st; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "sentence-transformers", st.__version__)'
    nproc; date -u
} 2>&1 | tee "$OUT/host.txt"

# The GPU image has torch, transformers and triton but not WDE's serving dependencies: install the carried wheels
# (no index: nothing can be fetched there), then WDE itself, editable, so wde.kernels / wde.workflows map as installed.
if [ -d .gpu/wheels ]; then
    $PY -m pip install -q --no-index --find-links .gpu/wheels fastapi uvicorn orjson pyzmq msgspec pydantic 2>&1 | tail -3
    $PY -m pip install -q --no-index --no-deps --find-links .gpu/wheels peft accelerate 2>&1 | tail -3
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
TOK=${TOK:-.gpu/tok}   # a folder with a real tokenizer (MiniLM's, weights not needed): the random models' vocabulary

# The bundled MiniLM package (88 MB) is over what travels to the device (64 MiB): its tests skip there.
step cuda_tests 240 env WDE_TESTS_WITHOUT_MINILM=1 $PY -m pytest -q -p no:cacheprovider \
    tests/test_kernels.py tests/test_attention_auto.py tests/test_attention_bias.py tests/test_attention_window.py tests/test_attention_key_mask.py \
    tests/test_cpu_linear.py tests/test_batch_invariance.py tests/test_deberta_v2.py tests/test_data_parallel.py
step gpu_parity 150 $PY benchmarks/gpu_parity.py
# The engine's host path per input on this host's CPUs, as users run it (all cores): what bounds the offline runs
# below once the GPU is fast enough (docs/benchmarks.md, "The host path per input").
step host_path 60 $PY benchmarks/host_path.py --tokenizer "$TOK" --threads 0 --repeats 2
step throughput_bert_base 90 $PY benchmarks/throughput.py --model "$TOK" --size bert-base --device cuda \
    --dtype float16 --n 20000 --executor thread --repeats 2
step throughput_xlmr_large 120 $PY benchmarks/throughput.py --model "$TOK" --size xlmr-large --device cuda \
    --dtype float16 --n 20000 --executor thread --repeats 2
step build_bert_base 60 $PY -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from throughput import random_model
print(random_model('bert-base', Path('$TOK'), Path('/tmp/wde-bert-base')))"
step interpolate_cuda 60 $PY -c "
import torch, torch.nn.functional as F  # docs/images.md: torch's CPU antialiased kernel and one-column outputs
c = torch.tensor([1., 2, 3, 4]).view(1, 1, 4, 1)
for dev in ('cpu', 'cuda'):
    print(dev, F.interpolate(c.to(dev), size=(8, 1), mode='bilinear', antialias=True).flatten().tolist())"
# The HTTP layer alone per request (in-process ASGI, near-free model on the GPU): what one process's event loop allows.
step asgi_path 60 $PY benchmarks/asgi_path.py --tokenizer "$TOK" --requests 10000
# One process (what leases before the thirteenth session measured: 937-954 req/s, device busy 13-20%) and `wde serve`'s
# own default on a GPU host (the engine core behind a quarter of the cores as API servers), each with the CPU time
# per request of every server process, busiest first: which process bounds serving.
step serve_load 200 $PY benchmarks/serve_load.py --model /tmp/wde-bert-base --clients 256 --requests 4000 \
    --api-servers 0,auto

echo "=== summary"
for k in "${!RC[@]}"; do echo "$k ${RC[$k]}"; done | sort | tee "$OUT/summary.txt"
for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || exit 1; done
