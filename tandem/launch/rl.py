"""`tandem rl`: run the three processes of an RL run on this machine and watch them.

Order: warm-up (model init, SFT data, SFT) if the starting model is missing; inference, until
`/health` answers; then orchestrator and trainer. The run ends when orchestrator and trainer
have exited 0, or at the first failure, Ctrl-C or SIGTERM: every process tree is then stopped
and the culprit is named with the last lines of its log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from tandem.config.dump import to_toml
from tandem.config.rl import RLConfig
from tandem.launch.process import ManagedProcess
from tandem.launch.warmup import run_warmup
from tandem.monitor.logging import setup_logging
from tandem.monitor.progress import ProgressPrinter
from tandem.monitor.report import summarize, write_report
from tandem.transport.files import atomic_write_text

RESULT_MARKERS = ("metrics.jsonl", "weights", "rollouts", "checkpoints")


class RunFailed(Exception):
    """A process of the run failed; the message names it."""


def main(config: RLConfig) -> int:
    log = setup_logging("launch")
    run_dir = config.run_dir
    try:
        _check_run_folder(config)
        if not Path(config.model.name).exists() and config.warmup.sft is not None:
            run_warmup(config, log)
        configs = _write_process_configs(config)
        return _run(config, configs, log)
    except RunFailed as err:
        print(f"tandem rl: {err}", file=sys.stderr)
        return 1
    finally:
        log.info("run folder: %s", run_dir)


def _check_run_folder(config: RLConfig) -> None:
    run_dir = config.run_dir
    has_results = [m for m in RESULT_MARKERS if _holds_results(run_dir / m)]
    if has_results and config.clean:
        for marker in RESULT_MARKERS + ("logs", "configs", "report.html"):
            path = run_dir / marker
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    elif has_results and not config.resume:
        raise RunFailed(f"{run_dir} already holds a run ({', '.join(has_results)}); pass --resume to continue it or --clean to start over")
    for sub in ("configs", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)


def _holds_results(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def _write_process_configs(config: RLConfig) -> dict[str, Path]:
    """Fill in what the launcher decides (ports, ranks, devices, resume) and write each config."""
    servers = resolve_inference_servers(config)
    orch = config.orchestrator
    orch.client.api_key = orch.client.api_key or config.inference.server.api_key
    orch.num_trainer_ranks = config.deployment.num_trainer_ranks
    if config.deployment.type == "cpu":
        config.trainer.device = "cpu"
        config.inference.engine.device = "cpu"
    else:
        config.trainer.device = "cuda"
        config.inference.engine.device = "cuda"
        if set(config.deployment.inference_devices) & set(config.deployment.trainer_devices):
            config.inference.engine.memory_fraction = config.deployment.shared_gpu_memory_fraction
    resolve_weight_transport(config)
    resolve_backend(config)
    if config.resume:
        config.trainer.ckpt.resume = True
        config.orchestrator.ckpt.resume = True
    paths = {}
    for i, port in enumerate(servers):
        server_config = config.inference.model_copy(deep=True)
        server_config.server.port = port
        paths[server_name(i)] = config.run_dir / "configs" / f"{server_name(i)}.toml"
        atomic_write_text(paths[server_name(i)], to_toml(server_config))
    for name in ("orchestrator", "trainer"):
        paths[name] = config.run_dir / "configs" / f"{name}.toml"
        atomic_write_text(paths[name], to_toml(getattr(config, name)))
    atomic_write_text(config.run_dir / "configs" / "rl.toml", to_toml(config))
    return paths


def server_name(i: int) -> str:
    """Process (log and config) name of inference server i: `inference`, `inference_1`, ..."""
    return "inference" if i == 0 else f"inference_{i}"


def resolve_inference_servers(config: RLConfig) -> list[int]:
    """The port of each of the `deployment.num_inference_servers` servers (`server.port` + i, or a
    free port each when it is 0), and their URLs as the orchestrator's `client.base_urls`."""
    num_servers = config.deployment.num_inference_servers
    server = config.inference.server
    ports = [free_port() if server.port == 0 else server.port + i for i in range(num_servers)]
    urls = [f"http://{server.host}:{port}" for port in ports]
    client = config.orchestrator.client
    if "base_urls" in client.model_fields_set and client.base_urls != urls:
        raise RunFailed(f"`orchestrator.client.base_urls` = {client.base_urls} contradicts the {num_servers} server(s) "
                        f"`tandem rl` starts ({urls}, from `inference.server` and `deployment.num_inference_servers`); "
                        "leave `orchestrator.client.base_urls` unset")
    client.base_urls = urls
    server.port = ports[0]
    return ports


