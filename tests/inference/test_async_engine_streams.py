"""A request's outputs reach its reader on the event loop in order, and a reader that stops (closes the stream, or is
cancelled while it waits) aborts the request without the engine thread's later outputs failing on the loop."""

from __future__ import annotations

import asyncio
import time

from test_engine import engine_for, run

from tandem.inference.engine.async_engine import AsyncEngine
from tandem.inference.engine.sampling_params import SamplingParams

PROMPT = [(7 * j) % 200 + 3 for j in range(20)]
PARAMS = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)


def serving(tiny_dir, check) -> list:
    """Run `check(engine)` on an event loop beside a started engine; the loop's unhandled errors."""
    engine = AsyncEngine(engine_for(tiny_dir))
    engine.start()
    errors = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        await check(engine)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return errors


async def until_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 60
    while engine.engine.has_unfinished or engine._streams:
        assert time.monotonic() < deadline, "the request was not aborted"
        await asyncio.sleep(0.01)


def test_outputs_arrive_in_order_as_the_engine_alone_makes_them(tiny_dir):
    """Also for a reader slower than the engine: several steps' outputs wait for it in its queue."""
    alone = engine_for(tiny_dir)
    alone.add_request("r", PROMPT, PARAMS, incremental=True)
    expected = run(alone)[("r", 0)]

    async def check(engine):
        outputs = engine.generate("r", PROMPT, PARAMS, 1, incremental=True)
        got = []
        try:
            async for out in outputs:
                got.append(out)
                if len(got) in (1, 5):
                    time.sleep(0.2)  # the loop busy: the engine's next outputs queue up behind it
        finally:
            await outputs.aclose()
        assert [t for out in got for t in out.token_ids] == expected["ids"]
        assert [out.finish_reason for out in got] == [None] * (len(got) - 1) + ["length"]

    assert serving(tiny_dir, check) == []


def test_a_reader_that_stops_aborts_its_request(tiny_dir):
    async def check(engine):
        closed = engine.generate("closed", PROMPT, PARAMS, 1, incremental=True)
        assert (await anext(closed)).token_ids
        await closed.aclose()

        async def read(stream):
            async for _ in stream:
                pass

        cancelled = asyncio.create_task(read(engine.generate("cancelled", PROMPT, PARAMS, 1, incremental=True)))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        await until_idle(engine)
        await asyncio.sleep(0.05)  # outputs already on their way to the loop land on the stopped readers' queues

    assert serving(tiny_dir, check) == []
