"""nandoctor inside a real training run: `NandoctorCallback` for transformers' Trainer
(integrations/transformers.py, extra `hf`) and for Lightning (integrations/lightning.py, extra
`lightning`), over one framework-neutral `Watch` (integrations/watch.py) that orchestrates the
judging (judge.py), the replay (child/failing_step.py), the report (failure_report.py) and the ranks' agreement
(ranks.py) of a `LiveRun` (live.py). Importing nandoctor, or this package, needs neither framework."""
