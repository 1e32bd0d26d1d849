"""What every endpoint shares: the served model, request -> SamplingParams, outputs -> choices."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from fastapi.responses import Response

from tandem.inference.engine.async_engine import AsyncEngine
from tandem.inference.engine.llm_engine import BASE_WEIGHT_VERSION, SequenceOutput
from tandem.inference.engine.sampling_params import InvalidRequest, SamplingParams
from tandem.inference.errors import APIError
from tandem.inference.protocol import SamplingFields
from tandem.models.byte_tokenizer import BYTE_OF_CHAR

if TYPE_CHECKING:
    from tandem.inference.disaggregated.decode import RemotePrefill

T = TypeVar("T")

_ids = random.Random()  # seeded once from the OS's randomness
"""Draws the ids of requests and answers. `uuid.uuid4` reads the OS's randomness for each one, a system call during
which the event loop lets go of the interpreter lock, and getting it back waits for the engine thread: 0.2-0.35 ms
per id in the server under load (2-3 us alone), twice per request."""


def random_id() -> str:
    """32 random hex digits, as `uuid.uuid4().hex` writes them: unique among requests, not a secret."""
    return f"{_ids.getrandbits(128):032x}"


SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

ON_LOOP_PROMPT_SIZE = 4096
"""Prompts up to this many tokens (or characters) are checked on the event loop: well under a millisecond, less
than the hop to a worker thread and back costs while the engine thread competes for the interpreter lock."""


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` for a prompt of `size` tokens or characters: in a worker thread when it is long (checking or
    tokenizing it takes milliseconds to seconds, and other requests must go on meanwhile), else right here."""
    if size > ON_LOOP_PROMPT_SIZE:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class JSON(Response):
    """A JSON answer encoded by msgspec in one C call: the answers that list every token (ids, logprobs, their
    entries) are built at once when a batch finishes, and FastAPI's path (validate, then serialize) costs more."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


@dataclass
class Choice:
    """One of a request's `n` samples, accumulated from the engine's per-step outputs."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    weight_version: int | None = None
    """The oldest weight version that sampled any of the tokens."""
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    """Per token, [MoE layer][k] expert ids (requests with `return_routed_experts`)."""
    num_draft_tokens: int = 0
    """Drafted tokens verified for this sample (speculative decoding), and of those the accepted ones."""
    num_accepted_tokens: int = 0

    def add(self, out: SequenceOutput) -> None:
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.routed_experts += out.routed_experts
        self.top_logprobs += out.top_logprobs
        self.text += out.text
        self.finish_reason = out.finish_reason
        self.weight_version = out.weight_version
        self.num_draft_tokens, self.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens


