"""The framework-neutral watch on a real tiny model, fed step values directly: what a GradScaler's
calibration looks like to it. Fast: no training step runs."""

from pathlib import Path

import torch
from training_runs import tiny_llama

from nandoctor.cells import Cell
from nandoctor.integrations.live import autocast_of, recipe_of
from nandoctor.integrations.watch import LiveRun, Watch

INF = float("inf")


def watch_on_tiny_llama(tmp_path: Path) -> Watch:
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cell = Cell("fp16-amp", "sdpa")
    watch = Watch(device={"device": "cpu", "gpus": []})
    watch.start(
        LiveRun(
            "test",
            cell,
            recipe_of("test", model, optimizer, 1.0, 0, cell),
            model,
            optimizer,
            "cpu",
            tmp_path,
            step_loss=model,
            autocast=autocast_of(cell, "cpu"),
        )
    )
    return watch


def test_grad_scaler_calibration_skips_are_not_failures_until_the_scale_falls_below_1(tmp_path):
    watch = watch_on_tiny_llama(tmp_path)
    verdicts = [
        watch.judge(step, 6.9, grad_norm, scale, batch={})
        for step, grad_norm, scale in [(0, INF, 65536.0), (1, INF, 32768.0), (2, 1.2, 16384.0), (3, INF, 1.0)]
    ]
    assert [v.name for v in verdicts] == ["stable", "stable", "stable", "nonfinite"]
    assert watch.steps[0].skipped and not watch.steps[2].skipped
    assert verdicts[3].reason == "GradScaler scale fell below 1 at step 3: gradients overflow fp16 even unscaled"
