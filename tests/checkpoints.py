"""Real tiny checkpoints on disk (config.json + safetensors), made the way a user's would be."""

from __future__ import annotations

import json
from pathlib import Path

TINY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def save_llama(path: Path, mlp_scale: dict | None = None, seed: int = 0, **overrides) -> Path:
    """A random-init Llama saved with save_pretrained. mlp_scale {layer: (up_gate_factor, down_factor)}
    multiplies that layer's MLP weights, so its activations get large in magnitude."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**TINY, **overrides}))
    with torch.no_grad():
        for layer, (up_gate, down) in (mlp_scale or {}).items():
            mlp = model.model.layers[layer].mlp
            mlp.up_proj.weight.mul_(up_gate)
            mlp.gate_proj.weight.mul_(up_gate)
            mlp.down_proj.weight.mul_(down)
    model.save_pretrained(path)
    return path


def save_bf16_llama(path: Path, seed: int = 0) -> Path:
    """A random-init Llama saved in bf16, as most hub checkpoints are: its config.json says
    dtype=bfloat16, which from_pretrained loads in by default since transformers 5."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def save_dead_llama(path: Path) -> Path:
    """A Llama that cannot learn: lm_head and the final norm's weight are zero. The logits are 0 for
    every token (loss ln(vocab) on any batch), the lm_head's gradient is the logits' gradient times
    the normed hidden state (0), and nothing below the lm_head receives any: every gradient is
    exactly 0, so no optimizer step changes a weight."""
    import torch
    from transformers import AutoModelForCausalLM

    save_llama(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.model.norm.weight.zero_()
    model.save_pretrained(path)
    return path


RESIDUAL_SCALE, HEAD_SCALE = 0.1, 12.0  # save_peaky_llama's weights


def save_peaky_llama(path: Path, seed: int = 0) -> Path:
    """A Llama shaped like a trained policy where the output head's rounding counts (docs/rl.md): each layer
    adds little to its residual stream (attention's o_proj and the MLP's down_proj x RESIDUAL_SCALE, GPT-2's
    scaled init of the residual projections taken further: the layers move the stream by about 5% of its
    RMS), and the head's logits are large (lm_head x HEAD_SCALE: logit std 1.9, up to 9, a mean token
    entropy of 5.1 nats of ln(1024) = 6.9, where the random init's logits have std 0.16)."""
    import torch
    from transformers import AutoModelForCausalLM

    save_llama(path, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_SCALE)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE)
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(path)
    return path


# Layer 1's MLP scaled so that down_proj's output passes 65504 (fp16's largest finite value) while
# fp32 and bf16 (8-bit exponent) hold it; measured on the 4 synthetic batches: max |down_proj| is
# 2.1e5 to 3.2e5 (with factors 100/300 it was 4.7e4 to 7.1e4: only some batches overflow).
LARGE_MLP = {1: (150.0, 600.0)}


FAULTY_CODE = '''
import ctypes, os, time
from transformers import LlamaConfig, LlamaForCausalLM


class FaultyLlamaConfig(LlamaConfig):
    model_type = "faulty-llama"


class FaultyLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code with a bug per attention setting, as custom code in a checkpoint can have."""
    config_class = FaultyLlamaConfig

    def forward(self, *args, **kwargs):
        attn = self.config._attn_implementation
        pure_half = next(self.parameters()).dtype != __import__("torch").float32
        if attn == "eager" and not pure_half:
            raise RuntimeError("faulty-llama: unsupported rotary layout in custom kernel")
        if attn == "eager" and pure_half:
            time.sleep(3600)
        if attn == "sdpa" and pure_half:
            os.abort()
        return super().forward(*args, **kwargs)
'''


