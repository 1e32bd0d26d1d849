"""`tandem rl`: run the three processes of an RL run on this machine and watch them.

It executes a config resolved by `tandem.config.resolve` as it is: every port, rank, device and
URL was decided there (and shown by `--dry-run`); nothing here edits a config. Order: warm-up
(model init, SFT data, SFT) if the starting model is missing; every inference server, until each
answers `/health`; then orchestrator and trainer. The run ends when orchestrator and trainer
have exited 0, or at the first failure, Ctrl-C or SIGTERM: every process tree is then stopped
and the culprit is named with the last lines of its log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx

from tandem.config.dump import to_toml
from tandem.config.resolve import free_port, inference_server_name, process_configs
from tandem.config.rl import RLConfig
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.launch.warmup import run_warmup
from tandem.monitor.logging import setup_logging
from tandem.monitor.progress import ProgressPrinter
from tandem.monitor.report import summarize, write_report
from tandem.transport.files import atomic_write_text

RESULT_MARKERS = ("metrics.jsonl", "weights", "rollouts", "checkpoints")


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
    """Write the resolved config of each process (each inference server included), and the whole RL
    config, under `configs/`."""
    paths = {}
    for name, process_config in process_configs(config).items():
        paths[name] = config.run_dir / "configs" / f"{name}.toml"
        atomic_write_text(paths[name], to_toml(process_config))
    atomic_write_text(config.run_dir / "configs" / "rl.toml", to_toml(config))
    return paths


def _child_env(cuda_devices: list[int] | None) -> dict[str, str]:
    # The configs written above are already resolved: TANDEM_* variables must not apply twice.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONUNBUFFERED"] = "1"
    if cuda_devices is not None:
        # `deployment.*_devices` index the devices this launcher sees, which CUDA_VISIBLE_DEVICES may already narrow.
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = seen.split(",") if seen else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[d] if ids else str(d) for d in cuda_devices)
    return env


def _commands(config: RLConfig, configs: dict[str, Path]) -> dict[str, tuple[list[str], list[int] | None]]:
    py = [sys.executable, "-m", "tandem.cli"]
    gpu = config.deployment.type == "gpu"
    ranks = config.deployment.num_trainer_ranks
    trainer = [*py, "trainer", "@", str(configs["trainer"])]
    if ranks > 1:
        trainer = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "tandem.cli", "trainer", "@", str(configs["trainer"])]
    slices = config.deployment.inference_device_slices
    servers = {name: ([*py, "inference", "@", str(configs[name])], slices[i] if gpu else None)
               for i, name in enumerate(_server_names(config))}
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
        for name in _server_names(config):
            argv, devices = commands[name]
            procs[name] = ManagedProcess(name, argv, run_dir / "logs" / f"{name}.log", _child_env(devices))
        _write_pids(run_dir, procs)
        client = config.orchestrator.client
        for name, url in zip(_server_names(config), client.base_urls):
            log.info("waiting for inference server %s (%s)", name, url)
            wait_healthy(url, procs[name], client.health_timeout_s, stop_signal)
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
            exited = [name for name in _server_names(config) if procs[name].poll() == 0]
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


def _server_names(config: RLConfig) -> list[str]:
    return [inference_server_name(i) for i in range(config.deployment.num_inference_servers)]


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
    atomic_write_text(run_dir / "logs" / "pids.json", json.dumps({n: p.pid for n, p in procs.items()}))
