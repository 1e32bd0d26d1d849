"""Reads what an offline W&B run wrote (`run-<id>.wandb`), so tests check the records themselves.

wandb 0.31 ships no reader in Python: the file is W&B's 7-byte header then a LevelDB-style log (32 KiB
blocks of chunks, each with a 7-byte header: CRC32, little-endian length, type FULL/FIRST/MIDDLE/LAST), each
record a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def offline_runs(run_dir: Path, timeout_s: float = 30.0) -> list[Path]:
    """The offline runs' record files under the run folder, oldest first, each once it is complete: W&B's
    service process may still be writing a file's last records when `finish()` returns."""
    paths = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while not _ends_with_exit(path):
            assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
            time.sleep(0.1)
    return paths


def _ends_with_exit(path: Path) -> bool:
    try:
        found = records(path)
    except Exception:  # a chunk being written
        return False
    return bool(found) and found[-1].WhichOneof("record_type") == "exit"


def history(run_dir: Path) -> list[dict]:
    """Every `run.log` call of every offline run under the run folder, as {key: value}."""
    rows = []
    for path in offline_runs(run_dir):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def summary(run_dir: Path) -> dict:
    values = {}
    for path in offline_runs(run_dir):
        for record in records(path):
            if record.WhichOneof("record_type") == "summary":
                values.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                               for item in record.summary.update})
    return values


def run_ids(run_dir: Path) -> set[str]:
    return {record.run.run_id for path in offline_runs(run_dir) for record in records(path)
            if record.WhichOneof("record_type") == "run"}
