"""Run an `LLMEngine` in a background thread and talk to it from asyncio.

Invariants:
- only the engine thread touches the `LLMEngine` (except `check_request` and `stats`, which
  read settings and counters); everything else reaches it as a command, applied between steps;
- so a weight update lands between two steps: tokens sampled before it keep their old-weight
  logprobs, tokens after it get new ones; `pause()` returns once no step will start until `resume()`;
- every output of a step reaches its request's `OutputQueue`, in order, through one
  `call_soon_threadsafe` per event loop and step;
- a failing step fails the requests it held (`EngineError`) and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import torch

from tandem.inference.engine.llm_engine import EngineStats, LLMEngine, SequenceOutput
from tandem.inference.engine.prefilled import PrefilledPrompt
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.models.lora import LoraSpec

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request; the request fails, the server keeps serving."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputQueue]] = {}
        self._paused = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    @property
    def is_paused(self) -> bool:
        return self._paused

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the engine cannot run this request (from any thread)."""
        self.engine.check_request(prompt_token_ids, params)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int = 1,
                 incremental: bool = True, prefilled: PrefilledPrompt | None = None,
                 is_base: bool = False) -> AsyncGenerator[SequenceOutput, None]:
        """The outputs of the request's `n` sequences until all finish; the request starts at the first `anext`,
        and closing the stream (`aclose`, which its caller owes it) aborts what did not finish.

        `incremental`: one output per token; else one per sequence, holding its whole completion.
        `prefilled`: the prompt as a prefill server computed it (`LLMEngine.add_prefilled`); where the engine
        cannot continue from it, it prefills the prompt itself.
        `is_base`: sampled from the base model served beside a LoRA policy (`LLMEngine.add_request`).

        A request the engine cannot run raises ValueError here, before anything is queued. No generator of its own
        around the outputs' queue: every layer costs the event loop a resumption per token.
        """
        self.check_request(prompt_token_ids, params)
        return self._outputs(request_id, n, lambda: self._add(request_id, prompt_token_ids, params, n, incremental,
                                                              prefilled, is_base))

    async def prefill(self, request_id: str, prompt_token_ids: list[int], first_block: int = 0) -> PrefilledPrompt:
        """The prompt's KV blocks (from `first_block` on) and last logits row, computed and not sampled
        (`LLMEngine.add_prefill`: a prefill server)."""
        outputs = self._outputs(request_id, 1, lambda: self._add_prefill(request_id, prompt_token_ids, first_block))
        try:
            async for out in outputs:
                assert out.prefilled is not None, "a prefill-only request sampled a token"
                return out.prefilled
        finally:
            await outputs.aclose()
        raise AssertionError("a prefill-only request ended without its result")

    async def _outputs(self, request_id: str, n: int, add: Callable[[], None]) -> AsyncIterator[SequenceOutput]:
        """The outputs of the request that `add` queues (on the engine thread) until its `n` sequences finish."""
        loop = asyncio.get_running_loop()
        stream = OutputQueue()
        self._streams[request_id] = (loop, stream)
        self._send(add)
        items = stream.items
        num_finished = 0
        try:
            while num_finished < n:
                if not items:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                item = items.popleft()
                if isinstance(item, BaseException):
                    raise item
                num_finished += item.finish_reason is not None
                yield item
        finally:
            self._streams.pop(request_id, None)
            if num_finished < n:
                self._send(lambda: self.engine.abort_request(request_id))

    async def update_weights(self, state: dict[str, torch.Tensor], version: int | None = None,
                             lora: LoraSpec | None = None) -> int:
        return await self._call(lambda: self.engine.update_weights(state, version, lora))

    async def pause(self) -> None:
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "_paused", False))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int, incremental: bool,
             prefilled: PrefilledPrompt | None, is_base: bool) -> None:
        try:
            if prefilled is not None:
                self.engine.add_prefilled(request_id, prompt_token_ids, params, n, incremental, prefilled)
            else:
                self.engine.add_request(request_id, prompt_token_ids, params, n, incremental, is_base)
        except Exception as err:  # the request fails, not the engine
            self._deliver_error(request_id, err)

    def _add_prefill(self, request_id: str, prompt_token_ids: list[int], first_block: int) -> None:
        try:
            self.engine.add_prefill(request_id, prompt_token_ids, first_block)
        except Exception as err:  # the request fails, not the engine
            self._deliver_error(request_id, err)

    def _send(self, fn: Callable[[], Any], future: concurrent.futures.Future | None = None) -> None:
        self._commands.put((fn, future))
        self._wakeup.set()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return its result (or raise its error)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(fn, future)
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            idle = self._paused or not self.engine.has_unfinished
            try:
                # Paused: the tokens of the step in flight still reach their requests.
                outputs = self.engine.flush() if idle else self.engine.step()
            except Exception as err:  # a model or kernel failure must not take the server down
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(err)
                continue
            self._deliver(outputs)
            if idle:
                self._wakeup.wait()
                self._wakeup.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except Exception as err:
                if future is None:
                    log.exception("engine command failed")
                else:
                    future.set_exception(err)
                continue
            if future is not None:
                future.set_result(result)

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputQueue, Any]]] = defaultdict(list)
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                by_loop[entry[0]].append((entry[1], out))
        for loop, items in by_loop.items():
            self._deliver_items(loop, items)

    def _deliver_error(self, request_id: str, err: BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            self._deliver_items(entry[0], [(entry[1], err)])

    def _deliver_items(self, loop: asyncio.AbstractEventLoop, items: list[tuple[OutputQueue, Any]]) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop closed: nobody is listening any more
            pass

    def _fail_all(self, err: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver_error(request_id, EngineError(f"the engine failed: {err}"))


class OutputQueue:
    """One request's outputs on its event loop, waiting to be read: `asyncio.Queue` less its bounds and its
    waiters' bookkeeping, which the event loop would do at every token. One reader, which waits on `waiter`
    while `items` is empty."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[SequenceOutput | BaseException] = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item: SequenceOutput | BaseException) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():  # done: woken already, or its reader cancelled
            self.waiter.set_result(None)


def _put_all(items: list[tuple[OutputQueue, Any]]) -> None:
    for stream, item in items:
        stream.put(item)
