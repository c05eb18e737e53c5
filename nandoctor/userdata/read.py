"""The user's rows as a `datasets.Dataset`: memory-mapped Arrow, so a file of any size is scanned
without holding its rows in Python lists. A file is converted once into the Hugging Face datasets
cache (HF_DATASETS_CACHE, as `datasets.load_dataset` does for the user's own training) and read from
there afterwards, under a configuration named by the file's content (`datasets` itself keys a local
file by its modification time, so an edit that keeps it, `rsync -t` or `cp -p`, would read the old
rows); a `save_to_disk` directory is mapped as it is."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import json
import lzma
import os
from pathlib import Path

from ..digests import file_digest
from ..errors import NandoctorError

# file suffix -> the `datasets` builder that reads it; compressed files keep their inner suffix
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")

# The kinds of rows nandoctor reads, by the columns that name them (first match wins): already
# tokenized ids; a chat rendered with the tokenizer's chat template; a prompt and its completion;
# Alpaca's instruction (+ optional input) and output, read as a prompt and its completion
# (encode.alpaca_prompt); text.
ROW_KINDS = {
    "tokens": ("input_ids",),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
VALID = (
    "a .jsonl / .json / .parquet / .csv / .txt file (optionally compressed: "
    + " ".join(COMPRESSION)
    + ") or a datasets.save_to_disk directory"
)


def builder_of(path: Path) -> str:
    """The `datasets` builder for a file, from its suffix."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION:
        suffixes = suffixes[:-1]
    if not suffixes or suffixes[-1] not in BUILDERS:
        raise NandoctorError(f"data file {str(path)!r}: cannot tell its format from its name; valid: {VALID}")
    return BUILDERS[suffixes[-1]]


def open_rows(path: str | Path):
    """The rows at `path` as a `datasets.Dataset` (the `train` split, or the only one, of a
    save_to_disk DatasetDict). A path that does not exist, an unknown format, a file `datasets`
    cannot parse or a data set without rows is a NandoctorError."""
    import datasets
    from datasets.exceptions import DatasetsError
    from pyarrow import ArrowException

    datasets.disable_progress_bars()  # the CLI's own lines say what runs
    path = Path(path).expanduser()
    if not path.exists():
        raise NandoctorError(f"data path {str(path)!r} does not exist; valid: {VALID}")
    if path.is_file() and path.stat().st_size == 0:
        raise NandoctorError(f"data {str(path)!r} is an empty file: it has no rows")
    try:
        with _quiet_datasets():
            if path.is_dir():
                rows = _from_disk(path)
            else:
                cache = os.environ.get("HF_DATASETS_CACHE")  # read now, so that a caller can point it elsewhere
                builder, name = builder_of(path), f"sha256-{file_digest(path)[:32]}"
                rows = datasets.load_dataset(builder, name, data_files=str(path), split="train", cache_dir=cache)
    except (DatasetsError, ArrowException, ValueError, OSError, StopIteration) as e:
        # datasets says only "An error occurred while generating the dataset": find the line and its cause
        where = None if path.is_dir() else bad_line(path, builder_of(path))
        raise NandoctorError(f"cannot read data {str(path)!r}: {where or _innermost(e)}") from None
    if len(rows) == 0:
        raise NandoctorError(f"data {str(path)!r} has no rows")
    return rows


@contextlib.contextmanager
def _quiet_datasets():
    """datasets logs a failed file ("Failed to load JSON from file ...", an error) on stderr before it
    raises; the one line nandoctor prints says it instead."""
    from datasets.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _innermost(e: BaseException) -> str:
    """The first line of the deepest cause in an exception's chain (datasets wraps the parser's error)."""
    causes = []
    while e is not None and e not in causes:
        causes.append(e)
        e = e.__cause__ or e.__context__
    for cause in reversed(causes):
        if str(cause).strip():
            return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
    return repr(causes[0]) if causes else "unknown error"


def _open_binary(path: Path):
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    return open(path, "rb")


def bad_line(path: Path, builder: str) -> str | None:
    """Where a text file stops being readable, as "line N: cause" (not UTF-8, not JSON, a JSON line
    that is not an object), or None where every line reads (or the format is binary: Parquet, zst)."""
    if builder not in ("json", "csv", "text") or path.suffix.lower() == ".zst":
        return None
    with _open_binary(path) as f:
        head = f.read(1).lstrip()
        f.seek(0)
        if builder == "json" and head == b"[":  # one JSON document (a list of rows), not JSON Lines
            return _bad_document(f.read())
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                byte = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                return f"line {number} is not UTF-8 text ({byte}); save it as UTF-8"
            if builder != "json" or not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                return f"line {number} is not JSON ({e.msg}, column {e.colno})"
            if not isinstance(value, dict):
                kind = type(value).__name__
                return f"line {number} is a JSON {kind}, not an object (one row per line: {{column: value}})"
    return None


def _bad_document(raw: bytes) -> str | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        return f"line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}); save it as UTF-8"
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return f"line {e.lineno} is not JSON ({e.msg}, column {e.colno})"
    return None


def _from_disk(path: Path):
    import datasets

    if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise NandoctorError(f"data directory {str(path)!r} was not written by save_to_disk; valid: {VALID}")
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        if "train" in saved:
            return saved["train"]
        if len(saved) != 1:
            raise NandoctorError(
                f"data directory {str(path)!r} holds splits {', '.join(saved)} and none is `train`; "
                "save the split to train on"
            )
        return next(iter(saved.values()))
    return saved


def row_kind(columns: list[str], path: str | Path) -> str:
    """Which kind of rows the columns hold (ROW_KINDS), or a NandoctorError naming what is there."""
    for kind, needed in ROW_KINDS.items():
        if all(c in columns for c in needed):
            return kind
    valid = "; ".join(" + ".join(needed) for needed in ROW_KINDS.values())
    raise NandoctorError(f"data {str(path)!r} has columns {', '.join(columns)}; nandoctor reads one of: {valid}")
