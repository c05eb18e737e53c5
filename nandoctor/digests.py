"""What a file or directory holds, as a hash of its bytes: the identity that the probe cache, `--resume`
and the datasets cache of the user's rows key on, so that an edit which keeps a file's size and
modification time (`rsync -t`, `cp -p`, an archive unpacked, a weights file swapped for another of the
same size) is still seen. Imports nothing from nandoctor.
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

# A checkpoint's weight files (gigabytes, read once a run): hashed with xxh3-128, not sha256. It tells an
# edit from the file before it as well (nothing here defends against a file made to collide) at 3-4x the
# speed: on a shared 2-core EPYC a 2 GB file in the page cache hashed at 1.6-4.3 GB/s against sha256's
# 0.5-1.0 GB/s (12.5 against 1.2 GB/s in memory), so a 16 GB checkpoint costs 4-10 s a run once cached,
# the disk's read time when not. Every other file (config.json, generation_config.json, tokenizer files,
# chat_template.jinja, modeling code) is sha256.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
FAST = "xxh3_128"
CHUNK = 8 << 20


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file's bytes (sha256, or FAST: xxh3-128), remembered by its stat while the file
    is unchanged."""
    st = path.stat()
    key = (str(path), algorithm, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _digests:
        return _digests[key]
    with open(path, "rb") as f:
        if algorithm == FAST:
            import xxhash

            h, buf = xxhash.xxh3_128(), bytearray(CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            digest = h.hexdigest()
        else:
            digest = hashlib.file_digest(f, algorithm).hexdigest()
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
    """[(name, "xxh3_128:" digest) of each weight file, (name, sha256) of every other file] of a local
    checkpoint directory's top level (hidden files aside); [] for none."""
    if not path:
        return []
    stamp = []
    for p in sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith(".")):
        if p.suffix in WEIGHT_SUFFIXES:
            stamp.append((p.name, f"{FAST}:{file_digest(p, FAST)}"))
        else:
            stamp.append((p.name, file_digest(p)))
    return stamp
