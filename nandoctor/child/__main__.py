import os
import sys

from ..record import PARENT_ENV
from .lifetime import die_with_parent, parent_gone

# Tied to the process that started it before anything heavy is imported: a Ray task cancelled with
# force, or a job step killed, ends that process without its cleanup, and this probe must not train on
# as an orphan on the node. The variable is dropped here, so nothing this probe starts inherits it.
die_with_parent()
if parent_gone(os.environ.pop(PARENT_ENV, None), os.getppid()):
    sys.exit(1)  # it died while this process started: nobody waits for this probe's result

import json  # noqa: E402

from .worker import preload  # noqa: E402

# What a warm worker imports before its first fork, its model's modeling code and peft for an adapter
# included (the spec says which), hiding what it hides (worker.preload): a cold probe then trains on the
# same imports as a warm one, and skips what no probe uses (scipy's second of import on a 2-core CPU). An
# import that fails here, or a spec that does not read, fails again inside the probe, which records it as
# a warm probe's would be.
try:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    model_type, adapter = spec["model_plan"]["model_type"], spec["recipe"]["adapter"]["type"] != "none"
except Exception:
    model_type, adapter = None, False
try:
    preload(model_type, adapter)
except Exception:
    pass

from .entry import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
