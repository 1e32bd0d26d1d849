"""SFT data: local JSONL/Parquet rows -> tokenized samples with loss masks -> packed rows per step.

Row formats:
- `messages`: a chat, rendered with the tokenizer's chat template. The loss tokens of message i
  (when its role is in `loss_roles`) are the tokens between the rendering of messages[:i] and
  that of messages[:i+1]; for an assistant message the prefix is rendered with the generation
  prompt, so the `<|im_start|>assistant\\n` header is not a loss token, and the closing
  `<|im_end|>` is. Each prefix must tokenize to a prefix of the whole chat, or the row is refused.
- `prompt` / `completion`: strings; the loss tokens are the completion's, followed by EOS.

Samples are packed first-fit-decreasing into rows of at most `seq_len` tokens (positions restart
at each sample, so attention never crosses samples). Epoch e's rows are a function of (seed, e),
and step n takes rows [(n-1) R, n R) of the epochs laid end to end: the data position of a
checkpoint is the step, and a resumed run (at any world size) sees exactly the same rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.models.chat import ChatTemplateError, render_chat_text
from tandem.transport.row_packing import first_fit_decreasing
from tandem.transport.types import PackedRow


class SFTDataError(ValueError):
    """Bad SFT data; the message names the file and row."""


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]


def read_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` (one JSON object a line) or `.parquet` file."""
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"SFT data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise SFTDataError(f"{path}: unknown data format {path.suffix!r}; use .jsonl or .parquet")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SFTDataError(f"{path}:{n}: invalid JSON: {err}") from None
        if not isinstance(record, dict):
            raise SFTDataError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    if not records:
        raise SFTDataError(f"{path}: no rows")
    return records


ENCODE_CHUNK = 1024
"""Rows whose texts are tokenized in one call of the tokenizer: transformers' cost per call is paid once a chunk,
not once a text (timings: `benchmarks/RESULTS.md`)."""


@dataclass
class _RowTexts:
    """The texts a row needs tokenized, and how to make its sample from their ids (in the same order)."""

    texts: list[str]
    sample: Callable[[list[list[int]]], Sample]


def tokenize_record(record: dict[str, Any], tokenizer, loss_roles: list[str], where: str) -> Sample:
    return tokenize_records([(record, where)], tokenizer, loss_roles)[0]


def tokenize_records(records: list[tuple[dict[str, Any], str]], tokenizer, loss_roles: list[str]) -> list[Sample]:
    """The sample of each (record, where it came from): every text of the rows rendered first, then all of them
    tokenized in one call, as `tokenizer.encode(text, add_special_tokens=False)` tokenizes one."""
    rows = [_row_texts(record, tokenizer, loss_roles, where) for record, where in records]
    texts = [text for row in rows for text in row.texts]
    ids = iter(encode_texts(tokenizer, texts) if texts else [])
    return [row.sample([list(next(ids)) for _ in row.texts]) for row in rows]


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, as `tokenizer.encode(text, add_special_tokens=False)` gives them. A tokenizer over a
    `tokenizers` backend hands the batch to it directly: transformers' own batch call wraps the same ids in attention
    masks and a `BatchEncoding`, a large share of the tokenizing's CPU (timings: `benchmarks/RESULTS.md`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or backend.truncation or backend.padding  # settings transformers' call resets before encoding
            or backend.encode_special_tokens != getattr(tokenizer, "split_special_tokens", False)):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def _row_texts(record: dict[str, Any], tokenizer, loss_roles: list[str], where: str) -> _RowTexts:
    if "messages" in record:
        return _chat_texts(record["messages"], record.get("tools"), tokenizer, loss_roles, where)
    if "prompt" in record and "completion" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["completion"], str):
            raise SFTDataError(f"{where}: `prompt` and `completion` must be strings")
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

        def sample(encoded: list[list[int]]) -> Sample:
            p, c = encoded[0], encoded[1] + eos
            return Sample(p + c, [0] * len(p) + [1] * len(c))
        return _RowTexts([record["prompt"], record["completion"]], sample)
    raise SFTDataError(f"{where}: a row needs `messages`, or `prompt` and `completion` (keys: {sorted(record)})")


def _chat_texts(messages: Any, tools: list[dict] | None, tokenizer, loss_roles: list[str], where: str) -> _RowTexts:
    """`tools`: the row's tool schemas, rendered as RL prompts render them (the same `render_chat_text`), so a
    warm-up on tool-use demonstrations sees the tool list its RL prompts will carry."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise SFTDataError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")

    texts: list[str] = []

    def render(msgs: list[dict], generation_prompt: bool) -> int:
        """The index of the rendering among the row's texts."""
        try:
            texts.append(render_chat_text(tokenizer, msgs, tools, add_generation_prompt=generation_prompt))
        except ChatTemplateError as err:
            raise SFTDataError(f"{where}: {err}") from None
        return len(texts) - 1

    render(messages, False)
    spans = []  # (message, its prefix's text or None for the first message, the text it ends)
    for i, message in enumerate(messages):
        if message["role"] in loss_roles:
            start = render(messages[:i], message["role"] == "assistant") if i else None
            end = 0 if i == len(messages) - 1 else render(messages[: i + 1], False)  # the last one ends the chat
            spans.append((i, start, end))

    def sample(encoded: list[list[int]]) -> Sample:
        ids = encoded[0]
        mask = [0] * len(ids)
        for i, start, end in spans:
            start_ids, end_ids = (encoded[start] if start is not None else []), encoded[end]
            if ids[: len(start_ids)] != start_ids or ids[: len(end_ids)] != end_ids:
                raise SFTDataError(f"{where}: the chat template does not render message {i}'s prefix as a prefix of the chat, "
                                   "so its loss tokens cannot be located (a template that rewrites earlier turns?)")
            mask[len(start_ids): len(end_ids)] = [1] * (len(end_ids) - len(start_ids))
        return Sample(ids, mask)
    return _RowTexts(texts, sample)


