"""Atomic file writes: readers in other processes see the old file or the new one, never half."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write to a hidden tmp file in the same folder, fsync, then rename over `path`. `mode`: the file's
    permissions (less the umask) from its creation on (0o600: a file holding a secret is never readable by others)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str, mode: int = 0o666) -> None:
    atomic_write_bytes(path, text.encode(), mode)
