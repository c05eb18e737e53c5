#!/bin/bash
# vLLM as the GRPO probes' rollout engine on one GPU, against generate() on the same GPU (docs/rl.md,
# docs/gpu/2026-11-28-h200-rl.md). Run from the repository root on a CUDA host where vllm imports
# (VLLM_SITE: a folder holding vllm and its packages, put on the path after the repository).
# ATTENTION: vLLM's attention backend (rollout.vllm_attention), TRITON_ATTN by default here.
# Writes log.txt and runs.tgz (the grids' reports and records) under $OUT.
set -u
OUT=${OUT:-/tmp/out}
ATTENTION=${ATTENTION:-TRITON_ATTN}
mkdir -p "$OUT/runs"
export PYTHONPATH=$PWD${VLLM_SITE:+:$VLLM_SITE} PYTHONUNBUFFERED=1
grid() {  # grid NAME SECONDS ARGS...: one grid under $OUT/runs/NAME, stopped after SECONDS
  local name=$1 seconds=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$seconds" python3 -m nandoctor grid --objective grpo --axis attn=sdpa --axis compile=off \
    --out "$OUT/runs/$name" "$@"
  echo "== $name exit $? after ${SECONDS}s"
}
{
  python3 -c "import torch, transformers, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'vllm', vllm.__version__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  grid tiny-vllm 240 --axis dtype=fp32,fp16-amp,bf16-amp --steps 4 \
    --set rollout.engine=vllm --set rollout.vllm_attention="$ATTENTION"
  [ -n "${SKIP_GENERATE:-}" ] || grid tiny-generate 120 --axis dtype=fp32,fp16-amp,bf16-amp --steps 4 \
    --set rollout.engine=generate
  left=$((${BUDGET_S:-420} - SECONDS))
  if [ "$left" -gt 90 ]; then
    grid llama8b-vllm $((left - 30)) --model llama-3.1-8b --axis dtype=fp16-amp,bf16-amp --steps 4 \
      --set model.scale=probe --set adapter.type=none --set rollout.max_new_tokens=64 --set rollout.engine=vllm --set rollout.vllm_attention="$ATTENTION"
  fi
} 2>&1 | tee "$OUT/log.txt"
find "$OUT/runs" -name '*.pt' -delete
tar -C "$OUT" -czf "$OUT/runs.tgz" runs && rm -rf "$OUT/runs"
ls -la "$OUT"
