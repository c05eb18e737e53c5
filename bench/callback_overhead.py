"""Cost of the training callbacks on a clean run, as ratios measured in one run: tiny-llama trained
by a real transformers Trainer and a real Lightning Trainer, with and without NandoctorCallback, in
alternating rounds. A step is timed from the framework's step-begin hook to its step-end hook by
callbacks placed before and after NandoctorCallback, so the watch's own hooks are inside the time.
Step 0 (the step-0 check, with hooks on every module) is reported apart from the steady state.
The watched runs also time every entry point of the callback (its hooks and framework events): that
share of the step is its cost without the difference of two noisy step times, which on a loaded
machine swamps a few percent. Usage: python bench/callback_overhead.py [ROUNDS] [STEPS] [EVERY]"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings

import torch

from nandoctor.cells import Cell
from nandoctor.child.build import build_model
from nandoctor.data import batches
from nandoctor.env import collect_summary
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model


class Rows(torch.utils.data.Dataset):
    """tiny-llama's synthetic batches, as the rows a Trainer batches again."""

    def __init__(self, recipe, config):
        stream = batches(recipe, config, recipe.seed)
        fixed = [next(stream) for _ in range(recipe.data.batches)]
        self.rows = [{k: v[i] for k, v in b.items()} for b in fixed for i in range(recipe.batch_size)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def timed(callback, names: tuple, inside: list) -> None:
    """Wrap the callback's entry points so that their wall time adds up in inside[-1] (the current step)."""

    def timing(method):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                inside[-1] += time.perf_counter() - t0

        return wrapper

    for name in names:
        setattr(callback, name, timing(getattr(callback, name)))


def tiny_llama():
    recipe = resolve_model("tiny-llama")
    model = build_model(plan_model(recipe, collect_summary()), recipe, Cell("fp32", "sdpa"), recipe.seed)
    return recipe, model


def hf_step_times(steps: int, watched: bool, every: int) -> tuple[list[float], list[float]]:
    """Per step: wall time, and the time spent inside NandoctorCallback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nandoctor.integrations.transformers import NandoctorCallback

    times, started, inside = [], [], []

    class Start(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            started.append(time.perf_counter())
            inside.append(0.0)

    class End(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - started[-1])

    recipe, model = tiny_llama()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            max_steps=steps,
            per_device_train_batch_size=recipe.batch_size,
            learning_rate=recipe.optimizer.lr,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            logging_steps=steps,
        )
        middle = [NandoctorCallback(every=every)] if watched else []
        for callback in middle:
            timed(
                callback, ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "_inputs", "_loss", "_grad"), inside
            )
        Trainer(
            model=model, args=args, train_dataset=Rows(recipe, model.config), callbacks=[Start(), *middle, End()]
        ).train()
    return times, inside


def lightning_step_times(steps: int, watched: bool, every: int) -> tuple[list[float], list[float]]:
    """Per step: wall time, and the time spent inside NandoctorCallback."""
    import lightning as L

    from nandoctor.integrations.lightning import NandoctorCallback

    times, started, inside = [], [], []

    class Start(L.Callback):
        def on_train_batch_start(self, *args):
            started.append(time.perf_counter())
            inside.append(0.0)

    class End(L.Callback):
        def on_train_batch_end(self, *args):
            times.append(time.perf_counter() - started[-1])

    recipe, model = tiny_llama()

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=recipe.optimizer.lr)

    with tempfile.TemporaryDirectory() as out:
        middle = [NandoctorCallback(every=every)] if watched else []
        for callback in middle:
            timed(
                callback,
                ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"),
                inside,
            )
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Start(), *middle, End()],
            default_root_dir=out,
        )
        trainer.fit(CausalLM(), torch.utils.data.DataLoader(Rows(recipe, model.config), batch_size=recipe.batch_size))
    return times, inside


def main(rounds: int = 3, steps: int = 20, every: int = 1) -> None:
    import os

    warnings.simplefilter("ignore")
    print(
        f"# callback overhead: tiny-llama, {rounds} alternating rounds of {steps} steps, every={every}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    for name, step_times in (("transformers Trainer", hf_step_times), ("Lightning Trainer", lightning_step_times)):
        runs = {False: [], True: []}
        for _ in range(rounds):
            for watched in (False, True):
                runs[watched].append(step_times(steps, watched, every))
        steady = {w: statistics.median(t for times, _ in runs[w] for t in times[1:]) for w in runs}
        first = {w: statistics.median(times[0] for times, _ in runs[w]) for w in runs}
        share = sum(sum(inside[1:]) for _, inside in runs[True]) / sum(sum(times[1:]) for times, _ in runs[True])
        print(
            f"{name}: {steady[False] * 1e3:.2f} ms/step plain, {steady[True] * 1e3:.2f} ms/step watched: "
            f"steady-state ratio {steady[True] / steady[False]:.3f}; "
            f"time inside the callback {100 * share:.2f}% of the step time; "
            f"step 0 (the step-0 check) ratio {first[True] / first[False]:.2f}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
