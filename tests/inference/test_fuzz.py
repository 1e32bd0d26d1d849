"""The server against its own `/openapi.json`: schemathesis, positive and negative requests, every check on.

Schema-valid requests must be answered 2xx (or 404 for a model or weights not there), schema-invalid ones 4xx;
every status, content type and body must be what the document declares, and nothing may be a 5xx. The engine's
context is 16 tokens so that a request of n = 256 finishes in moments; a fixed seed keeps CI reproducible.
`fuzz_hooks.py` says which model-specific rules the positive requests are made to follow.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from inference_helpers import make_config

from tandem.inference.server import BackgroundServer

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 16
EXAMPLES = 15
"""Per operation and phase: about 1,000 requests in all, 10-20 s here."""


def test_the_server_conforms_to_its_openapi_document(tiny_dir, tmp_path):
    server = BackgroundServer(make_config(tiny_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=256))
    here = Path(__file__).parent
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "TANDEM_FUZZ_MODEL": str(tiny_dir),
           "TANDEM_FUZZ_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", "--checks", "all",
               "--mode", "all", "--phases", "examples,coverage,fuzzing", "--max-examples", str(EXAMPLES),
               "--seed", "1", "--workers", "1", "--no-color", "--request-timeout", "30"]
    try:
        run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    finally:
        server.stop()
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-12000:]
    assert " passed" in report and "generated" in report, report[-3000:]
