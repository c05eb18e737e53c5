"""nandoctor inside a real training run: `NandoctorCallback` for transformers' Trainer
(integrations/transformers.py, extra `hf`) and for Lightning (integrations/lightning.py, extra
`lightning`), over one framework-neutral core (integrations/watch.py). Importing nandoctor, or
this package, needs neither framework."""
