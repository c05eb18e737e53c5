"""One rank of a watched transformers Trainer run on the tiny Llama under DDP (CPU, gloo), run under torchrun:

    torchrun --standalone --nproc_per_node 2 tests/trainer_ddp_watch_fit.py OUT LR STEPS

The Trainer wraps the model in DistributedDataParallel itself (accelerate's MULTI_CPU). Each rank
writes OUT/rank<r>.json: the steps it judged, the losses it judged them by, and what its watch said.
"""

import json
import math
import sys
from pathlib import Path

from training_runs import QUIET_TRAINING_ARGS, MotifRows, tiny_llama
from transformers import Trainer, TrainingArguments

from nandoctor.integrations.transformers import NandoctorCallback


def main(out: Path, lr: float, steps: int) -> None:
    callback = NandoctorCallback()
    model = tiny_llama()
    args = TrainingArguments(
        str(out), **{**QUIET_TRAINING_ARGS, "max_steps": steps, "learning_rate": lr, "ddp_backend": "gloo"}
    )
    trainer = Trainer(model=model, args=args, train_dataset=MotifRows(rows=256), callbacks=[callback])
    trainer.train()
    w = callback.watch
    (out / f"rank{args.process_index}.json").write_text(
        json.dumps(
            {
                "world_size": args.world_size,
                "wrapped": type(trainer.model_wrapped).__name__,
                "ln_vocab": math.log(model.config.vocab_size),
                "global_step": trainer.state.global_step,
                "judged": [s.step for s in w.steps],
                "losses": [s.loss for s in w.steps],
                "failure": w.failure.verdict.name if w.failure else None,
                "failed_at": w.failure.verdict.step if w.failure else None,
                "stopped_by": w.stopped_by,
                "report_dir": str(w.report_dir) if w.report_dir else None,
                "off": w.off,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
