"""What a file or directory holds, as a sha256 of its bytes: the identity that the probe cache, `--resume`
and the datasets cache of the user's rows key on, so that an edit which keeps a file's size and
modification time (`rsync -t`, `cp -p`, an archive unpacked) is still seen. Imports nothing from nandoctor.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

# A digest is remembered for a file (one run fingerprints every probe) only once its modification time is
# this much older than the hashing: a file written again within the file system's timestamp granularity
# keeps its size and time, so a stat alone cannot tell the two versions apart (git's "racy clean" rule).
SETTLED_S = 2.0
_digests: dict[tuple, str] = {}

# A checkpoint's files whose bytes are not hashed, for their size (gigabytes, read at every run otherwise):
# the weights, stamped by name, size and modification time. Every other file (config.json,
# generation_config.json, tokenizer.json, tokenizer.model, tokenizer_config.json, chat_template.jinja,
# special_tokens_map.json, modeling code) is hashed.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def file_digest(path: Path) -> str:
    """sha256 hex of a file's bytes, remembered by its stat while the file is unchanged."""
    st = path.stat()
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _digests:
        return _digests[key]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if time.time() - st.st_mtime > SETTLED_S:
        _digests[key] = digest
    return digest


def content_digest(path: str | Path) -> str:
    """sha256 hex of a file's bytes, or of a directory's files (their relative names and bytes, every
    level), or "missing" for a path that does not exist (whoever reads it reports that)."""
    p = Path(path).expanduser()
    if p.is_file():
        return file_digest(p)
    if not p.is_dir():
        return "missing"
    digest = hashlib.sha256()
    for f in sorted(f for f in p.rglob("*") if f.is_file()):
        digest.update(f"{f.relative_to(p).as_posix()}\0{file_digest(f)}\n".encode())
    return digest.hexdigest()


def checkpoint_stamp(path: str | None) -> list:
    """[(name, size, mtime_ns) of each weight file, (name, sha256) of every other file] of a local
    checkpoint directory's top level (hidden files aside); [] for none."""
    if not path:
        return []
    stamp = []
    for p in sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith(".")):
        if p.suffix in WEIGHT_SUFFIXES:
            stamp.append((p.name, p.stat().st_size, p.stat().st_mtime_ns))
        else:
            stamp.append((p.name, file_digest(p)))
    return stamp
