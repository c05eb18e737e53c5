"""vLLM as a GRPO probe's rollout engine (rollout.engine, docs/rl.md).

The probe's model is saved once to a temporary checkpoint and loaded by `vllm.LLM` in the cell's
compute dtype, with the engine core in this process (as TRL's colocate mode runs it), so that the
trainer's weights can be pushed into the engine's model before every step's sampling. Each sampled
token's log-prob is the one vLLM's own sampler reports: the engine's kernels, its KV cache, its
rounding. The training path then scores the same tokens as it does for generate()'s rollouts.

`choose` decides which engine a probe runs and says why; a probe that cannot run vLLM (no CUDA,
vllm not installed, an adapter, a quantized base or an fp8 recipe's layers whose weights the engine
would not hold as trained, a mixture of experts whose routing vLLM does not report back, an fp32 head vLLM has no
switch for) runs generate() under `auto` and says so in its record.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import weakref

# the engine's KV cache, fixed: vLLM then sizes nothing from the GPU's free memory, which other probes
# packed on the same GPU change while it would measure it
KV_CACHE_BYTES = 1 << 30
# the memory share vLLM checks is free at start (its weights, activations and the cache above fit in it)
MEMORY_SHARE = 0.1


def unavailable(recipe, device: str, model, moe: bool) -> str | None:
    """Why vLLM cannot sample this probe's rollouts as the trainer's model computes them, or None."""
    r = recipe.rollout
    if device != "cuda":
        return f"vLLM runs on a CUDA GPU; this probe runs on {device}"
    if recipe.adapter.type != "none":
        return f"a {recipe.adapter.type} adapter is not merged into the engine's weights"
    if getattr(model, "hf_quantizer", None) is not None:
        return "a quantized base is not loaded into the engine as the trainer holds it"
    converted = (
        next((type(m) for m in model.modules() if _foreign(type(m))), None) if hasattr(model, "modules") else None
    )
    if converted is not None:
        return f"the trainer's {converted.__module__.split('.')[0]} {converted.__name__} layers are not the engine's"
    if moe:
        return "vLLM does not report a mixture of experts' routing back, so expert disagreement would go unmeasured"
    if r.lm_head_fp32:
        return "vLLM has no switch for an fp32 output head (rollout.lm_head_fp32)"
    if r.temperature != 1.0 and (r.top_k or r.top_p < 1.0):
        return (
            "vLLM reports a tempered log-prob only after top-k / top-p renormalise it, which the trainer's "
            "log-prob never is"
        )
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    return None


def _foreign(cls) -> bool:
    """A layer an fp8 training recipe put in the model (torchao's Float8Linear, Transformer Engine's)."""
    return cls.__module__.startswith(("torchao.", "transformer_engine."))


def choose(recipe, device: str, model, moe: bool) -> tuple[str, str]:
    """The probe's rollout engine ("vllm" or "generate") and why. rollout.engine=vllm on a probe that
    cannot run it raises ValueError (the probe's crash names the reason)."""
    asked = recipe.rollout.engine
    if asked == "generate":
        return "generate", "rollout.engine=generate"
    why_not = unavailable(recipe, device, model, moe)
    if asked == "vllm":
        if why_not:
            raise ValueError(f"rollout.engine=vllm cannot run here: {why_not}")
        return "vllm", "rollout.engine=vllm"
    if why_not:
        return "generate", f"generate() stands in for vLLM: {why_not}"
    return "vllm", "vLLM is installed and the probe runs on a CUDA GPU"


@contextlib.contextmanager
def _trainer_settings():
    """Keep the process-wide settings vLLM's worker sets at start (fp32 matmul precision, the default
    dtype) as the probe had them: the trainer computes in this process too."""
    import torch

    precision, dtype = torch.get_float32_matmul_precision(), torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.set_default_dtype(dtype)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class VllmEngine:
    """One vllm.LLM over the probe's weights. `push` hands it the trainer's current weights; `sample`
    draws one completion per prompt row and returns (completion ids, the engine's log-prob of each), both
    (rows, longest completion) on `device`, completions that stop early padded with `pad`."""

    def __init__(self, model, config, compute: str, seed: int, rows: int, device: str):
        # the engine core in this process, whatever the environment says: push() reaches its model here
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.config, self.seed, self.device = config, seed, device
        self.dir = tempfile.mkdtemp(prefix="nandoctor-vllm-")
        weakref.finalize(self, shutil.rmtree, self.dir, True)  # the checkpoint goes with the engine
        _base(model).save_pretrained(self.dir)
        from vllm import LLM

        extra = {} if config.vllm_attention == "auto" else {"attention_config": {"backend": config.vllm_attention}}
        with _trainer_settings():
            self.llm = LLM(
                model=self.dir,
                dtype=compute,  # a cell's compute dtype is one vLLM holds (config.VLLM_DTYPES)
                seed=seed,
                enforce_eager=True,  # no CUDA graphs to capture: a probe samples a few batches
                skip_tokenizer_init=True,  # prompts go in as token ids, completions come back as ids
                max_model_len=config.prompt_len + config.max_new_tokens,
                max_num_seqs=rows,
                kv_cache_memory_bytes=KV_CACHE_BYTES,
                gpu_memory_utilization=MEMORY_SHARE,
                enable_prefix_caching=False,
                # the log-prob of logits / temperature; raw logits at temperature 1 (`unavailable` refuses
                # a tempered one that top-k / top-p would renormalise)
                logprobs_mode="raw_logprobs" if config.temperature == 1.0 else "processed_logprobs",
                disable_log_stats=True,
                **extra,
            )
        self.backend = self._backend()

    def _runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def _backend(self) -> str:
        """The attention backend vLLM chose (or was given), by its name."""
        with contextlib.suppress(Exception):
            groups = self._runner().attn_groups
            return groups[0][0].backend.get_name()
        return self.config.vllm_attention

    def push(self, model) -> None:
        """The trainer's current weights into the engine's model (its names are the checkpoint's)."""
        import torch

        runner = self._runner()
        engine_model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        with torch.no_grad():
            engine_model.load_weights(list(_base(model).state_dict().items()))

    def sample(self, prompts, step: int, eos: int | None, pad: int):
        import torch
        from vllm import SamplingParams

        r = self.config
        params = [
            SamplingParams(
                n=1,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_tokens=r.max_new_tokens,
                logprobs=0,  # the sampled token's own log-prob
                seed=self.seed + step * prompts.shape[0] + row,  # each row its own draw, each step another
                stop_token_ids=[eos] if eos is not None else None,
                detokenize=False,
            )
            for row in range(prompts.shape[0])
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params, use_tqdm=False)
        ids, logps = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids.append(list(completion.token_ids))
            logps.append(
                [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]
            )
        width = max(len(t) for t in ids)
        completion = torch.full((len(ids), width), pad, dtype=torch.long)
        logp = torch.zeros((len(ids), width), dtype=torch.float32)
        for row, (t, lp) in enumerate(zip(ids, logps)):
            completion[row, : len(t)] = torch.tensor(t, dtype=torch.long)
            logp[row, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return completion.to(self.device), logp.to(self.device)
