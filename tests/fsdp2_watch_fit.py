"""One rank of a watched Lightning FSDP2 fit on the tiny Llama (CPU, gloo), run under torchrun:

    torchrun --standalone --nproc_per_node 2 tests/fsdp2_watch_fit.py OUT LR STEPS [OFF_RANK]

Lightning's ModelParallelStrategy with the data-parallel dimension over both ranks; the module's
configure_model applies fully_shard to every decoder layer and to the model, as FSDP2 is written by
hand. Each rank writes OUT/rank<r>.json: the steps it judged and what its watch said. On OFF_RANK
the watch is switched off before training, as an internal error inside nandoctor does.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from training_runs import MotifRows, tiny_llama

from nandoctor.integrations.lightning import NandoctorCallback


class ShardedCausalLM(L.LightningModule):
    def __init__(self, model, lr):
        super().__init__()
        self.model, self.lr = model, lr

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(out: Path, lr: float, steps: int, off_rank: int | None) -> None:
    callback = NandoctorCallback()
    if int(os.environ["RANK"]) == off_rank:
        callback.watch.switch_off("the test", RuntimeError("this rank's watch is off"))
    trainer = L.Trainer(
        max_steps=steps,
        precision="32-true",
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(out),
    )
    trainer.fit(ShardedCausalLM(tiny_llama(), lr), torch.utils.data.DataLoader(MotifRows(rows=256), batch_size=4))
    w = callback.watch
    sharded = [type(p).__name__ for _, p in w.named]
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "global_step": trainer.global_step,
                "judged": [s.step for s in w.steps],
                "losses": [s.loss for s in w.steps],
                "grad_norms": [s.grad_norm for s in w.steps],
                "sharded": sorted(set(sharded)),
                "failure": w.failure.verdict.name if w.failure else None,
                "failed_at": w.failure.verdict.step if w.failure else None,
                "stopped_by": w.stopped_by,
                "report_dir": str(w.report_dir) if w.report_dir else None,
                "off": w.off,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
