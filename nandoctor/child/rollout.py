"""GRPO probes (objective=grpo, docs/rl.md): what an RL fine-tuning step does, and how far its two
computations of the same policy disagree.

Each step samples completions through the rollout path (the model in eval mode under
torch.inference_mode, generate() with a KV cache, in the cell's precision and with the engine's own
attention kernel, rollout.attn: what a rollout engine runs) and hands them to the probe's own training
loop (train.train) as its one micro-batch. The loop scores the same tokens through the training path
(train mode, teacher-forced, the cell's precision, attention and compile) in `Rollouts.loss`: GRPO's
loss as TRL 1.16's GRPOTrainer computes it by default (loss_type "dapo", beta 0, one update per
generation, the sequence-level importance-sampling mask of vllm_importance_sampling_mode
"sequence_mask"), with a verifiable toy reward. The difference of the two log-probs of each sampled
token is the mismatch (`mismatch_figures`).

Both log-probs are log_softmax(logits / temperature) of the model's own logits in fp32, before top-k
or top-p: the sampler's settings shape which tokens are drawn, never the figure.
"""

from __future__ import annotations

import contextlib
import math
import time

from ..cells import ATTENTIONS
from ..config import Recipe
from ..thresholds import THRESHOLDS

ENGINE = "generate"  # the rollout engine of a CPU probe, and of one vLLM cannot run (vllm_engine.choose)
# TRL 1.16 GRPOConfig: vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=
# "sequence_mask", vllm_importance_sampling_clip_max=3.0, clip_min=None: a sequence whose ratio
# exp(sum of logp_train - logp_rollout) is above the cap is left out of the loss (grpo_trainer.py); the
# cap's one home is Thresholds.rollout_ratio_cap, which the off-policy verdict reads too
SEQUENCE_MASK_CAP = THRESHOLDS.rollout_ratio_cap
# GRPOTrainer's advantage: (reward - group mean) / (group std + 1e-4), scale_rewards="group"
ADVANTAGE_EPS = 1e-4
QUANTILES = {"min": 0.0, "p10": 0.1, "median": 0.5, "p90": 0.9, "max": 1.0}


def reward(completion, mask):
    """The toy verifiable reward of each completion: the share of its tokens with an even id (a
    deterministic function of the tokens, learnable by raising those tokens' logits)."""
    hits = ((completion % 2 == 0) & mask).sum(1).float()
    return hits / mask.sum(1).clamp(min=1).float()


def advantages(rewards, group: int):
    """GRPO's advantage of each completion against the other completions of its prompt."""
    grouped = rewards.view(-1, group)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + ADVANTAGE_EPS)).view(-1)


def token_logp(logits, tokens, temperature: float):
    """The log-prob of each token under logits / temperature, computed in fp32."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def until_eos(completion, eos: int | None):
    """The completion mask: every token up to and including the first eos (what follows is padding)."""
    import torch

    if eos is None:
        return torch.ones_like(completion, dtype=torch.bool)
    is_eos = completion == eos
    return (is_eos.long().cumsum(1) - is_eos.long()) == 0


def mismatch_figures(diff, mask, cap: float = SEQUENCE_MASK_CAP) -> dict:
    """The rollout-training mismatch of sampled tokens. diff: (sequences, positions) of logp_train -
    logp_rollout; mask: which positions are completion tokens. Returns the mean and max |diff| over the
    tokens, the k3 estimate of KL(rollout || training) (the mean of exp(d) - 1 - d), the per-sequence
    importance ratio exp(sum d) at QUANTILES, the share of sequences TRL's default sequence mask drops
    (ratio above `cap`), and the mean |diff| at each completion position."""
    import torch

    diff, mask = diff.double(), mask.bool()
    tokens = diff[mask]
    ratios = torch.exp((diff * mask).sum(1))
    counts = mask.sum(0)
    per_position = (diff.abs() * mask).sum(0) / counts.clamp(min=1)
    return {
        "sequences": int(diff.shape[0]),
        "tokens": int(tokens.numel()),
        "logp_diff_mean": tokens.abs().mean().item() if tokens.numel() else math.nan,
        "logp_diff_max": tokens.abs().max().item() if tokens.numel() else math.nan,
        "k3_kl": (torch.exp(tokens) - 1 - tokens).mean().item() if tokens.numel() else math.nan,
        "ratio": {name: torch.quantile(ratios, q).item() for name, q in QUANTILES.items()},
        "masked_share": (ratios > cap).double().mean().item(),
        "mask_cap": cap,
        "per_position": [v.item() for v, n in zip(per_position, counts) if n > 0],
    }


def pin_head_fp32(model, device: str) -> None:
    """rollout.lm_head_fp32: the output head's weights in fp32, its input cast to fp32 and its matmul
    outside autocast, as TRL's cast_lm_head_to_fp32 does, for generate() and the training forward alike.
    A head tied to the input embedding shares its weight: the embedding's output is cast back to the
    dtype the layers after it compute in."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    held = head.weight.dtype
    head.float()

    def forward(hidden_states, _head=head):
        with torch.autocast(device, enabled=False):
            return torch.nn.functional.linear(hidden_states.float(), _head.weight, _head.bias)

    head.forward = forward
    if embed is not None and embed.weight is head.weight:
        embed.register_forward_hook(lambda module, args, out: out.to(held))


