"""The watched 2-rank fits that test_integrations_ddp.py, _fsdp2.py and _trainer_ddp.py read, all in one
torchrun launch on the tiny Llama (CPU, gloo):

    torchrun --standalone --nproc_per_node 2 tests/watch_fits.py OUT

A launch pays seconds of `import torch, transformers, lightning` on the launcher and on each rank; one
launch pays them once for every fit. Both ranks run the fits of FITS in turn in one process group
(initialised here; Lightning and accelerate find it and keep it), each fit with a fresh model and a
fresh NandoctorCallback, and write OUT/<fit>/rank<r>.json: the steps they trained and judged, and what
their watch said. On a fit's off_rank the watch is switched off before training, as an internal error
inside nandoctor does.

The ranks share one stderr. Between two barriers before each fit (and at the end), rank 0 writes the
line `watch-fits: <fit>` (`watch-fits: end`), so that every line a fit's ranks write falls between its
marker and the next one: `launch` splits the stderr there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).parent
MARK = "watch-fits: "


@dataclass
class Fit:
    """One fit of a launch: its output directory, its ranks' records ({rank: record}, for the ranks
    that wrote one), the stderr lines written during it, and the launch's exit code and whole stderr."""

    out: Path
    ranks: dict[int, dict]
    stderr: str = field(repr=False)
    returncode: int
    log: str = field(repr=False)


def launch(out: Path, timeout: float = 600) -> dict[str, Fit]:
    """torchrun of this file with 2 ranks, writing under `out`; returns {fit name: Fit} for every fit
    of FITS, also those a failed launch never reached (no records, no stderr)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = by_fit(done.stderr)
    return {
        name: Fit(out / name, _records(out / name), lines.get(name, ""), done.returncode, done.stderr) for name in FITS
    }


def by_fit(stderr: str) -> dict[str, str]:
    """The lines of stderr after each `watch-fits: <fit>` marker, up to the next marker."""
    parts, name = {}, None
    for line in stderr.splitlines(keepends=True):
        if line.startswith(MARK):
            name = line[len(MARK) :].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def _records(out: Path) -> dict[int, dict]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()}


# --- inside each rank --------------------------------------------------------------------------------


def lightning_fit(out: Path, lr: float, steps: int, sharded: bool = False, off_rank: int | None = None) -> dict:
    """Trainer.fit() under strategy="ddp", or (sharded) under ModelParallelStrategy with the data-parallel
    dimension over both ranks, the module's configure_model applying fully_shard to every decoder layer
    and to the model, as FSDP2 is written by hand. Returns this rank's record."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from training_runs import QUIET_LIGHTNING, MotifRows, tiny_llama

    from nandoctor.integrations.lightning import NandoctorCallback

    class CausalLM(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def configure_model(self):
            if sharded:
                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    callback = NandoctorCallback()
    if int(os.environ["RANK"]) == off_rank:
        callback.watch.switch_off("the test", RuntimeError("this rank's watch is off"))
    trainer = L.Trainer(
        max_steps=steps,
        precision="32-true",
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded else "ddp",
        **QUIET_LIGHTNING,
        callbacks=[callback],
        default_root_dir=str(out),
    )
    trainer.fit(CausalLM(tiny_llama()), torch.utils.data.DataLoader(MotifRows(rows=256), batch_size=4))
    w = callback.watch
    return {
        "global_step": trainer.global_step,
        "sharded": sorted({type(p).__name__ for _, p in w.named}),
        "grad_norms": [s.grad_norm for s in w.steps],
        **_watched(w),
    }


def trainer_fit(out: Path, lr: float, steps: int) -> dict:
    """A transformers Trainer run; the Trainer wraps the model in DistributedDataParallel itself
    (accelerate's MULTI_CPU). Returns this rank's record."""
    import math

    from training_runs import QUIET_TRAINING_ARGS, MotifRows, tiny_llama
    from transformers import Trainer, TrainingArguments

    from nandoctor.integrations.transformers import NandoctorCallback

    callback = NandoctorCallback()
    model = tiny_llama()
    args = TrainingArguments(
        str(out), **{**QUIET_TRAINING_ARGS, "max_steps": steps, "learning_rate": lr, "ddp_backend": "gloo"}
    )
    trainer = Trainer(model=model, args=args, train_dataset=MotifRows(rows=256), callbacks=[callback])
    trainer.train()
    return {
        "world_size": args.world_size,
        "wrapped": type(trainer.model_wrapped).__name__,
        "ln_vocab": math.log(model.config.vocab_size),
        "global_step": trainer.state.global_step,
        **_watched(callback.watch),
    }


def _watched(w) -> dict:
    """What a rank's watch judged and said."""
    return {
        "judged": [s.step for s in w.steps],
        "losses": [s.loss for s in w.steps],
        "failure": w.failure.verdict.name if w.failure else None,
        "failed_at": w.failure.verdict.step if w.failure else None,
        "stopped_by": w.stopped_by,
        "report_dir": str(w.report_dir) if w.report_dir else None,
        "off": w.off,
    }


# name: (fit, its arguments). The Trainer's fit comes last: accelerate keeps its state (PartialState) for
# the rest of the process.
FITS = {
    # AdamW at lr=30: the loss explodes within a few steps on both ranks
    "ddp-lr30": (lightning_fit, dict(lr=30.0, steps=20)),
    # lr=1e-3 for 4 steps, rank 1's watch off before training
    "ddp-healthy-rank1-off": (lightning_fit, dict(lr=1e-3, steps=4, off_rank=1)),
    "fsdp2-lr30": (lightning_fit, dict(lr=30.0, steps=20, sharded=True)),
    "fsdp2-lr30-rank1-off": (lightning_fit, dict(lr=30.0, steps=20, sharded=True, off_rank=1)),
    "trainer-ddp-lr30": (trainer_fit, dict(lr=30.0, steps=20)),
}


def _mark(name: str) -> None:
    """Every rank has written its lines of the fit before; rank 0 marks the next one; then it starts."""
    import torch.distributed as dist

    sys.stderr.flush()
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"{MARK}{name}", file=sys.stderr, flush=True)
    dist.barrier()


def main(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for name, (fit, kwargs) in FITS.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        _mark(name)
        record = fit(out / name, **kwargs)
        (out / name / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    _mark("end")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
