"""How far a trl.GRPOTrainer probe's rollout and training paths disagree (child/grpo.py), measured on the
trainer's own model as it trains: `TrainerRollouts` is to a GRPOTrainer probe what rollout.Rollouts is to
the own GRPO loop (Setup.rollouts).

It reads both log-probs of each sampled token with rollout.py's definition: the rollout path's from the
logits of the trainer's generate() calls, the training path's from the model's forward with gradients on
(the one GRPOTrainer backpropagates: its fused LM head's log-probs of the completion tokens,
log_softmax(logits / temperature) in fp32 of the logits in the compute dtype). Each trained row is matched
to the rollout that sampled it by its tokens (GRPOTrainer shuffles a generation batch before it trains on
it). The record's rollout_mismatch is then rollout.mismatch_record of them, as for the own GRPO loop.
"""

from __future__ import annotations

import copy

from ..config import Recipe
from .rollout import SEQUENCE_MASK_CAP, mismatch_record, prompts_of, reward, token_logp

# why a GRPOTrainer probe's rollouts come from generate(): the probe sets use_vllm=False (child/trainer.py)
ENGINE_WHY = "trl.GRPOTrainer samples with its own generate() (the probe sets use_vllm=False)"


def text_of(ids) -> str:
    """The text the vocabulary tokenizer reads back as `ids`."""
    return " ".join(f"<t{int(i)}>" for i in ids)


class TrainerRollouts:
    """The GRPO side of a GRPOTrainer probe, as rollout.Rollouts is of the own loop: `watch` reads the two
    log-probs off the trainer's model, `even_tokens` is the trainer's reward function, `annotate` puts each
    step's reward, entropy and completion tokens on its Step, `figures` is the record's rollout_mismatch."""

    def __init__(self, recipe: Recipe, stream, attn: str):
        self.config = recipe.rollout
        self.attn = attn  # GRPOTrainer generates with the model's own attention: the cell's, not rollout.attn
        self.prompts = prompts_of(stream, self.config.prompt_len)
        self.eos: list[int] = []  # the trainer's eos ids, once it is built
        self.sampled: dict = {}  # (prompt + completion ids) -> the rollout log-probs of the completion
        self.diffs: list = []  # per training forward: (logp_train - logp_rollout, completion mask), on the CPU
        self.rewards: list[float] = []  # since the last step was annotated
        self.entropies: list[float] = []
        self.tokens = 0
        self.trained: list = []  # the attention masks of the training forwards since training_step last returned
        self.model, self.handle = None, None
        self.cap = SEQUENCE_MASK_CAP  # the GRPOConfig's vllm_importance_sampling_clip_max, once the trainer is built

    def dataset(self, steps: int):
        """The prompts of `steps` optimizer steps, rollout.prompts each, in the own loop's order."""
        from datasets import Dataset

        n = steps * self.config.prompts
        return Dataset.from_list([{"prompt": text_of(self.prompts[i % len(self.prompts)])} for i in range(n)])

    def watch(self, model, eos: list[int]) -> None:
        """Read the rollout log-probs off `model.generate` and the training ones off its forward."""
        import torch

        self.model, self.eos = model, list(eos)
        sample = model.generate

        def generate(*args, generation_config=None, **kwargs):
            config = copy.deepcopy(generation_config or model.generation_config)
            config.return_dict_in_generate, config.output_logits = True, True
            out = sample(*args, generation_config=config, **kwargs)
            self.sampled_by(kwargs["input_ids"], kwargs.get("attention_mask"), out)
            return out.sequences

        model.generate = generate
        self.handle = model.register_forward_hook(torch.compiler.disable(self.scored), with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            del self.model.generate  # the class's own again
            self.handle = None

    def completion_length(self, completion) -> int:
        """A sampled completion's tokens as GRPOTrainer trains them: up to and including its first eos."""
        ends = [j for j, t in enumerate(completion.tolist()) if t in self.eos]
        return ends[0] + 1 if ends else len(completion)

    def sampled_by(self, prompts, attention_mask, out) -> None:
        """One generate() call's completions and the rollout path's log-prob of each sampled token."""
        import torch

        width = prompts.shape[1]
        completion = out.sequences[:, width:]
        logp = token_logp(torch.stack(out.logits, 1), completion, self.config.temperature).cpu()
        real = torch.ones_like(prompts) if attention_mask is None else attention_mask
        self.sampled = {}  # a new generation batch: what GRPOTrainer trains until the next one
        for i in range(prompts.shape[0]):
            n = self.completion_length(completion[i])
            key = (*prompts[i][real[i].bool()].tolist(), *completion[i, :n].tolist())
            self.sampled.setdefault(key, logp[i, :n])

    def scored(self, module, args, kwargs, output) -> None:
        """A forward through GRPOTrainer's fused LM head (trl add_fused_lm_head: `log_probs` of each labelled
        token, log_softmax(logits / temperature) in fp32 of the logits in the compute dtype, and `entropy`)
        with gradients on: its training forward. Each completion token's log-prob against the rollout's."""
        import torch

        if not torch.is_grad_enabled() or getattr(output, "log_probs", None) is None:
            return
        ids, attended = kwargs["input_ids"], kwargs["attention_mask"].bool()
        logp, kept = output.log_probs.detach().float().cpu(), output.label_mask.cpu()
        counts = kept.sum(1)
        diff = torch.zeros((ids.shape[0], int(counts.max()) if counts.numel() else 0), dtype=torch.float64)
        for i in range(ids.shape[0]):
            rollout = self.sampled.get(tuple(ids[i][attended[i]].tolist()))
            if rollout is None or len(rollout) != int(counts[i]):
                raise RuntimeError("GRPOTrainer trained a completion its generate() calls did not sample")
            diff[i, : int(counts[i])] = logp[i][kept[i]].double() - rollout.double()
        mask = torch.arange(diff.shape[1]) < counts.unsqueeze(1)
        self.diffs.append((diff, mask))
        self.trained.append(attended.detach())
        entropy = getattr(output, "entropy", None)
        if entropy is not None:
            self.entropies.append(entropy.detach().float().cpu()[kept].mean().item())
        self.tokens += int(counts.sum())

    def even_tokens(self, completion_ids, **kwargs) -> list[float]:
        """rollout.reward of each completion (TRL's reward function: completion_ids, each up to its eos)."""
        import torch
        from torch.nn.utils.rnn import pad_sequence

        rows = [torch.tensor(c, dtype=torch.long) for c in completion_ids]
        mask = pad_sequence([torch.ones_like(r, dtype=torch.bool) for r in rows], batch_first=True)
        rewards = reward(pad_sequence(rows, batch_first=True), mask)
        self.rewards.append(rewards.mean().item())
        return rewards.tolist()

    def annotate(self, step) -> None:
        """Step `step` as GRPOTrainer trained it: the mean reward of the completions sampled for it (None
        where it trained on completions sampled for an earlier step), the policy's entropy on the training
        path, its completion tokens and batch kind."""
        step.supervised, step.batch = self.tokens, "rollout"
        step.reward = sum(self.rewards) / len(self.rewards) if self.rewards else None
        step.entropy = sum(self.entropies) / len(self.entropies) if self.entropies else None
        self.rewards, self.entropies, self.tokens = [], [], 0

    def figures(self) -> dict | None:
        """The record's rollout_mismatch (rollout.mismatch_record) over every training forward's tokens."""
        return mismatch_record(self.diffs, self.config.max_new_tokens, self.attn, engine_why=ENGINE_WHY, cap=self.cap)