def resolve_weight_transport(config: RLConfig) -> None:
    """Broadcast: the group's port (a free one when 0) and its receiving ranks (servers x ranks per
    server); the trainer's GPUs must be apart from the servers' (NCCL: one rank per GPU)."""
    transport = config.weight_transport
    if transport.type != "broadcast":
        return
    num_ranks = config.deployment.num_inference_servers * config.inference.num_ranks
    if "num_inference_ranks" in transport.model_fields_set and transport.num_inference_ranks != num_ranks:
        raise RunFailed(f"`weight_transport.num_inference_ranks` = {transport.num_inference_ranks} contradicts the "
                        f"{num_ranks} rank(s) of `deployment.num_inference_servers` x tensor parallel size; leave it unset")
    transport.num_inference_ranks = num_ranks
    if transport.port == 0:
        transport.port = free_port()
    deployment = config.deployment
    if deployment.type == "gpu" and set(deployment.inference_devices) & set(deployment.trainer_devices):
        raise RunFailed("`weight_transport.type` = \"broadcast\" needs `deployment.trainer_devices` apart from "
                        "`deployment.inference_devices` (NCCL runs one rank per GPU); use the filesystem transport "
                        "when they share a GPU")
    config.trainer.weight_transport = config.orchestrator.weight_transport = transport


def resolve_backend(config: RLConfig) -> None:
    """The orchestrator's client and the broadcast group speak the servers' backend; vLLM loads
    policies over the broadcast transport only (its folder reload is not wired yet)."""
    backend = config.inference.backend
    client = config.orchestrator.client
    if "backend" in client.model_fields_set and client.backend != backend:
        raise RunFailed(f"`orchestrator.client.backend` = {client.backend!r} contradicts `inference.backend` = "
                        f"{backend!r}; leave the client's unset")
    client.backend = backend
    if backend == "vllm" and config.deployment.type != "gpu":
        raise RunFailed("`inference.backend` = \"vllm\" runs on CUDA only: set `deployment.type` = \"gpu\"")
    if backend == "vllm" and config.weight_transport.type != "broadcast":
        raise RunFailed("`inference.backend` = \"vllm\" loads new policies over NCCL only: set "
                        "`weight_transport.type` = \"broadcast\"")
    transport = config.weight_transport
    if transport.type == "broadcast":
        if "receiver" in transport.model_fields_set and transport.receiver != backend:
            raise RunFailed(f"`weight_transport.receiver` = {transport.receiver!r} contradicts `inference.backend` = "
                            f"{backend!r}; leave it unset")
        transport.receiver = backend


def inference_device_slices(config: RLConfig) -> list[list[int] | None]:
    """The CUDA devices of each server (None on CPU): consecutive slices of `deployment.inference_devices`."""
    deployment = config.deployment
    if deployment.type != "gpu":
        return [None] * deployment.num_inference_servers
    per_server = config.inference.num_ranks
    needed = deployment.num_inference_servers * per_server
    if len(deployment.inference_devices) != needed:
        raise RunFailed(f"`deployment.inference_devices` lists {len(deployment.inference_devices)} GPU(s), but "
                        f"{deployment.num_inference_servers} server(s) of {per_server} GPU(s) need {needed}")
    devices = deployment.inference_devices
    return [devices[i * per_server:(i + 1) * per_server] for i in range(deployment.num_inference_servers)]


def _child_env(cuda_devices: list[int] | None) -> dict[str, str]:
    # The configs written above are already resolved: TANDEM_* variables must not apply twice.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONUNBUFFERED"] = "1"
    if cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cuda_devices))
    return env


