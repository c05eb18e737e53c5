"""The verdict thresholds: every number that turns a probe's curves into a verdict, or a run into a
comparison with its baseline, in one frozen dataclass (`THRESHOLDS`), each with where it comes from.

Foundation module: imports only errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import NandoctorError


@dataclass(frozen=True)
class Thresholds:
    """Every number that turns a loss / grad-norm curve into a verdict, in one place.

    - min_scale: a GradScaler whose scale falls below 1.0 has stopped calibrating: at scale < 1 the
      gradients overflow fp16 even unscaled, so every further step is skipped.
    - spike_factor / spike_window: a loss above 2x the mean of the previous 10 steps that trained the
      same kind of batch (Step.batch) is a spike (the rule of llm-foundry's loss-spike callback, which
      uses a running window and a multiplier). Kinds apart, since the user's batches lose differently
      every time they come round: a probe of 30 steps over 36 memorised rows and 4 short random ones
      (tests/test_data_faults_e2e.py) saw the short rows at 2.2x the mean of the 10 steps before them.
    - spike_size_ratio: within a kind, a step is compared only with steps whose batch had a like number of
      supervised tokens (within 1.5x either way; Step.supervised, the user's data only): the in-order
      "first" batches of a set whose rows are mostly short and repetitive and sometimes long and random
      hold easy and hard batches alike (36 against 219-247 targets on the test Llama), and once the easy
      ones are learnt a hard one stands 2x above a window of easy ones while every batch's loss falls.
    - grad_explode_factor: a grad-norm 10x above the largest seen so far is an explosion (Megatron's
      rerun machinery flags values more than 10x the running maximum as unexpectedly large).
    - rise_nats: a run that ends more than 0.5 nats above where it started has diverged.
    - drift_rel / drift_abs: a finite run whose mean |loss - reference loss| over its last quarter
      exceeds 25% of the reference's own loss drop plus 0.02 nats has left the fp32 curve (a stall
      is the common cause); bf16-amp stays within ~0.005 nats of fp32 on the default recipe.
    - stall_update_lost: a probe whose step-0 optimizer step lost more than half of the weight updates it
      meant to make (the share of |meant update| that rounding to the weights' dtype left out,
      forensics' update_loss) barely trains, whatever its loss curve shows over a short probe: it drifts
      (a stall). Measured on tiny-llama, 24 steps: bf16-pure lost 98% at lr 1e-6, where fp32's own loss had
      not moved (8.309 -> 8.315), so the curve alone called it stable; 0.09% at lr 1e-3; bf16-amp 8e-7.
    - init_loss_band_nats / init_loss_band_rel: a random-init model's first loss should sit within
      max(1 nat, 10%) of ln(vocab).
    - fidelity_bucket: fidelities within 0.5% are treated as equal when ranking, so speed decides.
    - speed_margin: inside a bucket, a probe is faster only by more than 5% of the other's median
      tokens/s, and beyond both spreads (analysis/ranking.py): a few percent is what one idle core more
      or less makes, not a reason to prefer a less plain configuration.
    - loaded_speed_margin: the same, at least 25%, when other processes loaded the host while the probes
      were timed (analysis/load.py: a quarter of the cores, or another process on a GPU); wider when the
      measured load could swing two equal probes further (load.unpaired_margin: k busy cores of n, k / n).
      Measured here: a busy loop sharing the probe's core made fp32/eager measure 17% and 25% faster than fp32/sdpa in
      the two interleaved re-timing rounds, where a quiet host measured them 1% and -9% apart.
    - loaded_cpu_share: a host is loaded while a probe is timed when other processes keep a quarter of its
      cores busy (or another process runs on its GPU): they then take about that share of the probe's CPU
      time when its threads use every core, enough to move tokens/s well beyond a quiet host's few percent.
    - spike_min_history: a spike needs at least 3 earlier steps of its kind to compare with (steps 0-2
      of a fresh model fall fast, and a mean of one or two of them is noise).
    - rise_min_steps: a rise is judged only on curves of 4 steps or more.
    - tail_fraction: the end of a curve is its last quarter (at least one step), for rise and drift.
    - min_probe_steps: a grid or bisect probe trains at least 2 steps: step 0's loss and grad-norm come
      from the initial weights, so a 1-step probe never sees what its optimizer update did (fp16-pure
      with eps 1e-8 is finite at step 0 and non-finite at step 1). `check` is a step-0 check by design.
    - no_learning_loss_rel / no_learning_min_steps: a loss that stays within 1e-6 (relative) of its
      first value for every step of a curve of 4 steps or more has not moved: nothing trains. 1e-6 is a
      few fp32 ulps (reduction-order noise); a model that learns moves by orders of magnitude more per
      step, and even one that does not learn sees a different loss on each of the data's batches
      unless its output ignores its input (zero weights). A grad-norm of exactly 0 at every step is
      judged from the first step: no parameter receives a gradient.
    - grad_ratio_rel: a parallel probe whose step-0 gradient norm is within 5% of W (or 1/W) times the
      one-process norm sums (or divides twice) instead of averaging (pytorch#162338 summed W-fold).
    - grad_agreement: the largest relative error of a parameter's step-0 gradient a parallel probe may
      show against the one-process gradient of the same global batch, by the coarsest dtype its
      gradients go through (compute or reduce). Measured on tiny-llama over 2 gloo ranks: bf16-amp
      0.0024 with DDP and 0.014 with FSDP2 (its bf16 param_dtype casts the norms too, autocast does
      not); fp16-amp 0.016 with FSDP2 under both reduce dtypes alike (its fp16 param_dtype, not the
      reduction: scaling bf16's bound by the unit roundoffs, 0.006, called that a mismatch); fp32 1e-6
      or less. Each bound is about 3x the largest seen. Each tensor group's own error is held to
      accumulation_bound of its own floor (the one-process gradient in the cell's precision against fp32):
      a balancing loss counted per rank moves a tiny Qwen3-MoE's router by 1.54 at router_aux_loss_coef
      0.01 (bf16-amp, floor 0.032), while no group of a correct probe went past 1.4x its floor (FSDP2).

    Comparing a run with a baseline (analysis/diff.py, `nandoctor diff`, `--baseline`):
    - golden_loss_eps / golden_grad_eps / golden_floor: how far a step's loss and grad-norm may move
      from the baseline's, relative, before the numerics count as changed: 1 machine epsilon of the
      cell's matmul dtype for the loss (a mean over the batch, in which a kernel that rounds differently
      moves each logit by about one unit of the last place) and 4 for the grad-norm (a sum over every
      parameter's gradient, through the whole backward), never below 1e-5 (fp32 kernels that merely
      reorder a reduction move a loss by ~1e-6). bf16: 0.78% / 3.1%; fp16 and tf32: 0.098% / 0.39%.
    - fidelity_regression: a cell stable in both runs regressed when its fidelity to the fp32
      reference got worse by more than one ranking bucket (0.5 percentage points).
    - throughput_noise / throughput_noise_min_steps: the relative tokens/s band for a probe whose own steps
      cannot measure its noise (fewer than 4 timed steps: a `check`; quartiles of fewer are not a spread);
      otherwise the band is the interquartile range of the probe's own per-step rates over their median
      (analysis/diff.py throughput_noise).
    - memory_noise: peak-memory changes below 5% are noise: two identical CPU grids here moved a probe's
      RSS peak by up to 1.6% (the CUDA allocator's peak is steadier).

    The saved model against the trained one (`check --roundtrip`, child/roundtrip.py, verdicts.roundtrip_differs):
    - roundtrip_loss_rel / roundtrip_logits_rel: the merged and the reloaded model's loss on the probe's
      first micro-batch within 1% of the live model's, and their logits within 2% of the largest live logit.
      Measured on a tiny Llama (LoRA r=8, lr 1e-2, 8 steps): 16-bit bf16-amp logits moved 0.0054 and fp32
      5e-7; an nf4 base's merge 0.062, losing 14-21% of each update (docs/quantization.md).
    - roundtrip_update_lost / roundtrip_tensor_rel: a tensor changed by the merge or the reload when it lost
      more than 10% of its adapter update (nf4's 14-21%), or, without an update to compare with, moved by
      more than 1e-3 of its norm.

    The probe's own setup, measured at step 0 (record.setup_checks; the `misconfigured` verdict), and
    the same figures measured by the data lint (`doctor --data`, every grid, check and bisect) and the
    training callbacks: one rule each (`packing_leaks`, `accumulation_misweighted`), a figure against a
    baseline that cannot share the fault, beyond the larger of an absolute bound and 10x a rounding floor
    measured apart from the figure (measure/numerics.in_fp32: this precision against fp32):
    - packing_leak_abs / packing_leak_factor: a packed segment's logits must be the segment's own, run
      alone, up to the model's rounding: a packed forward leaks when its largest logit difference to the
      segments run alone exceeds the larger of 1e-4 and 10x packing_floor (the segments alone in the
      probe's precision against fp32). Measured on a 2-layer tiny Llama: position_ids alone 2e-7 in fp32
      (floor 0); bf16-pure 0.0039 against a floor of 0.0044, fp16-pure 0.00049 against 0.00054; the usual
      2-D all-ones mask beside the position_ids 0.77, because transformers builds the per-segment mask only
      when no mask is passed and no cache exists (huggingface/transformers PR #46634,
      huggingface/trl#3067); a model that drops position_ids 0.5. The same comparison is also made with the
      model in fp32 whatever the cell (packing_fp32_diff) and judged against 1e-4 alone: a half-precision
      cell's floor put its bound at 10x its rounding, so a leak as large as the one fp32 showed (0.0198
      max logit) passed as isolated in bf16-pure while the fp32 cells were misconfigured.
    - accumulation_error_abs / accumulation_error_factor: the gradient a step accumulates over its
      micro-batches (each one's loss the model's own, num_items_in_batch passed as the Trainer passes it)
      must be the full batch's (one backward of all the step's rows): it is misweighted when their
      relative difference ||accumulated - full|| / ||full|| exceeds the larger of 1e-3 and 10x
      accumulation_floor (the full batch's gradient in the probe's precision against fp32). Measured on
      the tiny Llama over rows of 32, 4, 4 and 4 tokens: by tokens 9e-8 in fp32 (floor 0), 0.0043 in
      bf16-pure (floor 0.0065), 0.00052 in fp16-pure (floor 0.00073); averaged per micro-batch 1.18 in
      each (cosine 0.587, norm ratio 1.45: huggingface/transformers PR #34191, #37766); a model that
      ignores num_items_in_batch under the Trainer's token normalisation sums the micro-batches' means:
      its error is at least steps - 1 (3.0 on four equal rows).
      Each tensor group (models.CHECKED_GROUPS: router, experts, embeddings, adapter, the rest) is held to
      the same bound against its own floor: a mixture of experts whose balancing loss the Trainer adds to
      every micro-batch's token-normalised loss (transformers 5.24; NVIDIA-NeMo/Automodel PR #3359,
      modelscope/ms-swift PR #5823) moves the router's gradient by 0.12 at 2 micro-batches and 0.36 at 4
      (tiny Qwen3-MoE, 4 rows each), the whole model's by 4e-4 and 9e-4 only.
      Where the packed forward leaks, the same two numbers find the first layer that mixes the segments
      (leaking_layer): its output past the first segment against its first segment's, which no segment
      precedes. Measured on the probe-scale twins packed by position_ids: Qwen3-Next's linear-attention
      torch fallback (huggingface/transformers#46333) 0.115 at the logits, gpt-oss's eager sink attention
      0.95.
    - expert_dead_fraction / expert_min_load: a mixture of experts' router has collapsed in a layer when
      half of its experts or more get no token of a step, judged only where an even router would give
      each expert 8 assignments or more (tokens x top-k / experts; the chance an expert of an even
      router gets none is then e^-8, 3e-4). A router sending every token to the same top-k experts
      leaves 1 - k/E of them idle: 75% on the probe-scale twins (32 experts top-8, 8 top-2, 16
      top-4); random-init routers left 4 and 5 of 32 (12-16%) idle on 64 tokens of qwen3-30b-a3b's
      twin. Dead experts and collapse are reported by pytorch/torchtitan#1246 and NVIDIA-NeMo/Automodel#1232.
    - expert_token_share: one expert taking 95% of a layer's tokens, where an even router gives it
      k/E <= expert_share_even_max (an eighth) of them, is a router that no longer chooses. Not judged
      at larger k/E: a random-init router of top-8 of 32 gave one expert 81% of 64 tokens here.
    - route_flip_share: a drift whose step-0 token -> expert choices differ from the fp32 reference's
      in more than 5% of (token, slot) pairs is named as caused by the routing: the same weights and
      batch choose other experts in this precision (a bf16 softmax before top-k flips near-ties,
      ViperEkura/AstrAI#57). bf16-amp flipped 0.4% on qwen3-30b-a3b's probe-scale twin here (head_dim 32,
      64 tokens), and 74% on a router built with near-tied logits (tests/checkpoints.py
      save_tied_router_qwen3_moe), which then sent every token to the same two experts.
    - headroom_min: the callbacks' step-0 headroom check (integrations/judge.py) passes where the dtype's
      largest finite value is more than 1x the largest |activation| or |gradient| a module produced: at 1x
      or below the value is at or past the dtype's range.
    - emulated_cost: a compute dtype whose matmul takes more than 4x fp32's time on a CPU host
      (env.get_cpu_matmul_cost) is one this CPU emulates, and a probe in it is announced with that cost
      before it runs. Measured on a 2-core AMD EPYC with avx512_bf16 and no fp16 units: fp16 104x, bf16 0.5x;
      on one without AVX-512, bf16 cells trained ~8x slower than fp32 ones. A CPU with the units stays
      near 1x either way.

    RL fine-tuning (objective=grpo, docs/rl.md): the rollout engine's log-probs of the sampled tokens against
    the training path's (record.rollout_mismatch; the `off-policy` verdict). A completion's importance
    ratio is exp(sum of its tokens' differences d), so what a per-token mismatch costs grows with the
    completion's length; the probe samples a few tokens, the user's run thousands.
    - rollout_ratio_cap: 3.0, TRL 1.16 GRPOConfig's vllm_importance_sampling_clip_max, above which its
      default correction (vllm_importance_sampling_mode="sequence_mask") drops a completion from the loss
      (huggingface/trl#3867, #4493; trl#4772 reports ratios exploding far past it).
    - rollout_reference_tokens: the completion length the mismatch is judged at, 4096 (reasoning RL samples
      completions of thousands of tokens; TRL's default max_completion_length is 256). A probe is off-policy
      when mean |d| x 4096 > ln(3.0), i.e. mean |d| above 2.7e-4. mean |d| x length is sum |d|, the largest
      |log ratio| a completion of that length can reach (every difference the same sign): inside the bound,
      no 4096-token completion can reach TRL's cap whichever way its differences fall. It is a bound, not an
      estimate: on tiny-llama here (random init, bf16-amp, 16 sequences) the differences were mostly
      independent in sign, |sum d| / sum |d| per completion a median 0.17 at 16 tokens and 0.11 at 64
      (a random walk's 1/sqrt(n)), largest 0.81 and 0.58; at that rate a 4096-token ratio would be about
      exp(sqrt(4096) x rms d) = 1.07, not the bound's 21.6. The issue's peakier head (a trained policy is
      peaky) spread bf16's ratios to 0.786-1.090 over 64 tokens, and Qi et al. ("Defeating the
      Training-Inference Mismatch via FP16", arXiv 2510.26788) and Liu, Li et al. ("When Speed Kills
      Stability", 2025) saw bf16's mismatch collapse real RL runs. Measured mean |d| (docs/rl.md): fp32
      1.5e-7 (ratio bound at 4096 tokens 1.0006), fp16-amp 9.5e-5 (1.48), bf16-amp 7.5e-4 (21.6:
      off-policy; at 1,000 tokens its bound would be 2.1 and pass). fp16's 8x finer rounding passes, bf16
      fails: the order Qi et al. found.
    - a probe whose own completions already crossed the cap (masked_share > 0: TRL's default correction
      drops some of them at the probe's own length) is off-policy whatever the extrapolation says.
    - rollout_bucket_nats: for ranking, mismatches whose log-ratio bounds at rollout_reference_tokens
      (mean |d| x 4096) fall in the same 0.05-nat bucket (a 5% ratio) are equal, so speed decides between
      them; fp32 cells all fall in the first (6e-4 nats).
    """

    min_scale: float = 1.0
    spike_factor: float = 2.0
    spike_window: int = 10
    grad_explode_factor: float = 10.0
    rise_nats: float = 0.5
    drift_rel: float = 0.25
    drift_abs: float = 0.02
    init_loss_band_nats: float = 1.0
    init_loss_band_rel: float = 0.10
    fidelity_bucket: float = 0.005
    speed_margin: float = 0.05
    loaded_speed_margin: float = 0.25
    loaded_cpu_share: float = 0.25
    spike_min_history: int = 3
    rise_min_steps: int = 4
    tail_fraction: float = 0.25
    no_learning_loss_rel: float = 1e-6
    no_learning_min_steps: int = 4
    grad_ratio_rel: float = 0.05
    grad_agreement: tuple = (("float32", 1e-4), ("float16", 0.05), ("bfloat16", 0.05))
    min_probe_steps: int = 2
    golden_loss_eps: float = 1.0
    golden_grad_eps: float = 4.0
    golden_floor: float = 1e-5
    fidelity_regression: float = 0.005
    throughput_noise: float = 0.10
    throughput_noise_min_steps: int = 4
    memory_noise: float = 0.05
    packing_leak_abs: float = 1e-4
    packing_leak_factor: float = 10.0
    accumulation_error_abs: float = 1e-3
    accumulation_error_factor: float = 10.0
    roundtrip_loss_rel: float = 0.01
    roundtrip_logits_rel: float = 0.02
    roundtrip_update_lost: float = 0.1
    roundtrip_tensor_rel: float = 1e-3
    expert_dead_fraction: float = 0.5
    expert_min_load: float = 8.0
    expert_token_share: float = 0.95
    expert_share_even_max: float = 0.125
    route_flip_share: float = 0.05
    emulated_cost: float = 4.0
    spike_size_ratio: float = 1.5
    headroom_min: float = 1.0
    stall_update_lost: float = 0.5
    rollout_ratio_cap: float = 3.0
    rollout_reference_tokens: int = 4096
    rollout_bucket_nats: float = 0.05

    def packing_bound(self, floor=None) -> float:
        """The largest logit difference a packed forward may show against its segments run alone."""
        return _bound(self.packing_leak_abs, self.packing_leak_factor, floor)

    def packing_leaks(self, max_diff, floor=None, fp32_diff=None) -> bool:
        """Whether a packed forward's largest logit difference to its segments run alone is a leak, in the
        cell's precision against packing_bound(floor), or measured in fp32 (fp32_diff) against
        packing_leak_abs whatever the cell (False for figures absent or not finite: nothing judged)."""
        in_cell = _finite(max_diff) and max_diff > self.packing_bound(floor)
        return in_cell or (_finite(fp32_diff) and fp32_diff > self.packing_leak_abs)

    def accumulation_bound(self, floor=None) -> float:
        """The largest relative difference an accumulated step-0 gradient may show to the full batch's."""
        return _bound(self.accumulation_error_abs, self.accumulation_error_factor, floor)

    def leaking_layer(self, layers, max_diff) -> dict | None:
        """Where a packed forward that differs from its segments run alone (max_diff, as collated, beyond
        packing_leak_abs) mixes them: the first layer of that forward (measure.packing_isolation's
        packing_layers) whose later segments differ beyond the larger of packing_leak_abs and
        packing_leak_factor times its first segment's difference (the model's own rounding: no segment
        precedes the first). None when the collated forward keeps the segments apart, or no layer shows it."""
        if not (_finite(max_diff) and max_diff > self.packing_leak_abs):
            return None
        for layer in layers or []:
            first, later = layer.get("first_segment"), layer.get("later_segments")
            if _finite(later) and later > max(self.packing_leak_abs, self.packing_leak_factor * (first or 0.0)):
                return layer
        return None

    def accumulation_misweighted(self, error, floor=None) -> bool:
        """Whether an accumulated step-0 gradient's relative difference to the full batch's is beyond
        accumulation_bound (False for a figure that is absent or not finite)."""
        return _finite(error) and error > self.accumulation_bound(floor)

    def rollout_log_ratio(self, logp_diff_mean) -> float | None:
        """The bound on a completion's |log importance ratio| at rollout_reference_tokens tokens: mean |d|
        times that length (None for a figure that is absent or not finite)."""
        return logp_diff_mean * self.rollout_reference_tokens if _finite(logp_diff_mean) else None

    def mask_cap(self, cap) -> float:
        """The sequence-mask cap a run masked at: its own (a GRPOConfig's vllm_importance_sampling_clip_max,
        as the record's rollout_mismatch.mask_cap holds it) where it is a positive number, else
        rollout_ratio_cap."""
        return float(cap) if _finite(cap) and cap > 0 else self.rollout_ratio_cap

    def off_policy(self, logp_diff_mean, masked_share, cap: float | None = None) -> list[str]:
        """Why a rollout's mismatch is beyond the bounds: 'extrapolated' when the ratio bound at
        rollout_reference_tokens leaves [1/cap, cap], 'masked' when some of the probe's own completions
        crossed the cap; [] when neither (or nothing was measured). cap: the run's own sequence-mask cap
        (a GRPOConfig's vllm_importance_sampling_clip_max), rollout_ratio_cap where it has none."""
        bound = self.rollout_log_ratio(logp_diff_mean)
        out = ["extrapolated"] if bound is not None and bound > math.log(self.mask_cap(cap)) else []
        return out + (["masked"] if _finite(masked_share) and masked_share > 0 else [])

    def unjudged(self, steps: int) -> list[str]:
        """The verdict rules a probe of `steps` training steps is too short to apply."""
        rules = {"a loss spike": self.spike_min_history + 1, "a rising loss": self.rise_min_steps}
        return [f"{rule} (needs {n} steps)" for rule, n in rules.items() if steps < n]


THRESHOLDS = Thresholds()


def _bound(absolute: float, factor: float, floor) -> float:
    """max(absolute, factor x floor): a figure's bound above the rounding floor measured beside it (a
    floor that is absent or not finite raises nothing)."""
    return max(absolute, factor * floor) if _finite(floor) else absolute


def _finite(x) -> bool:
    """A measured figure: a number, not None, NaN or inf (nor an int too large for a float)."""
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def refuse_short_probes(kind: str, steps: int, t: Thresholds = THRESHOLDS) -> str | None:
    """A grid or bisect of too few steps: refused (NandoctorError) below t.min_probe_steps, else a
    warning naming the rules it cannot apply, or None."""
    if steps < t.min_probe_steps:
        raise NandoctorError(
            f"--steps {steps} is too few for {kind}: a {steps}-step probe never trains on its own "
            f"optimizer update, so a configuration that fails at step 1 would be called stable; pass "
            f"--steps {t.min_probe_steps} or more "
            f"(every verdict rule: {max(t.spike_min_history + 1, t.rise_min_steps)}), "
            "or use `nandoctor check` for a step-0 check"
        )
    unjudged = t.unjudged(steps)
    if unjudged:
        return (
            f"--steps {steps} is too short to judge {' or '.join(unjudged)}: those verdicts cannot be given; "
            f"pass --steps {max(t.spike_min_history + 1, t.rise_min_steps)} or more to judge every rule"
        )
    return None