class Served:
    """The model behind the API: engine handle, tokenizer, names it answers to, context length."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, model_name: str, max_model_len: int,
                 base_name: str | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.names = {model_name, Path(model_name).name}
        """Requests may name the model as configured or by its folder's basename."""
        self.base_name = base_name
        """The name the base model is served under beside a LoRA policy (`server.base_model_name`); None: not served."""
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.remote_prefill: RemotePrefill | None = None
        """A decode server's prefill servers (prefill/decode disaggregation); None: this server prefills everything."""
        self._token_text: dict[int, str] = {}
        self._token_byte_list: dict[int, list[int]] = {}

    @property
    def served_names(self) -> list[str]:
        """What `/v1/models` lists: the policy, then the base model where it is served."""
        return [self.model_name] + ([self.base_name] if self.base_name is not None else [])

    @property
    def weight_version(self) -> int:
        return self.engine.stats().weight_version

    def answer_version(self, is_base: bool) -> int:
        """The `weight_version` an answer reports: the policy's now, or for the base model `BASE_WEIGHT_VERSION`."""
        return BASE_WEIGHT_VERSION if is_base else self.weight_version

    @property
    def speculates(self) -> bool:
        """Whether the engine drafts tokens (`engine.speculative`)."""
        return self.engine.engine.speculator is not None

    def usage(self, prompt_tokens: int, completion_tokens: int, samples: Iterable[Choice | SequenceOutput]) -> dict:
        """An answer's `usage`; when the engine speculates, `completion_tokens_details` says how many drafted tokens
        the policy accepted and rejected for its samples (each one's `Choice`, or its last output, whose counts run
        over all its steps: OpenAI's fields for predicted outputs, the same idea of tokens proposed ahead and
        checked), which an RL run logs as its drafts' acceptance."""
        out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens}
        if self.speculates:
            counted = [(s.num_draft_tokens, s.num_accepted_tokens) for s in samples]
            drafted, accepted = sum(d for d, _ in counted), sum(a for _, a in counted)
            out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                "rejected_prediction_tokens": drafted - accepted}
        return out

    def answer_model(self, is_base: bool) -> str:
        """The `model` an answer names: the base model's name or the policy's."""
        return self.base_name if is_base else self.model_name

    def is_base(self, name: str | None) -> bool:
        """Whether a request's `model` names the base model (else the policy: its name, or none); an unknown name is
        a 404."""
        if name is not None and name == self.base_name:
            return True
        if name is not None and name not in self.names:
            served = " and ".join(f"`{n}`" for n in self.served_names)
            raise APIError(404, f"The model `{name}` does not exist: this server serves {served}.", "model")
        return False

    def sampling_params(self, body: SamplingFields, max_tokens: int | None, prompt: list[int], num_top_logprobs: int = 0,
                        names: dict[str, str] | None = None) -> SamplingParams:
        """The request's sampling settings, checked against the prompt (a 400 before anything streams).

        `names`: the request's own name of a field the engine names otherwise (`prompt` is `messages` in chat),
        so an error's `param` is what the client sent.
        """
        names = names or {}
        if max_tokens is None:
            if len(prompt) >= self.max_model_len:
                raise APIError(400, f"the prompt has {len(prompt)} tokens, more than fit in the model's context of "
                                    f"{self.max_model_len} tokens with room for a completion", names.get("prompt", "prompt"))
            max_tokens = self.max_model_len - len(prompt)
        try:
            params = body.sampling_params(max_tokens, num_top_logprobs)
            self.engine.check_request(prompt, params)
        except InvalidRequest as err:
            raise APIError(400, str(err), names.get(err.field, err.field)) from None
        return params

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams, n: int, incremental: bool = True,
                     is_base: bool = False) -> AsyncIterator[SequenceOutput]:
        """The engine's outputs for one prompt (`is_base`: the base model's); bad requests become 400s, engine
        failures 500s."""
        request_id = random_id()
        prefilled, taken = None, None
        if self.remote_prefill is not None:  # a decode server: its bytes are held until the engine takes them in
            prefilled, taken = await self.remote_prefill.fetch(prompt_token_ids, params)
        try:
            async with contextlib.aclosing(self.engine.generate(request_id, prompt_token_ids, params, n, incremental,
                                                                prefilled, is_base)) as outputs:
                async for out in outputs:
                    if taken is not None:
                        taken()
                        taken = None
                    yield out
        except ValueError as err:
            raise APIError(400, str(err), getattr(err, "field", None)) from None
        except Exception as err:  # EngineError (a failed step), or the engine refusing the request
            raise APIError(500, f"{type(err).__name__}: {err}") from None
        finally:
            if taken is not None:
                taken()

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                       is_base: bool = False) -> list[Choice]:
        choices = [Choice(i) for i in range(n)]
        async for out in self.stream(prompt_token_ids, params, n, incremental=False, is_base=is_base):
            choices[out.index].add(out)
        return choices

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes: a token that is part of a character has no text of its own.

        Its piece says which bytes: byte-level BPE writes each byte as one character, SentencePiece
        writes a lone byte as `<0xAB>`.
        """
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if match := SENTENCEPIECE_BYTE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if all(char in BYTE_OF_CHAR for char in piece):
            return bytes(BYTE_OF_CHAR[char] for char in piece)
        return text.encode()

    def fill_token_texts(self, vocab_size: int, chunk: int = 4096) -> None:
        """Decode the text of every token id once, ahead of the answers that name them (run in a thread at
        startup): logprobs name every sampled token, and a first decode on the event loop costs microseconds
        per id, which a batch of completions pays all at once when it finishes."""
        for start in range(0, vocab_size, chunk):
            ids = range(start, min(start + chunk, vocab_size))
            self._token_text.update(zip(ids, self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)))

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """`token_text` of each id: a completion's logprobs name every one of its tokens, so the known ones
        cost a dict lookup and no call."""
        known = self._token_text
        return [known[t] if t in known else self.token_text(t) for t in token_ids]

    def token_byte_lists(self, token_ids: list[int]) -> list[list[int]]:
        """`token_bytes` of each id as the list of ints chat logprobs report; one list per id, shared by every
        answer that names the token (answers only serialize it)."""
        known = self._token_byte_list
        return [known[t] if t in known else known.setdefault(t, list(self.token_bytes(t))) for t in token_ids]

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs report it (special tokens included)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
