"""Tables of launch choices tuned on one GPU: one JSON file per GPU name, entries by shape and token count.

Why one mechanism: the best tiles of a Triton product (and whether another implementation beats it) depend on
the GPU, the shape and the rows a call multiplies, so a benchmark times them on the GPU and writes a table; the
MoE experts' tiles (`tandem.kernels.moe_tiles`) and the dense FP8 product's (`tandem.kernels.fp8_tiles`) are
such tables, read the same way:

    {"device": "<GPU name>", "shapes": {"<shape key>": [{"num_tokens": 256, ...}, ...]}}

A call of T tokens takes the entry of the smallest tuned count >= T (the largest past the end). A table ships
with tandem as `<folder>/<GPU name>.json` (`shipped_table_path`); a config key may name another file.

Tests: `tests/kernels/test_moe_kernels.py`, `tests/kernels/test_fp8_tiles.py`.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Callable


def shipped_table_path(folder: Path, device_name: str) -> Path:
    """Where the table of a GPU named `device_name` ships in `folder` (it may not exist)."""
    return folder / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def load_entries(path: Path, key: str, check: Callable[[dict], dict], source: str, what: str, writer: str) -> list[dict]:
    """The entries of shape `key` in the table at `path`, each passed through `check` (which raises ValueError,
    KeyError or TypeError on a bad one), sorted by token count; a shape the table lacks: none. Errors name
    `source` (a config key, or the shipped table), the path, `what` the file should be and the `writer` of one."""
    try:
        table = json.loads(Path(path).read_text())
        entries = [check(entry) for entry in table["shapes"].get(key, [])]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{source} = {str(path)!r}: not a {what} ({type(err).__name__}: {err}); "
                         f"write one with {writer}") from err
    return sorted(entries, key=lambda e: e["num_tokens"])


def entry_for(entries: list[dict], num_tokens: int) -> dict:
    """The entry (of `entries`, sorted by token count, not empty) that a call of `num_tokens` tokens takes."""
    counts = [e["num_tokens"] for e in entries]
    return entries[min(bisect.bisect_left(counts, num_tokens), len(entries) - 1)]


def variant_token_counts(counts: list[int], max_tokens: int) -> list[int]:
    """One token count (at most `max_tokens`) per entry that calls of 1 to `max_tokens` tokens take, given the
    entries' sorted `counts`: those below `max_tokens`, and `max_tokens` for the first one that holds it."""
    chosen = [c for c in counts if c < max_tokens] + ([max_tokens] if counts[-1] >= max_tokens else [])
    return sorted({max(1, min(c, max_tokens)) for c in chosen})