class RouteCapture:
    """A mixture of experts' token -> expert choices on both paths (moe.routers: the router module of each
    layer), read by forward hooks that return nothing: during generate() the prefill call and each decode
    call, during the training forward the whole sequence. `disagreement` compares the top-k sets at each
    completion token's input position (the position whose logits gave the token: the prompt's last one,
    then each generated token's), per layer."""

    def __init__(self, model):
        import torch

        from ..models import expert_top_k
        from .moe import _base, routers

        self.modules, self.index = routers(model)
        self.top_k = expert_top_k(_base(model).config) or 1
        self.mode: str | None = None  # "rollout" or "train" while a path runs
        self.rollout: list[list] = [[] for _ in self.modules]  # per layer: each generate() call's choices
        self.train: list = [None] * len(self.modules)
        self.counts = [[0, 0] for _ in self.modules]  # per layer: [tokens that differ, tokens compared]
        hooks = [torch.compiler.disable(self._hook(i)) for i in range(len(self.modules))]
        self.handles = [m.register_forward_hook(h) for (_, m), h in zip(self.modules, hooks)]

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if self.mode is None:
                return
            import torch

            from .moe import router_choices

            _, chosen = router_choices(output, self.index, self.top_k)
            chosen = torch.sort(chosen, dim=-1).values.cpu()
            if self.mode == "rollout":
                self.rollout[layer].append(chosen)
            else:
                self.train[layer] = chosen

        return hook

    def start(self, mode: str) -> None:
        self.mode = mode
        if mode == "rollout":
            self.rollout = [[] for _ in self.modules]

    def compare(self, rows: int, prompt_len: int, length: int, mask) -> None:
        """Count, per layer, the completion tokens whose input position chose other experts in training
        than in the rollout. rows: sequences; length: the trained sequence's; mask: (rows, completion)."""
        import torch

        self.mode = None
        for layer, calls in enumerate(self.rollout):
            if not calls or self.train[layer] is None:
                continue
            prefill = calls[0].reshape(rows, -1, calls[0].shape[-1])[:, -1:]  # the prompt's last position
            decoded = [c.reshape(rows, -1, c.shape[-1])[:, -1:] for c in calls[1:]]
            rollout = torch.cat([prefill, *decoded], 1)  # (rows, generated positions, k)
            train = self.train[layer].reshape(rows, length, -1)[:, prompt_len - 1 : length - 1]
            n = min(rollout.shape[1], train.shape[1], mask.shape[1])
            differ = (rollout[:, :n] != train[:, :n]).any(-1) & mask[:, :n].bool().cpu()
            self.counts[layer][0] += int(differ.sum())
            self.counts[layer][1] += int(mask[:, :n].sum())
        self.train = [None] * len(self.modules)

    def figures(self) -> dict | None:
        """{"per_layer": the share of completion tokens whose top-k experts differ, per router layer;
        "mean"}; None for a dense model."""
        if not self.modules:
            return None
        shares = [d / n if n else None for d, n in self.counts]
        known = [s for s in shares if s is not None]
        return {"per_layer": shares, "mean": sum(known) / len(known) if known else None}


