"""Run vLLM's OpenAI server as `tandem inference --backend vllm`, in its own process group.

This process checks vLLM (on PATH or importable, version 0.26, the pass-through flags), starts `vllm serve`
with dev mode on, tees its output, forwards SIGTERM/SIGINT to vLLM's whole group, and exits with
vLLM's code. A vLLM that is missing, of another version, or that exits is an error here, with
the last lines of its output, so `tandem rl` names the cause.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.config.inference import InferenceConfig
from tandem.inference.vllm.args import SUPPORTED_VERSION, check_extra_args, flags_in_help, serve_argv, serve_env

TAIL_LINES = 30
"""Lines of vLLM's output quoted when it fails."""


class VllmUnavailable(Exception):
    """vLLM cannot be run here as configured; the message says why and what to do."""


def find_vllm() -> list[str]:
    """The command that runs vLLM's CLI, of a supported version: the `vllm` executable on PATH, else this
    interpreter's `vllm` module (an install with `pip --target`, on PYTHONPATH but without its `bin` on PATH)."""
    exe = shutil.which("vllm")
    if exe is not None:
        command = [exe]
    elif importlib.util.find_spec("vllm") is not None:
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    else:
        raise VllmUnavailable("backend `vllm` needs vLLM: no `vllm` executable is on PATH and this Python cannot import "
                              f"it; install it with `pip install 'tandem-rl[vllm]'` (vLLM {SUPPORTED_VERSION}, docs/vllm.md)")
    result = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=300)
    lines = (result.stdout + result.stderr).strip().splitlines()
    version = lines[-1].strip() if lines else ""
    if result.returncode != 0 or not version.startswith(SUPPORTED_VERSION + "."):
        raise VllmUnavailable(f"{' '.join(command)} is vLLM {version or '(no version)'}, tandem speaks vLLM "
                              f"{SUPPORTED_VERSION}: `pip install 'tandem-rl[vllm]'`" + _quote(lines))
    return command


def known_flags(command: list[str]) -> set[str]:
    """vLLM's `serve` flags, from its own help (the one list that matches the installed version)."""
    result = subprocess.run([*command, "serve", "--help=all"], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise VllmUnavailable("`vllm serve --help=all` failed" + _quote((result.stdout + result.stderr).splitlines()))
    return flags_in_help(result.stdout)


def write_adapter_start(config: InferenceConfig, folder: Path) -> str:
    """A LoRA run's policy before its first update, as the adapter folder vLLM loads at start (`--lora-modules`):
    the base (B zero), so the policy's name answers from the first request."""
    from tandem.models.hub import resolve_model_path
    from tandem.models.lora import LoraSpec, write_start_folder

    lora = config.engine.lora
    write_start_folder(folder, resolve_model_path(config.model.name),
                       LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules)), config.seed)
    return str(folder)


def serves_fp8_checkpoint(config: InferenceConfig) -> bool:
    """Whether `model.name` holds released FP8 weights (its `quantization_config`, checked as tandem's engine checks
    it: another scheme is an error naming the file). A path that does not exist is left to vLLM to report."""
    from tandem.models.fp8_checkpoint import checkpoint_quantization
    from tandem.models.hub import config_folder, is_hub_name, read_hf_config

    name = config.model.name
    if not (Path(name).expanduser().is_dir() or is_hub_name(name)):
        return False
    folder = config_folder(name)
    return checkpoint_quantization(read_hf_config(folder), str(folder / "config.json")) == "fp8"


def check_no_draft_head(config: InferenceConfig) -> None:
    """Refuse a Qwen3, Qwen3-MoE or MiniMax-M2 folder with a draft head (`tandem model add-draft-head`): vLLM's
    loaders of these families know no layer after the last block (vLLM's MTP drafting is for GLM's and DeepSeek's
    checkpoints), so the head's weights, at load and in every update, are tensors it cannot place. A hub name is a
    released checkpoint, which carries none."""
    from tandem.models.draft_head import has_draft_head
    from tandem.models.hub import read_hf_config

    folder = Path(config.model.name).expanduser()
    if not (folder / "config.json").is_file():
        return
    hf_config = read_hf_config(folder)
    model_type, heads = hf_config.get("model_type"), hf_config.get("num_nextn_predict_layers")
    if has_draft_head(hf_config):
        raise ValueError(f"`backend` = 'vllm' cannot serve `model.name` = {config.model.name!r}: a {model_type!r} model "
                         f"with a draft head ({folder / 'config.json'}: `num_nextn_predict_layers` = {heads}), which "
                         f"vLLM's {model_type!r} loader does not know; set `backend` = 'tandem', or serve a folder "
                         "without the head")


def run_vllm(command: list[str], argv: list[str], config: InferenceConfig) -> int:
    """Run `vllm serve` with `argv` until it exits or this process is told to stop; returns its exit code."""
    proc = subprocess.Popen([*command, "serve", *argv], env={**os.environ, **serve_env(config)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True, errors="replace")

    def forward(signum, frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line.rstrip("\n"))
    code = proc.wait()
    if code != 0:
        print(f"tandem inference: vLLM exited with code {code}" + _quote(tail), file=sys.stderr)
    return code


def main(config: InferenceConfig) -> int:
    with tempfile.TemporaryDirectory(prefix="tandem-lora-start-") as scratch:
        try:
            check_no_draft_head(config)
            command = find_vllm()
            if config.vllm.extra_args:
                check_extra_args(config, known_flags(command))
            adapter_start = write_adapter_start(config, Path(scratch)) if config.engine.lora.enabled else None
            argv = serve_argv(config, adapter_start, serves_fp8_checkpoint(config))
        except (VllmUnavailable, ValueError, OSError) as err:
            print(f"tandem inference: {err}", file=sys.stderr)
            return 2
        return 1 if run_vllm(command, argv, config) != 0 else 0


def _quote(lines) -> str:
    lines = list(lines)[-TAIL_LINES:]
    return ("; last lines of its output:\n" + "\n".join(f"  | {line}" for line in lines)) if lines else ""