def save_custom_llama(path: Path, module: str, prefix: str, code: str, **config_extra) -> Path:
    """A tiny Llama checkpoint with its own modeling code in path/module.py, wired through auto_map
    as a checkpoint with custom code is (loading it needs --trust-remote-code)."""
    save_llama(path)
    (path / f"{module}.py").write_text(code)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type=f"{prefix.lower()}-llama", architectures=[f"{prefix}LlamaForCausalLM"], **config_extra)
    config["auto_map"] = {
        "AutoConfig": f"{module}.{prefix}LlamaConfig",
        "AutoModelForCausalLM": f"{module}.{prefix}LlamaForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def save_faulty_llama(path: Path) -> Path:
    """A checkpoint with its own modeling code (auto_map): fp32/eager raises, fp32/sdpa trains,
    half/eager hangs, half/sdpa aborts the process."""
    return save_custom_llama(path, "faulty_llama", "Faulty", FAULTY_CODE)


LLAMA3_STYLE_VOCAB = ["!", "the", "cat", "sat", "on", "mat", "<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<pad>"]


def save_tokenizer(path: Path, **special) -> Path:
    """A real word-level tokenizer built with the `tokenizers` library and saved the way
    transformers saves one. Id 0 is "!", an ordinary token, as in Llama 3's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(LLAMA3_STYLE_VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", unk_token="<unk>", **special
    )
    fast.save_pretrained(path)
    return path


FLAKY_CODE = '''
import math
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM


class FlakyLlamaConfig(LlamaConfig):
    model_type = "flaky-llama"


class FlakyLlamaForCausalLM(LlamaForCausalLM):
    """Custom modeling code with state across runs: with sdpa attention, every odd-numbered process
    that trains it (counted in a file named by config.flaky_counter_path) gets a NaN loss, as a
    nondeterministic kernel would. Eager attention never touches the counter."""
    config_class = FlakyLlamaConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.config._attn_implementation == "sdpa":
            if not hasattr(self, "_poisoned"):
                counter = Path(self.config.flaky_counter_path)
                n = int(counter.read_text()) + 1 if counter.exists() else 1
                counter.write_text(str(n))
                self._poisoned = n % 2 == 1
            if self._poisoned:
                out.loss = out.loss * math.nan
        return out
'''


def save_flaky_llama(path: Path) -> Path:
    """A checkpoint with its own modeling code (auto_map) whose sdpa runs alternate NaN / fine by
    process, counted in path/runs.txt; eager runs are always fine."""
    return save_custom_llama(path, "flaky_llama", "Flaky", FLAKY_CODE, flaky_counter_path=str(path / "runs.txt"))


CRASHING_CODE = '''
import ctypes, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class CrashingLlamaConfig(LlamaConfig):
    model_type = "crashing-llama"


class CrashingLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code that brings its process down per attention cell: eager reads address 0 (a real
    SIGSEGV), sdpa with only the math backend enabled sleeps forever, the other sdpa cells train."""
    config_class = CrashingLlamaConfig

    def forward(self, *args, **kwargs):
        if self.config._attn_implementation == "eager":
            ctypes.string_at(0)
        if not torch.backends.cuda.flash_sdp_enabled():  # inside sdpa_kernel([MATH]): the sdpa:math cell
            time.sleep(3600)
        return super().forward(*args, **kwargs)
'''


SLOW_REPLAY_CODE = '''
import time
from transformers import LlamaConfig, LlamaForCausalLM


class SlowReplayLlamaConfig(LlamaConfig):
    model_type = "slowreplay-llama"


class SlowReplayLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code that trains normally, but sleeps once forward hooks watch it: the forensics
    replay (which hooks every module) hangs, the timed step of a one-step probe (which hooks nothing)
    does not."""
    config_class = SlowReplayLlamaConfig

    def forward(self, *args, **kwargs):
        if self._forward_hooks:
            time.sleep(3600)
        return super().forward(*args, **kwargs)
'''


def save_slow_replay_llama(path: Path) -> Path:
    """A checkpoint with its own modeling code whose forensics replay hangs and whose timed steps train."""
    return save_custom_llama(path, "slow_replay_llama", "SlowReplay", SLOW_REPLAY_CODE)


NO_LOSS_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class NoLossLlamaConfig(LlamaConfig):
    model_type = "noloss-llama"


class NoLossLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code that drops `labels`: its forward returns logits and loss=None."""
    config_class = NoLossLlamaConfig

    def forward(self, *args, labels=None, **kwargs):
        return super().forward(*args, **kwargs)
'''


def save_no_loss_llama(path: Path) -> Path:
    """A checkpoint with its own modeling code (auto_map) whose forward returns loss=None."""
    return save_custom_llama(path, "noloss_llama", "NoLoss", NO_LOSS_CODE)


def save_crashing_llama(path: Path) -> Path:
    """A checkpoint with its own modeling code (auto_map), all fp32 cells so it is cheap on a CPU:
    fp32/eager segfaults, fp32/sdpa:math hangs, fp32/sdpa trains."""
    return save_custom_llama(path, "crashing_llama", "Crashing", CRASHING_CODE)


def tiny_qwen3_moe(**overrides):
    """A random-init Qwen3-MoE of 8 experts, top-2, 2 layers of 64, seeded, as transformers 5.24 builds it
    (output_router_logits=False unless an override says otherwise)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    experts = dict(num_experts=8, num_experts_per_tok=2)
    rest = dict(vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**shape, **heads, **experts, **rest, **overrides}))


def save_collapsed_qwen3_moe(path: Path, output_router_logits: bool = False) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2) whose routers send every token to experts 0 and 1: every
    token embedding carries a large constant in dimension 0, which survives each RMSNorm, and each
    router's weight reads that dimension with +5 for experts 0 and 1 and -5 for the others (logit gaps of
    ~80). Saved as transformers 5.24 makes it (output_router_logits=False unless asked)."""
    import torch

    model = tiny_qwen3_moe(output_router_logits=output_router_logits)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 20.0
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[:, 0] = -5.0
            gate[:2, 0] = 5.0
    model.save_pretrained(path)
    return path


def save_tied_router_qwen3_moe(path: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2) whose routers see near-ties: every token embedding carries 20
    in dimension 0 (about 7.4 after each RMSNorm, the others N(0, 1)), which every router row reads with
    weight 1.0, so every logit is ~7.4, plus token-dependent differences of ~3e-3 between experts (the
    rest of the router's weights, N(0, 1e-3)). fp32 ranks the experts by those differences and spreads
    the tokens; bf16 (a spacing of 1/32 there) rounds them into one tie, and top-k picks by position:
    the same two experts for every token."""
    import torch

    model = tiny_qwen3_moe()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.model.embed_tokens.weight[:, 0] = 20.0
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.normal_(0, 1e-3)
            gate[:, 0] = 1.0
    model.save_pretrained(path)
    return path


# The two mutants the setup checks must catch (STYLE rule 24): modeling code that reads like Llama's
# and trains, with the loss falling, while the setup is broken.
DROPS_POSITIONS_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class DropsPositionsLlamaConfig(LlamaConfig):
    model_type = "dropspositions-llama"


class DropsPositionsLlamaForCausalLM(LlamaForCausalLM):
    """Ignores position_ids: positions count on across a packed row and, with no mask and no
    position_ids, transformers builds one causal mask over the whole row: the segments see each other."""
    config_class = DropsPositionsLlamaConfig

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)
'''

IGNORES_ITEMS_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class IgnoresItemsLlamaConfig(LlamaConfig):
    model_type = "ignoresitems-llama"


class IgnoresItemsLlamaForCausalLM(LlamaForCausalLM):
    """Takes loss kwargs (its **kwargs) but drops num_items_in_batch: each micro-batch's loss is its
    own mean, and the Trainer, which then does not divide by the accumulation steps, adds them up."""
    config_class = IgnoresItemsLlamaConfig

    def forward(self, *args, num_items_in_batch=None, **kwargs):
        return super().forward(*args, **kwargs)
'''

IGNORES_BOTH_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class IgnoresBothLlamaConfig(LlamaConfig):
    model_type = "ignoresboth-llama"


class IgnoresBothLlamaForCausalLM(LlamaForCausalLM):
    """Drops position_ids (packed segments see each other) and num_items_in_batch (the accumulated
    gradient is the micro-batches' means added up): both setup checks must fail."""
    config_class = IgnoresBothLlamaConfig

    def forward(self, *args, position_ids=None, num_items_in_batch=None, **kwargs):
        return super().forward(*args, **kwargs)
'''


def save_drops_positions_llama(path: Path, **config_extra) -> Path:
    return save_custom_llama(path, "drops_positions", "DropsPositions", DROPS_POSITIONS_CODE, **config_extra)


def save_ignores_items_llama(path: Path, **config_extra) -> Path:
    return save_custom_llama(path, "ignores_items", "IgnoresItems", IGNORES_ITEMS_CODE, **config_extra)


def save_ignores_both_llama(path: Path, **config_extra) -> Path:
    return save_custom_llama(path, "ignores_both", "IgnoresBoth", IGNORES_BOTH_CODE, **config_extra)