class Rollouts:
    """The GRPO side of a probe: `steps` is its Setup.data (each step's completions, sampled now),
    `loss` its training loss (train.micro_loss calls it), `annotate` puts each step's reward and
    entropy on its Step, and `figures` is the record's rollout_mismatch over all its steps."""

    def __init__(self, recipe: Recipe, model, stream, autocast, device: str, seed: int, compute: str = "float32"):
        from .vllm_engine import VllmEngine, choose

        self.config = recipe.rollout
        self.model, self.autocast, self.device, self.seed = model, autocast, device, seed
        self.eos = getattr(model.config, "eos_token_id", None)
        self.eos = self.eos[0] if isinstance(self.eos, list) else self.eos
        self.pad = self.eos if self.eos is not None else 0
        self.prompts = prompts_of(stream, self.config.prompt_len)
        self.diffs: list = []  # per step: (logp_train - logp_rollout, completion mask), on the CPU
        self.rewards: dict[int, float] = {}
        self.entropies: dict[int, float] = {}
        self.tokens: dict[int, int] = {}
        self.step = 0  # the step being trained
        self.routes = RouteCapture(model)  # a mixture of experts' choices on both paths; no hooks on a dense one
        self.engine, self.engine_why = choose(recipe, device, model, bool(self.routes.modules))
        self.vllm, self.engine_start_s = None, None
        if self.engine == "vllm":
            rows = self.config.prompts * self.config.num_generations
            started = time.perf_counter()
            self.vllm = VllmEngine(model, self.config, compute, seed, rows, device)
            self.engine_start_s = time.perf_counter() - started
            self.engine_attn_name = self.vllm.backend
        else:
            self.engine_attn = ATTENTIONS[self.config.attn]
            if self.engine_attn.cuda_only and device != "cuda":
                raise ValueError(f"rollout.attn={self.config.attn} cannot run here: {self.engine_attn.cuda_only}")
            self.engine_attn_name = self.config.attn

    def steps(self):
        """Endless optimizer steps from step 0, as train.train draws them: ([the step's completions as one
        batch], None). A replay's fresh `steps` samples the timed steps' prompts with their seeds again."""
        step = 0
        while True:
            self.step = step
            yield [self.sample(step)], None
            step += 1

    def sample(self, step: int) -> dict:
        """Step `step`'s completions: each of its prompts num_generations times, through the rollout
        path, with the rollout's log-prob of each sampled token and the advantages."""
        import torch

        r = self.config
        index = (torch.arange(r.prompts) + step * r.prompts) % len(self.prompts)
        prompts = self.prompts[index].to(self.device).repeat_interleave(r.num_generations, 0)
        torch.manual_seed(self.seed + step)  # every cell samples from the same random stream
        if self.vllm is not None:
            self.vllm.push(self.model)  # the engine samples from the weights the trainer holds now
            completion, rollout_logp = self.vllm.sample(prompts, step, self.eos, self.pad)
            sequences = torch.cat([prompts, completion], 1)
            return self._batch(step, prompts, sequences, completion, rollout_logp)
        self.model.eval()
        self.routes.start("rollout")
        try:
            with self.engine_kernel(), torch.inference_mode(), self.autocast():
                out = self.model.generate(
                    input_ids=prompts,
                    attention_mask=torch.ones_like(prompts),
                    do_sample=True,
                    temperature=r.temperature,
                    top_k=r.top_k,
                    top_p=r.top_p,
                    max_new_tokens=r.max_new_tokens,
                    use_cache=True,
                    return_dict_in_generate=True,
                    output_logits=True,
                    pad_token_id=self.pad,
                )
            # clones made outside inference mode: tensors autograd may save for the training backward
            sequences = out.sequences.clone()
            completion = sequences[:, prompts.shape[1] :]
            rollout_logp = token_logp(torch.stack(out.logits, 1), completion, r.temperature).clone()
        finally:
            self.model.train()
            self.routes.mode = None
        return self._batch(step, prompts, sequences, completion, rollout_logp)

    def _batch(self, step: int, prompts, sequences, completion, rollout_logp) -> dict:
        """Step `step`'s training batch of sampled completions, with their rewards and advantages."""
        import torch

        r = self.config
        mask = until_eos(completion, self.eos)
        rewards = reward(completion, mask)
        self.rewards[step], self.tokens[step] = rewards.mean().item(), int(mask.sum())
        attention_mask = torch.cat([torch.ones_like(prompts), mask.long()], 1)
        return {
            "input_ids": sequences,
            "attention_mask": attention_mask,
            "completion_mask": mask,
            "rollout_logp": rollout_logp,
            "advantages": advantages(rewards, r.num_generations),
        }

    @contextlib.contextmanager
    def engine_kernel(self):
        """The rollout engine's attention (rollout.attn) for the span of generate(): the model's
        attn_implementation switched to the engine's and its SDPA backend pinned, the cell's restored
        after, so the training forward runs the cell's kernel."""
        from ..measure.numerics import sdpa_pin

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        trained = base.config._attn_implementation
        base.set_attn_implementation(self.engine_attn.implementation)
        try:
            with sdpa_pin(self.engine_attn)():
                yield
        finally:
            base.set_attn_implementation(trained)

    def loss(self, model, batch: dict):
        """GRPO's loss of one step's completions, scored through the training path by `model` (the
        compiled one in compile cells); records the mismatch and the policy's entropy on the way."""
        import torch

        mask = batch["completion_mask"]
        start = batch["input_ids"].shape[1] - mask.shape[1]
        self.routes.start("train")
        try:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        finally:
            self.routes.mode = None
        if self.routes.modules:
            self.routes.compare(mask.shape[0], start, batch["input_ids"].shape[1], mask)
        logits = logits[:, start - 1 : -1].float() / self.config.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, batch["input_ids"][:, start:].unsqueeze(-1)).squeeze(-1)
        diff = (logp.detach() - batch["rollout_logp"]) * mask
        self.diffs.append((diff.cpu(), mask.cpu()))
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            self.entropies[self.step] = (entropy[mask].mean()).item()
        ratio = torch.exp(diff.sum(1))  # TRL's sequence_mask: a sequence off by more than the cap is dropped
        kept = torch.where(ratio > SEQUENCE_MASK_CAP, torch.zeros_like(ratio), ratio)
        # one update per generation: the policy ratio is 1 and its gradient that of logp (no clipping)
        per_token = -torch.exp(logp - logp.detach()) * (batch["advantages"] * kept).unsqueeze(1)
        weights = mask.to(per_token.dtype)
        return (per_token * weights).sum() / weights.sum().clamp(min=1)  # dapo: over the batch's tokens

    def annotate(self, step) -> None:
        """Step `step` as GRPO trained it: its reward, entropy, completion tokens and batch kind."""
        step.supervised, step.batch = self.tokens.get(step.step), "rollout"
        step.reward = self.rewards.get(step.step)
        step.entropy = self.entropies.get(step.step)

    def figures(self) -> dict | None:
        """The record's rollout_mismatch over all its steps (`mismatch_record`)."""
        return mismatch_record(
            self.diffs,
            self.config.max_new_tokens,
            self.engine_attn_name,
            self.routes.figures(),
            engine=self.engine,
            engine_why=self.engine_why,
            engine_start_s=self.engine_start_s,
        )


