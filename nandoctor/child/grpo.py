"""What trl.GRPOTrainer takes for a probe (child/trainer.py, a GRPOConfig given with --trainer-args).

GRPOTrainer is given the probe's prompts (rollout.prompts per step, the first rollout.prompt_len tokens
of the data stream's rows, in the own GRPO loop's order: rollout.prompts_of) as a `datasets.Dataset` of
texts that the vocabulary tokenizer (sft.vocab_tokenizer, eos and pad the model's eos id) tokenizes back
to those ids, and the toy verifiable reward of rollout.reward as its reward function (TRL passes each
completion's ids). The trainer samples through its own generate() path (use_vllm off) and trains with
its own loss, as the user's GRPOConfig says; Setup.rollouts (trainer_rollouts.TrainerRollouts) measures
its rollout-training mismatch, and each step's loss is what its training_step returned.
"""

from __future__ import annotations

from ..record import ProbeSpec
from .build import Setup
from .rollout import ENGINE
from .sft import vocab_tokenizer
from .trainer_rollouts import TrainerRollouts


def measure_losses(trainer, meter, rollouts: TrainerRollouts) -> None:
    """Hand each micro-batch GRPOTrainer trains, with the loss its training_step returned, to `meter`: the
    model computes no loss of its own. The inputs it keeps are the attention mask of the training forward
    (prompt and completion tokens; the trainer samples inside training_step, from the dataset's rows)."""
    import torch

    train_micro_batch = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        loss = train_micro_batch(model, inputs, num_items_in_batch)
        masks, rollouts.trained = rollouts.trained, []
        meter.micro_batch({"attention_mask": torch.cat(masks) if masks else None}, loss)
        return loss

    trainer.training_step = training_step


def grpo_trainer(trainer_class, spec: ProbeSpec, s: Setup, args, callbacks: list):
    """A GRPOTrainer of `s.model` over the probe's prompts with the toy reward, watched by
    `s.rollouts`; and what it trains as the record says it (`grpo_trains`)."""
    from ..data import pad_id

    eos = s.model.config.eos_token_id
    eos = (eos[0] if isinstance(eos, list) else eos) if eos is not None else pad_id(spec.recipe, s.model.config)
    rollouts: TrainerRollouts = s.rollouts
    trainer = trainer_class(
        model=s.model,
        reward_funcs=[rollouts.even_tokens],
        args=args,
        train_dataset=rollouts.dataset(spec.steps),
        processing_class=vocab_tokenizer(s.model.config.vocab_size, eos),
        callbacks=callbacks,
    )
    measure_losses(trainer, callbacks[0].meter, rollouts)
    rollouts.watch(s.model, trainer.eos_token_ids)
    rollouts.cap = float(trainer.args.vllm_importance_sampling_clip_max)  # the cap the user's run masks at
    return trainer, grpo_trains(trainer)


def grpo_trains(trainer) -> dict:
    """What GRPOTrainer trains, as the record says it: its loss, the engine that sampled, the batch and
    sampler it ran with, and whether its importance-sampling correction applied (TRL corrects only vLLM
    rollouts)."""
    args = trainer.args
    return {
        "loss_type": args.loss_type,
        "beta": args.beta,
        "num_iterations": args.num_iterations,
        "engine": ENGINE,
        "num_generations": args.num_generations,
        "generation_batch_size": args.generation_batch_size,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "max_completion_length": args.max_completion_length,
        "sampler": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "cast_lm_head_to_fp32": bool(args.cast_lm_head_to_fp32),
        "importance_sampling": "not applied: GRPOTrainer corrects vLLM rollouts only (use_vllm)",
    }
