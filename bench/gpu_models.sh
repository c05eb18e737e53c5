#!/usr/bin/env bash
# The GPU runs of issues 35 and 36, one command on a CUDA host: the MoE twins at probe scale (expert load,
# the load-balancing finding, gpt-oss's refusals), a QLoRA grid (nf4 with bf16 and fp16 compute, the
# bitsandbytes 8-bit and paged optimizers, the round trip) and the headline bisect, each timed.
# usage: bash bench/gpu_models.sh OUTDIR   (each run's terminal output in OUTDIR/NAME.txt, its run directory
# in OUTDIR/NAME/; LIMIT=seconds per run, default 150)
set -u
out=${1:?usage: bash bench/gpu_models.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    timeout "${LIMIT:-150}" python3 -m nandoctor "$@" --out "$out/$name" >"$out/$name.txt" 2>&1
    rc=$?
    echo "nandoctor $* -> exit $rc, wall $(($(date +%s) - t0)) s" | tee -a "$out/$name.txt" "$out/walls.txt"
}
run moe-qwen3-30b-a3b grid --model qwen3-30b-a3b --steps 8 --axis dtype=fp32,bf16-amp,fp16-amp \
    --axis attn=eager,sdpa,sdpa:flash --axis compile=off
run moe-qwen3-30b-a3b-aux grid --model qwen3-30b-a3b --steps 8 --axis dtype=bf16-amp --axis attn=sdpa \
    --axis compile=off --set moe.aux_loss=on
run moe-gpt-oss-20b grid --model gpt-oss-20b --steps 8 --axis dtype=fp32,bf16-amp --axis attn=eager,sdpa,sdpa:flash \
    --axis compile=off
run qlora-nf4 grid --model llama-3.1-8b --scale probe --steps 8 --set adapter.type=lora --axis quant=none,nf4 \
    --axis dtype=bf16-amp,fp16-amp --axis attn=sdpa --axis compile=off \
    --axis optimizer=adamw,bnb-adamw8bit,bnb-paged-adamw8bit --roundtrip
run bisect-llama-3.1-8b bisect --model llama-3.1-8b
