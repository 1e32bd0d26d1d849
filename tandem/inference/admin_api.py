"""Routes around generation: health, model list, live weight updates, pause/resume, metrics.

`POST /update_weights` reads the folder off the event loop, then hands the tensors to the engine
thread, which swaps them in between two steps. Every name and shape is checked before the first
copy, so a failed update leaves the previous weights serving.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse

from tandem.inference.errors import APIError, error_responses
from tandem.inference.metrics import render_metrics
from tandem.inference.protocol import BroadcastUpdateRequest, UpdateWeightsBody
from tandem.inference.serving import Served
from tandem.inference.weight_transfer_api import receive_update
from tandem.models.lora import LoraSpec, is_adapter_folder, read_adapter_folder
from tandem.models.multi_token import num_left_out_layers
from tandem.models.weights import load_state_dict

public = APIRouter()
"""Routes served without the API key (`api_key.OPEN_PATHS`), so their operations declare no 401."""
router = APIRouter()


@public.get("/health")
async def health() -> dict:
    # The app starts serving only once the model is loaded, so answering at all means ready.
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    served: Served = request.app.state.served
    return {"object": "list", "data": [{"id": name, "object": "model", "created": served.created, "owned_by": "tandem",
                                        "max_model_len": served.max_model_len} for name in served.served_names]}


@router.post("/update_weights", responses=error_responses(400, 404, 409, 413))
async def update_weights(body: UpdateWeightsBody, request: Request) -> dict:
    """`{"path"}`: reload a folder (the filesystem weight transport). `{"update_info"}`: receive
    the broadcast weight transport's tensors, as vLLM's route of the same name does (409 outside an update)."""
    if isinstance(body, BroadcastUpdateRequest):
        return await receive_update(body, request)
    served: Served = request.app.state.served
    folder = Path(body.path)
    if not folder.is_dir():
        raise APIError(404, f"weights folder not found: {body.path}", "path")
    try:
        state, spec = await asyncio.to_thread(read_update_folder, folder, served.engine.engine.weight_target)
    except FileNotFoundError as err:  # a folder without weights: what the request names is not there
        raise APIError(404, f"could not read weights from {body.path}: {err}", "path") from None
    except Exception as err:  # unreadable safetensors: the caller's folder is at fault
        raise APIError(400, f"could not read weights from {body.path}: {err}", "path") from None
    try:
        version = await served.engine.update_weights(state, body.version, spec)
    except (KeyError, ValueError) as err:
        raise APIError(400, f"weights in {body.path} do not fit the model: {err.args[0]}", "path") from None
    if served.remote_prefill is not None:  # a decode server: its prefill servers follow (disaggregation)
        await served.remote_prefill.peers.forward_update(body.path, version)
    return {"weight_version": version}


def read_update_folder(folder: Path, lm: torch.nn.Module) -> tuple[dict[str, torch.Tensor], LoraSpec | None]:
    """A policy folder's tensors for the engine's model `lm`: a model's weights (none of the MTP layers `lm` was
    built without, which it would pass over: `multi_token.without_left_out_layers`), or a PEFT LoRA adapter folder's
    adapters with their spec."""
    if is_adapter_folder(folder):
        spec, state = read_adapter_folder(folder)
        return state, spec
    return load_state_dict(folder, keep_mtp=num_left_out_layers(lm) == 0), None


@router.post("/pause", responses=error_responses(400))
async def pause(request: Request, mode: Annotated[Literal["keep"], Query(
        description="vLLM's pause mode; tandem knows only `keep`: in-flight requests wait, none is lost")] = "keep") -> dict:
    """Stop stepping (after the step in flight); requests keep queueing until `/resume`."""
    await request.app.state.served.engine.pause()
    return {"paused": True}


@router.post("/resume")
async def resume(request: Request) -> dict:
    await request.app.state.served.engine.resume()
    return {"paused": False}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    served: Served = request.app.state.served
    return PlainTextResponse(render_metrics(served.engine.stats(), served.model_name),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/engine/steps", responses=error_responses(404))
async def engine_steps(request: Request) -> dict:
    """The engine's last steps, oldest first, one record each (`tandem.inference.engine.step_records`): the time since
    the previous record and its parts, and what the steps it read and launched held; 404 while
    `engine.num_step_records` is 0."""
    records = request.app.state.served.engine.engine.step_records
    if records is None:
        raise APIError(404, "this server keeps no step records: set `engine.num_step_records` in its config",
                       "engine.num_step_records")
    return {"steps": records.snapshot()}
