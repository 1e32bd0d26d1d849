"""vLLM's weight-transfer routes on tandem's server (the broadcast weight transport).

`POST /init_weight_transfer_engine {"init_info"}`, `POST /start_weight_update`,
`POST /update_weights {"update_info"}` (the same route with `{"path"}` reloads a folder:
`admin_api`), `POST /finish_weight_update {"weight_version"}`, `GET /weight_info`. Bodies follow
vLLM's (`tandem.transport.broadcast_types`), so the orchestrator drives both backends alike.
The blocking collectives run in worker threads: the event loop and the engine keep serving.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from tandem.inference.errors import APIError, error_responses
from tandem.inference.protocol import BroadcastUpdateRequest, FinishWeightUpdateRequest, InitWeightTransferRequest
from tandem.inference.serving import Served
from tandem.inference.weight_receiver import ConflictError, WeightReceiver
from tandem.transport.broadcast_types import GroupInitInfo, WeightUpdateInfo

router = APIRouter()


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


@router.post("/init_weight_transfer_engine", responses=error_responses(400, 409, 413))
async def init_weight_transfer_engine(body: InitWeightTransferRequest, request: Request) -> dict:
    init = GroupInitInfo(**body.init_info.model_dump())
    await _guarded(receiver_of(request).join, init)
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update", responses=error_responses(409))
async def start_weight_update(request: Request) -> dict:
    await _guarded(receiver_of(request).start)
    return {"message": "Weight update started"}


async def receive_update(body: BroadcastUpdateRequest, request: Request) -> dict:
    """`POST /update_weights` with `update_info`: receive the broadcast (applied at finish)."""
    info = WeightUpdateInfo(**body.update_info.model_dump())
    await _guarded(receiver_of(request).receive, info)
    return {"message": "Weights received"}


@router.post("/finish_weight_update", responses=error_responses(400, 409, 413))
async def finish_weight_update(body: FinishWeightUpdateRequest, request: Request) -> dict:
    served: Served = request.app.state.served
    version = None if body.weight_version is None else int(body.weight_version)
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
