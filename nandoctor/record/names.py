"""The names both processes agree on: the files in a probe's folder, the environment variables a probe
process reads, and the forensics placeholder of a replay still running."""

from __future__ import annotations

# `forensics` of a result written after the timed steps, while the replay still runs. A record that
# still says so when its process ended had its replay cut short (the runner notes why).
REPLAY_RUNNING = {"status": "running"}
# The file a probe writes once its model is built (imports, load, wrapping done): from then on its
# timed steps have timeout_s; before it, the build has build_timeout_s.
BUILT_FILE = "built"
STALE_FILES = ("result.json", "steps.jsonl", BUILT_FILE)  # what a rerun of a probe in the same folder clears first
# The pid of the process that starts a probe process (`python -m nandoctor.child`): a cold slot's
# runner, or run/placed.py inside an executor's job or task; the probe dies with it (child/__main__.py).
PARENT_ENV = "NANDOCTOR_PARENT_PID"
# the Unix socket of a zygote that forks warm workers already imported (child/zygote.py, run/zygote.py)
ZYGOTE_ENV = "NANDOCTOR_ZYGOTE"
