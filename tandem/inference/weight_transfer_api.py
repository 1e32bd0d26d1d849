"""vLLM's weight-transfer routes on tandem's server (the broadcast weight transport).

`POST /init_weight_transfer_engine {"init_info"}`, `POST /start_weight_update`,
`POST /update_weights {"update_info"}` (the same route with `{"path"}` reloads a folder:
`admin_api`), `POST /finish_weight_update {"weight_version"}`, `GET /weight_info`. Bodies follow
vLLM's (`tandem.transport.broadcast_types`), so the orchestrator drives both backends alike.
The blocking collectives run in worker threads: the event loop and the engine keep serving.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.inference.errors import APIError
from tandem.inference.serving import Served
from tandem.inference.weight_receiver import ConflictError, WeightReceiver
from tandem.transport.broadcast_types import GroupInitInfo, WeightUpdateInfo

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitWeightTransferRequest(_Body):
    init_info: dict
    """`GroupInitInfo`'s fields: master_address, master_port, rank_offset, world_size."""


class BroadcastUpdateRequest(_Body):
    update_info: dict
    """`WeightUpdateInfo`'s fields: names, dtype_names, shapes, packed, packed_buffer_size_bytes, ..."""


class FinishWeightUpdateRequest(_Body):
    weight_version: str | int | None = None
    """The new policy version (vLLM sends a string); unset = the current one + 1."""


def parse_body(model: type[BaseModel], payload: dict):
    """`payload` as `model`, a bad one answered as FastAPI's own body validation is (a 400 naming the field)."""
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None


def _convert(fields: dict, kind: type, param: str):
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as err:
        raise APIError(400, f"bad `{param}`: {err}", param) from None


async def _guarded(call, *args):
    """Run a blocking receiver call in a thread; out-of-order calls are 409s, bad input 400s."""
    try:
        return await asyncio.to_thread(call, *args)
    except ConflictError as err:
        raise APIError(409, str(err)) from None
    except ValueError as err:
        raise APIError(400, str(err)) from None


def receiver_of(request: Request) -> WeightReceiver:
    return request.app.state.weight_receiver


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitWeightTransferRequest, request: Request) -> dict:
    init = _convert(body.init_info, GroupInitInfo, "init_info")
    await _guarded(receiver_of(request).join, init)
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict:
    await _guarded(receiver_of(request).start)
    return {"message": "Weight update started"}


async def receive_update(body: BroadcastUpdateRequest, request: Request) -> dict:
    """`POST /update_weights` with `update_info`: receive the broadcast (applied at finish)."""
    info = _convert(body.update_info, WeightUpdateInfo, "update_info")
    await _guarded(receiver_of(request).receive, info)
    return {"message": "Weights received"}


@router.post("/finish_weight_update")
async def finish_weight_update(body: FinishWeightUpdateRequest, request: Request) -> dict:
    served: Served = request.app.state.served
    version = None
    if body.weight_version is not None:
        try:
            version = int(body.weight_version)
        except ValueError:
            raise APIError(400, f"`weight_version` must be an integer policy version, got {body.weight_version!r}",
                           "weight_version") from None
    state = await _guarded(receiver_of(request).finish)
    try:
        version = await served.engine.update_weights(state, version)
    except (KeyError, ValueError) as err:
        raise APIError(400, f"the broadcast weights do not fit the model: {err.args[0]}", "update_info") from None
    return {"message": "Weight update finished", "weight_version": version}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    served: Served = request.app.state.served
    return {"weight_version": served.weight_version}