def prompts_of(stream, n: int):
    """The prompts a GRPO probe samples from: the first `n` tokens of each of the stream's rows whose first
    `n` tokens are all real, in the stream's order, as one (prompts, n) tensor."""
    import torch

    rows = []
    for batch in stream.batches:
        inputs = batch.inputs
        ids, attended = inputs["input_ids"], inputs.get("attention_mask")
        whole = attended is None or attended.dim() != 2
        rows += [ids[i, :n] for i in range(ids.shape[0]) if whole or bool(attended[i, :n].all())]
    if not rows:
        raise ValueError(f"no row of the data has {n} real tokens to take a prompt from (rollout.prompt_len)")
    return torch.stack(rows)


def mismatch_record(
    diffs: list,
    width: int,
    engine_attn: str,
    experts: dict | None = None,
    engine: str = ENGINE,
    engine_why: str | None = None,
    engine_start_s: float | None = None,
    cap: float = SEQUENCE_MASK_CAP,
) -> dict | None:
    """The record's rollout_mismatch: mismatch_figures over every step's tokens together, with the engine
    that sampled them and the attention it sampled with, and each step's own mean |diff|; None before any
    step was scored. diffs: per step (logp_train - logp_rollout, completion mask), each (sequences,
    positions) with positions up to `width`."""
    import torch

    if not diffs:
        return None
    padded = [
        (torch.nn.functional.pad(d, (0, width - d.shape[1])), torch.nn.functional.pad(m, (0, width - m.shape[1])))
        for d, m in diffs
    ]
    out = mismatch_figures(torch.cat([d for d, _ in padded]), torch.cat([m for _, m in padded]), cap)
    per_step = [mismatch_figures(d, m, cap)["logp_diff_mean"] for d, m in diffs]
    return {
        "engine": engine,
        **({"engine_why": engine_why} if engine_why else {}),
        **({"engine_start_s": engine_start_s} if engine_start_s is not None else {}),
        "engine_attn": engine_attn,
        "steps": len(diffs),
        **out,
        "per_step_logp_diff_mean": per_step,
        **({"expert_disagreement": experts} if experts else {}),
    }