def load_samples(path: Path, tokenizer, loss_roles: list[str], seq_len: int,
                 progress: Callable[[int, int], None] | None = None) -> tuple[list[Sample], dict[str, int]]:
    """Tokenized samples cut to `seq_len` tokens; samples left without loss tokens are dropped. Returns counts too.

    `progress(rows done, rows)` is called before each chunk of rows and once all are done."""
    samples, counts = [], {"rows": 0, "truncated": 0, "dropped_no_loss_tokens": 0}
    records = [(record, f"{path}: row {n}") for n, record in enumerate(read_records(path), 1)]
    for chunk in range(0, len(records), ENCODE_CHUNK):
        if progress:
            progress(chunk, len(records))
        for sample in tokenize_records(records[chunk: chunk + ENCODE_CHUNK], tokenizer, loss_roles):
            counts["rows"] += 1
            if len(sample.input_ids) > seq_len:
                counts["truncated"] += 1
                sample = Sample(sample.input_ids[:seq_len], sample.loss_mask[:seq_len])
            sample.loss_mask[0] = 0  # nothing predicts a sample's first token
            if len(sample.input_ids) < 2 or not any(sample.loss_mask):
                counts["dropped_no_loss_tokens"] += 1
                continue
            samples.append(sample)
    if progress:
        progress(len(records), len(records))
    if not samples:
        raise SFTDataError(f"{path}: no row has loss tokens for roles {loss_roles}")
    return samples, counts


def split_eval(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, eval): a seeded random `fraction` of the samples held out (at least one)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(samples) * fraction))
    if n_eval >= len(samples):
        raise SFTDataError(f"`data.eval_fraction` = {fraction} leaves no training samples out of {len(samples)}")
    held = set(order[:n_eval])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def pack(samples: list[Sample], seq_len: int) -> list[PackedRow]:
    """First-fit-decreasing packing into rows of at most `seq_len` tokens (stable for equal lengths)."""
    return [_row([samples[i] for i in b]) for b in first_fit_decreasing([len(s.input_ids) for s in samples], seq_len)]


def _row(samples: list[Sample]) -> PackedRow:
    ids, pos, mask = [], [], []
    for s in samples:
        ids += s.input_ids
        pos += list(range(len(s.input_ids)))
        mask += s.loss_mask
    n = len(ids)
    return PackedRow(ids, pos, mask, [0.0] * n, [0.0] * n, [1.0] * n)


def padding_row(pad_id: int) -> PackedRow:
    """A row without loss tokens, for ranks that have fewer eval rows than others."""
    return PackedRow([pad_id, pad_id], [0, 1], [0, 0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0])


class StepRows:
    """The packed rows of each training step, as a function of the step alone.

    Every epoch has the same number of rows: first-fit-decreasing sees the same sorted lengths
    whatever the shuffle, so row g of the run is row g % n of epoch g // n.
    """

    def __init__(self, samples: list[Sample], seq_len: int, rows_per_step: int, shuffle: bool, seed: int):
        self.samples, self.seq_len, self.rows_per_step, self.shuffle, self.seed = samples, seq_len, rows_per_step, shuffle, seed
        self._cached: tuple[int, list[PackedRow]] | None = None
        self.rows_per_epoch = len(self.epoch_rows(0))

    def epoch_rows(self, epoch: int) -> list[PackedRow]:
        if self._cached is None or self._cached[0] != epoch:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            samples = list(self.samples)
            if self.shuffle:
                rng.shuffle(samples)
            rows = pack(samples, self.seq_len)
            if self.shuffle:
                rng.shuffle(rows)
            self._cached = (epoch, rows)
        return self._cached[1]

    def rows_for(self, step: int, rank: int, world_size: int) -> tuple[list[PackedRow], float]:
        """This rank's rows of `step` (1-indexed), and the epochs done at the end of the step."""
        if self.rows_per_step % world_size:
            raise SFTDataError(f"`data.rows_per_step` = {self.rows_per_step} is not a multiple of the world size {world_size}")
        per_rank = self.rows_per_step // world_size
        first = (step - 1) * self.rows_per_step + rank * per_rank
        rows = []
        for g in range(first, first + per_rank):
            epoch, index = divmod(g, self.rows_per_epoch)
            rows.append(self.epoch_rows(epoch)[index])
        return rows, step * self.rows_per_step / self.rows_per_epoch