def _commands(config: RLConfig, configs: dict[str, Path]) -> dict[str, tuple[list[str], list[int] | None]]:
    py = [sys.executable, "-m", "tandem.cli"]
    gpu = config.deployment.type == "gpu"
    ranks = config.deployment.num_trainer_ranks
    trainer = [*py, "trainer", "@", str(configs["trainer"])]
    if ranks > 1:
        trainer = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "tandem.cli", "trainer", "@", str(configs["trainer"])]
    servers = {server_name(i): ([*py, "inference", "@", str(configs[server_name(i)])], devices)
               for i, devices in enumerate(inference_device_slices(config))}
    return {
        **servers,
        "orchestrator": ([*py, "orchestrator", "@", str(configs["orchestrator"])], [] if gpu else None),
        "trainer": (trainer, config.deployment.trainer_devices if gpu else None),
    }


def _run(config: RLConfig, configs: dict[str, Path], log) -> int:
    run_dir = config.run_dir
    commands = _commands(config, configs)
    procs: dict[str, ManagedProcess] = {}
    stop_signal: list[int] = []

    def on_signal(signum, frame):
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = ProgressPrinter(run_dir, config.max_steps)
    try:
        servers = start_inference_servers(config, commands, procs, log)
        for name, url in servers.items():
            wait_healthy(url, procs[name], config.health_timeout_s, stop_signal)
        for name in ("orchestrator", "trainer"):
            argv, devices = commands[name]
            procs[name] = ManagedProcess(name, argv, run_dir / "logs" / f"{name}.log", _child_env(devices))
        _write_pids(run_dir, procs)
        log.info("orchestrator and trainer started; logs in %s", run_dir / "logs")
        while True:
            progress.update()
            if stop_signal:
                raise RunFailed(f"stopped by {signal.Signals(stop_signal[0]).name}")
            failed = [(n, p.poll()) for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                name, code = failed[0]
                tail = "\n".join(f"  | {line}" for line in procs[name].tail(20))
                raise RunFailed(f"the {name} process failed (exit code {code}); last lines of {procs[name].log_path}:\n{tail}")
            if all(procs[n].poll() == 0 for n in ("orchestrator", "trainer")):
                break
            exited = [name for name in servers if procs[name].poll() == 0]
            if exited:
                raise RunFailed(f"the {exited[0]} process exited before the run finished")
            time.sleep(0.5)
        progress.finish()
        report = write_report(run_dir)
        summary = summarize(run_dir)
        log.info("summary: %s", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
        log.info("report: %s", report)
        return 0
    finally:
        for proc in procs.values():
            proc.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def start_inference_servers(config: RLConfig, commands: dict, procs: dict[str, ManagedProcess], log) -> dict[str, str]:
    """Start every inference server (into `procs`); returns each one's process name and URL."""
    servers = {server_name(i): url for i, url in enumerate(config.orchestrator.client.base_urls)}
    for name, url in servers.items():
        argv, devices = commands[name]
        procs[name] = ManagedProcess(name, argv, config.run_dir / "logs" / f"{name}.log", _child_env(devices))
        log.info("starting inference server %s (%s)", name, url)
    _write_pids(config.run_dir, procs)
    return servers


def wait_healthy(base_url: str, proc: ManagedProcess, timeout_s: float, stop_signal: list[int] | None = None) -> None:
    """Return once the server of `proc` answers `GET /health` with 200; RunFailed if it exits, a
    signal was caught (`stop_signal`), or `timeout_s` passes."""
    url = base_url.rstrip("/") + "/health"
    stop_signal = stop_signal or []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop_signal:
            raise RunFailed(f"stopped by {signal.Signals(stop_signal[0]).name}")
        if proc.poll() is not None:
            tail = "\n".join(f"  | {line}" for line in proc.tail(20))
            raise RunFailed(f"the {proc.name} process failed at start (exit code {proc.poll()}); last lines of {proc.log_path}:\n{tail}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RunFailed(f"the inference server did not answer {url} within {timeout_s:.0f} s")


def _write_pids(run_dir: Path, procs: dict[str, ManagedProcess]) -> None:
    """`logs/pids.json`: the process-group leader of each process (for operators and tests)."""
    import json

    atomic_write_text(run_dir / "logs" / "pids.json", json.dumps({n: p.pid for n, p in procs.items()}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
