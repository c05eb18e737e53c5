"""Optional packages (cells.PACKAGES: torchao, bitsandbytes, transformer_engine) belong to the probes
whose cell needs them. transformers and peft import every one of them they find installed while
their own modules load (transformers' quantizer registry imports torchao, peft's LoRA layers
bitsandbytes): seconds of import in every process, and the packages' own noise on its stderr
(torchao's "Failed to load ...so", torch's _pytree deprecation lines, bitsandbytes' kernels line).

Foundation module: imports nothing from nandoctor.
"""

from __future__ import annotations

import contextlib
import sys

# What transformers imports while its modeling code loads although no probe uses it: scipy.optimize
# (0.7-0.9 s of CPU on a 2-core CPU, torch already imported), for its object-detection losses only
# (transformers.loss.loss_for_object_detection), and, where scikit-learn is installed, sklearn.metrics for
# assisted generation's candidate lengths (transformers.generation.candidate_generator); scikit-learn
# imports scipy and numpy's OpenBLAS, whose thread pool the warm worker would then hold when it forks.
# Hidden only in worker.preload, which a warm worker and a cold probe (child/__main__.py) run before
# anything else imports transformers: transformers caches is_scipy_available() and is_sklearn_available(),
# and a process that asked them before (a test process, the planner) would then fail to import those
# modules. A module that imports either itself later still gets it.
# Likewise boto3 (accelerate's SageMaker config imports it wherever it is installed) and trio (an HTTP
# client's optional async backend, under transformers' hub code): a probe makes no network call, and the
# two cost a warm worker 0.3-0.5 s of its import on a 2-core CPU (bench/RESULTS.md).
UNUSED_BY_PROBES = ("scipy", "sklearn", "boto3", "trio")


@contextlib.contextmanager
def hidden(modules):
    """Make the named top-level packages look absent while the block runs: a None entry in
    sys.modules makes importlib.util.find_spec() answer None and `import` raise ImportError. Packages
    already imported stay as they are; afterwards the packages import normally again (the libraries
    loaded inside the block keep their own, cached, answer that the package is absent)."""
    blocked = [m for m in modules if m not in sys.modules]
    for module in blocked:
        sys.modules[module] = None
    try:
        yield
    finally:
        for module in blocked:
            if module in sys.modules and sys.modules[module] is None:
                del sys.modules[module]
