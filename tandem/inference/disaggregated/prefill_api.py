"""The prefill server's routes: compute a decode server's prompt, hold its KV, hand it over.

`POST /prefill` runs the prompt through the engine as a prefill-only request (batched with every other prompt
the engine runs) and answers with what it holds; the decode server then takes the tensors through its KV
transport: `GET /kv/{transfer_id}` (`http_body`), `POST /kv/{transfer_id}/send` after `POST /kv/pairs` at its
start (`torch_distributed`), or `POST /kv/{transfer_id}/stage` after `POST /kv/areas` at its start
(`shared_memory`). A request for another policy version than this server holds is refused (409)
before any work, and again if an update landed while the prompt ran; one whose KV would take the prompts held here
past `disaggregation.max_held_mib` is refused before any work: for now (429) while others are held, for good (400)
where its KV alone passes it (`held`).
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from tandem.config.inference import DisaggregationConfig
from tandem.inference.disaggregated.held import HeldPrefills, LargerThanBudget, OverBudget
from tandem.inference.disaggregated.http_body import encode
from tandem.inference.disaggregated.kv_transport import CopyStream
from tandem.inference.disaggregated.shared_memory import StagingAreas
from tandem.inference.disaggregated.torch_distributed import PairGroups
from tandem.inference.disaggregated.wire import (AreaRequest, PairRequest, PrefillAnswer, PrefillInfo, PrefillRequest,
                                                 SendRequest, StageRequest, TensorSpec)
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.errors import APIError, error_responses
from tandem.inference.serving import JSON, Served, random_id

router = APIRouter()


def install_prefill_routes(app: FastAPI, config: DisaggregationConfig, responses: dict) -> None:
    """Make `app` a prefill server's (its own state: held prompts, pair groups)."""
    served: Served = app.state.served
    app.state.held_prefills = HeldPrefills(config.hold_timeout_s, max_held_bytes(served, config))
    app.state.send_copies = CopyStream(served.engine.engine.device)
    app.state.kv_pairs = PairGroups(served.engine.engine.device, config.peer_timeout_s)
    app.state.staging_areas = StagingAreas(served.engine.engine.device, int(config.staging_mib * 2**20))
    app.state.closers += [app.state.kv_pairs.close, app.state.staging_areas.close]
    app.include_router(router, responses=responses)


def max_held_bytes(served: Served, config: DisaggregationConfig) -> int:
    """`disaggregation.max_held_mib`, or the engine's KV cache size where it is None."""
    if config.max_held_mib is not None:
        return int(config.max_held_mib * 2**20)
    engine = served.engine.engine
    return engine.kv_bytes(engine.block_manager.num_blocks)


def export_bytes(served: Served, body: PrefillRequest) -> int:
    """About what the prompt's export will take: its KV blocks from `first_block` on (the logits row aside)."""
    engine = served.engine.engine
    return engine.kv_bytes(max(engine.block_manager.num_blocks_for(len(body.prompt_token_ids)) - body.first_block, 0))


@router.get("/prefill/info")
async def prefill_info(request: Request) -> JSON:
    served: Served = request.app.state.served
    engine = served.engine.engine
    return JSON(PrefillInfo(served.model_name, engine.block_manager.block_size, engine.runner.cache.layout,
                            served.weight_version))


@router.post("/prefill", responses=error_responses(400, 409, 429))
async def prefill(body: PrefillRequest, request: Request) -> JSON:
    served: Served = request.app.state.served
    held: HeldPrefills = request.app.state.held_prefills
    _check_version(served.weight_version, body.weight_version)
    try:
        served.engine.check_request(body.prompt_token_ids, SamplingParams(max_tokens=1))
    except ValueError as err:
        raise APIError(400, str(err), "prompt_token_ids") from None
    try:
        with held.reserve(export_bytes(served, body)):
            prefilled = await served.engine.prefill(random_id(), body.prompt_token_ids, body.first_block)
    except OverBudget as err:
        raise APIError(429, str(err), "prompt_token_ids") from None
    except LargerThanBudget as err:
        raise APIError(400, str(err), "prompt_token_ids") from None
    _check_version(prefilled.weight_version, body.weight_version)
    if prefilled.ready is not None:  # held tensors are whole: the transports copy them on streams of their own
        await asyncio.to_thread(prefilled.ready.synchronize)
    tensors = [prefilled.kv_blocks, prefilled.logits] + ([prefilled.draft_state] if prefilled.draft_state is not None else [])
    transfer_id = held.put(tensors)
    return JSON(PrefillAnswer(transfer_id, prefilled.weight_version, prefilled.first_block,
                              [TensorSpec.of(t) for t in tensors]))


@router.get("/kv/{transfer_id}", responses=error_responses(404))
async def kv_body(transfer_id: str, request: Request) -> Response:
    tensors = _take(request, transfer_id)
    return Response(await asyncio.to_thread(encode, tensors, request.app.state.send_copies),
                    media_type="application/octet-stream")


@router.post("/kv/pairs")
async def open_pair(request: Request) -> JSON:
    body = msgspec.json.decode(await request.body(), type=PairRequest)
    return JSON(await asyncio.to_thread(request.app.state.kv_pairs.open, body))


@router.post("/kv/{transfer_id}/send", responses=error_responses(404, 409))
async def send(transfer_id: str, request: Request) -> JSON:
    body = msgspec.json.decode(await request.body(), type=SendRequest)
    pairs: PairGroups = request.app.state.kv_pairs
    _check_opened(pairs.groups, body.pair_id, "pair_id", "KV pair group", "/kv/pairs")
    pairs.send(body, _take(request, transfer_id))
    return JSON({"sending": transfer_id})


@router.post("/kv/areas")
async def open_area(request: Request) -> JSON:
    body = msgspec.json.decode(await request.body(), type=AreaRequest)
    return JSON(await asyncio.to_thread(request.app.state.staging_areas.open, body))


@router.delete("/kv/areas/{area_id}")
async def drop_area(area_id: str, request: Request) -> JSON:
    request.app.state.staging_areas.drop(area_id)
    return JSON({"dropped": area_id})


@router.post("/kv/{transfer_id}/stage", responses=error_responses(404, 409))
async def stage(transfer_id: str, request: Request) -> JSON:
    body = msgspec.json.decode(await request.body(), type=StageRequest)
    areas: StagingAreas = request.app.state.staging_areas
    _check_opened(areas.areas, body.area_id, "area_id", "KV staging area", "/kv/areas")
    tensors = _take(request, transfer_id) if body.start == 0 else None
    try:
        return JSON(await asyncio.to_thread(areas.stage, body, transfer_id, tensors))
    except LookupError as err:
        raise APIError(409, str(err), "transfer_id") from None


def _check_opened(opened: dict, key: str, field: str, what: str, route: str) -> None:
    """A decode server's pair or area is made by its own request at start-up (409 otherwise: a restarted prefill
    server has none)."""
    if key not in opened:
        raise APIError(409, f"no {what} {key!r} here: ask `POST {route}` first", field)


def _take(request: Request, transfer_id: str) -> list:
    tensors = request.app.state.held_prefills.take(transfer_id)
    if tensors is None:
        raise APIError(404, f"no prefilled prompt {transfer_id!r} is held here (taken, or dropped after "
                            "`disaggregation.hold_timeout_s`)", "transfer_id")
    return tensors


def _check_version(held: int, asked: int) -> None:
    if held != asked:
        raise APIError(409, f"this prefill server holds policy version {held}, not {asked}", "weight_version")

