"""Schemathesis hooks of `test_fuzz.py` (loaded by `st run` through SCHEMATHESIS_HOOKS).

Schema-valid (positive) requests name the served model, so that they reach the engine instead of a 404, and
are kept only if the model takes them: their chat template accepts the messages, their token ids (prompts and
`stop_token_ids`) are in the vocabulary, their prompt and completion fit the context, and they ask for routed
experts only of a mixture of experts (the fuzzed model is dense). These rules are the model's (its template,
tokenizer and size), which no JSON Schema of the API can state (the document's descriptions do). Negative
requests are left exactly as generated.

One exclusion: a valid `POST /init_weight_transfer_engine` is never sent. It joins a torch.distributed group and
waits, up to `server.weight_transfer_timeout_s` (300 s), for the trainer at `init_info.master_address`, which an
address the fuzzer makes up never has (and one that points at a listening port of this machine is not a trainer
either). Invalid bodies of that route still are; `test_weight_broadcast.py` joins a real group.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import schemathesis
from pydantic import ValidationError
from transformers import AutoTokenizer

from tandem.inference.errors import APIError
from tandem.inference.openai_api import chat_prompt, completion_prompts
from tandem.inference.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, InitWeightTransferRequest

MODEL = os.environ["TANDEM_FUZZ_MODEL"]
MAX_MODEL_LEN = int(os.environ["TANDEM_FUZZ_MAX_MODEL_LEN"])
TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
SERVED = SimpleNamespace(tokenizer=TOKENIZER)
"""What `chat_prompt` and `completion_prompts` read of the server: its tokenizer."""
REQUESTS = {"/v1/generate": GenerateRequest, "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def is_positive(case) -> bool:
    return case.meta is not None and case.meta.generation.mode.is_positive and isinstance(case.body, dict)


@schemathesis.hook
def map_case(context, case):
    if is_positive(case) and "model" in case.body and case.operation.path != "/update_weights":
        case.body["model"] = MODEL
    return case


@schemathesis.hook
def filter_case(context, case) -> bool:
    if case.operation.path == "/init_weight_transfer_engine":
        return not joins_a_group(case.body)
    if not is_positive(case):
        return True
    model = REQUESTS.get(case.operation.path)
    if model is None:
        return True
    try:
        body = model.model_validate(case.body)  # as the server reads it (2.0 is 2)
    except ValidationError:
        return True  # the schema and the server disagree: the checks must see it
    if isinstance(body, GenerateRequest):
        if body.return_routed_experts:
            return False  # a dense model has no experts to report
        prompts, max_tokens = [body.prompt_token_ids], body.max_tokens
    elif isinstance(body, CompletionRequest):
        prompts, max_tokens = completion_prompts(SERVED, body.prompt), body.max_tokens
    else:
        try:
            prompts = [chat_prompt(SERVED, body)]
        except APIError:
            return False  # the model's chat template refuses these messages: its rules are no JSON Schema's
        max_tokens = body.max_completion_tokens or body.max_tokens
    token_ids = [t for p in prompts for t in p] + list(body.stop_token_ids or ())
    return max(token_ids) < len(TOKENIZER) and all(len(p) + (max_tokens or 1) <= MAX_MODEL_LEN for p in prompts)


def joins_a_group(body) -> bool:
    """Whether the server would read `body` as a group to join (see the module docstring), whatever its phase."""
    try:
        InitWeightTransferRequest.model_validate(body)
    except ValidationError:
        return False
    return True
