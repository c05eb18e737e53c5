"""nandoctor: measure which precision / attention / compile configuration trains stably."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # load_run pulls in pandas: imported on first use, so that `import nandoctor` stays light
    if name == "load_run":
        from .analysis.outcomes import load_run

        return load_run
    raise AttributeError(f"module 'nandoctor' has no attribute {name!r}")
