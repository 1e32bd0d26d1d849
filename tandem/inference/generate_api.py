"""`POST /v1/generate`: token ids in, token ids and logprobs out.

For multi-turn rollouts that must not re-tokenize: the orchestrator sends the exact ids of the
conversation so far and gets back the exact ids it will train on, each with the logprob of the
distribution that sampled it and the weight version of the choice.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from tandem.inference.errors import error_responses
from tandem.inference.protocol import GenerateRequest
from tandem.inference.serving import JSON, Choice, Served, off_loop_if_large, random_id

router = APIRouter()


def choice_json(c: Choice, with_routed_experts: bool) -> dict:
    out = {"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs, "text": c.text,
           "finish_reason": c.finish_reason, "weight_version": c.weight_version}
    if with_routed_experts:
        out["routed_experts"] = c.routed_experts
    return out


@router.post("/v1/generate", response_model=dict, responses=error_responses(400, 404, 413, 500))
async def generate(body: GenerateRequest, request: Request) -> JSON:
    served: Served = request.app.state.served
    is_base = served.is_base(body.model)
    params = await off_loop_if_large(len(body.prompt_token_ids), served.sampling_params, body, body.max_tokens,
                                     body.prompt_token_ids, 0, {"prompt": "prompt_token_ids"})
    choices = await served.complete(body.prompt_token_ids, params, body.n, is_base)
    return JSON({
        "id": f"gen-{random_id()}",
        "prompt_token_ids": body.prompt_token_ids,
        "choices": [choice_json(c, body.return_routed_experts) for c in choices],
        "weight_version": served.answer_version(is_base),
        "usage": served.usage(len(body.prompt_token_ids), sum(len(c.token_ids) for c in choices), choices),
    })
