"""`tandem inference`: serve with the configured backend, importing only that backend's server.

tandem's server imports its engine (torch, Triton, the model code: seconds of start-up); vLLM's server is
another program, which tandem's wrapper starts and watches without any of that. So a missing or wrong vLLM
is reported in a fraction of a second, and a vLLM deployment's wrapper holds no torch in memory.
"""

from __future__ import annotations

import logging

from tandem.config.inference import InferenceConfig


def main(config: InferenceConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.backend == "vllm":
        from tandem.inference.vllm.server import main as serve
    else:
        from tandem.inference.server import main as serve
    return serve(config)
