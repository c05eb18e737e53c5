"""The user's rows as a `datasets.Dataset`: memory-mapped Arrow, so a file of any size is scanned
without holding its rows in Python lists. A file is converted once into the Hugging Face datasets
cache (HF_DATASETS_CACHE, as `datasets.load_dataset` does for the user's own training) and read from
there afterwards, under a configuration named by the file's content (`datasets` itself keys a local
file by its modification time, so an edit that keeps it, `rsync -t` or `cp -p`, would read the old
rows); a `save_to_disk` directory is mapped as it is."""

from __future__ import annotations

import os
from pathlib import Path

from ..digests import file_digest
from ..errors import NandoctorError

# file suffix -> the `datasets` builder that reads it; compressed files keep their inner suffix
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")

# The kinds of rows nandoctor reads, by the columns that name them (first match wins): already
# tokenized ids; a chat rendered with the tokenizer's chat template; a prompt and its completion; text.
ROW_KINDS = {
    "tokens": ("input_ids",),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
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
    try:
        if path.is_dir():
            rows = _from_disk(path)
        else:
            cache = os.environ.get("HF_DATASETS_CACHE")  # read now, so that a caller can point it elsewhere
            builder, name = builder_of(path), f"sha256-{file_digest(path)[:32]}"
            rows = datasets.load_dataset(builder, name, data_files=str(path), split="train", cache_dir=cache)
    except (DatasetsError, ArrowException, ValueError, OSError) as e:
        raise NandoctorError(f"cannot read data {str(path)!r}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    if len(rows) == 0:
        raise NandoctorError(f"data {str(path)!r} has no rows")
    return rows


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
