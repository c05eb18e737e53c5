"""`nandoctor` entry point: wires the subcommands; each lives in its own module with a
`register(subparsers)` that adds its parser and a `run(args)` that calls the API."""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading

from .. import __version__
from ..errors import NandoctorError
from . import bisect, check, diff, doctor, explain, grid, report

COMMANDS = (grid, check, bisect, report, diff, doctor, explain)
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what CI systems, `timeout`, SLURM preemption and `docker stop` send), raised where Ctrl-C's
    KeyboardInterrupt would be, so that a run ends the same way: probes ended, jobs cancelled, what was
    recorded kept, the resume line printed."""

    signal = signal.SIGTERM


def terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the cleanup short
    raise Terminated()


REDELIVER_S = 0.05


def redelivering(hook):
    """sys.unraisablehook while main() handles SIGTERM. Python cannot raise where a signal may land (a
    weakref callback, a __del__, a GC callback: inside an import, say): it prints the Terminated, or
    Ctrl-C's KeyboardInterrupt, as "Exception ignored" and the run goes on as if no signal had come.
    Such a signal is sent again; anything else goes to `hook`."""

    def on_unraisable(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)
            return
        signum = signal.SIGINT
        if isinstance(unraisable.exc_value, Terminated):
            signum = signal.SIGTERM
            signal.signal(signum, terminate)
        # to the main thread (a sleep or a wait there is cut short, as by the first), REDELIVER_S later: by
        # then it has left the callback, and this hook (a signal that came sooner would be lost again here)
        main = threading.main_thread().ident
        redeliver = threading.Timer(REDELIVER_S, signal.pthread_kill, (main, signum))
        redeliver.daemon = True
        redeliver.start()

    return on_unraisable


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (main adds the prefix)."""

    def error(self, message):
        raise NandoctorError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> Parser:
    parser = Parser(
        prog="nandoctor",
        description="Find the precision / attention / compile configuration that trains stably on this machine.",
    )
    parser.add_argument("--version", action="version", version=f"nandoctor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code: 2 for the user's error, 130 after Ctrl-C, 143 after SIGTERM."""
    # SIGTERM ends a run as Ctrl-C does, unless the program that called this handles it itself
    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if ours:
        signal.signal(signal.SIGTERM, terminate)
        unraisable, sys.unraisablehook = sys.unraisablehook, redelivering(sys.unraisablehook)
    try:
        return run(argv)
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sys.unraisablehook = unraisable


def run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except NandoctorError as e:
        print(f"nandoctor: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in OUT_OF_SPACE:
            raise
        # a write the code did not name (a probe's log, a cache file) hit a full or read-only disk
        print(f"nandoctor: error: cannot write {e.filename or 'a file'}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        resume = getattr(e, "resume_command", None)  # a RunInterrupted knows its run directory
        print(
            f"nandoctor: interrupted; the probes recorded so far are kept: continue with `{resume}`"
            if resume
            else "nandoctor: interrupted",
            file=sys.stderr,
        )
        return 128 + getattr(e, "signal", signal.SIGINT)
