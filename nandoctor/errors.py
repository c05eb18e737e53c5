"""The one exception type for errors the user caused. Foundation module: imports nothing."""

from __future__ import annotations


class NandoctorError(Exception):
    """An error the user caused (bad model, axis, recipe, run directory). The CLI prints it as one line
    and exits 2; nothing else should catch it."""
