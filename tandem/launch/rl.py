"""`tandem rl`: run the processes of an RL run on this machine (this node's share of them) and watch them.

It executes a config resolved by `tandem.config.resolve` as it is: every port, rank, device and
URL was decided there (and shown by `--dry-run`); nothing here edits a config. Order: warm-up
(model init, SFT data, SFT) if the starting model is missing; every inference server of this node, until
each answers `/health`; the preflight, two processes of its own (`tandem orchestrator-preflight`, then
`tandem trainer-preflight`: `tandem.launch.preflight`); then orchestrator and trainer. With
`trainer.lora.share_base` the trainer starts first and the servers once it has shared its base, and the
trainer counts as done when it holds the base after its last step. The run ends when
orchestrator and trainer have exited 0, or at the first failure, Ctrl-C or SIGTERM: every process tree is
then stopped and the culprit is named with the last lines of its log.

On several nodes (`deployment.cluster`), `tandem rl` runs once per node and starts the processes
`ClusterConfig.roles` gives its node; the launchers wait for each other and then watch each other
(`tandem.launch.nodes`), so that a failure or a lost node anywhere stops every node, naming it. A node whose
decode servers hand prompts to other nodes' prefill servers starts once those answer.
With `--slurm` or `--k8s` the command renders a job instead (`tandem.launch.render`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

from tandem.config.dump import to_toml
from tandem.config.loader import secret_env
from tandem.config.placement import prefill_peers
from tandem.config.resolve import cluster_hosts, inference_server_names, node_servers, placed_servers, process_configs
from tandem.config.rl import RLConfig
from tandem.config.run_folder import remove_run, results_in
from tandem.launch.hang import HangWatch
from tandem.launch.nodes import Beacon, PeerWatch, Peers
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.launch.resume import cut_run_records
from tandem.launch.torchrun import trainer_argv
from tandem.launch.warmup import plan_warmup, run_warmup
from tandem.monitor.logging import setup_logging
from tandem.monitor.progress import ProgressPrinter
from tandem.monitor.report import summarize, write_report
from tandem.monitor.stop_signals import Stopped, held_signals, stops_cleanly
from tandem.monitor.wandb_run import WandbMirror
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import shared_base_file, shared_base_released_file, shared_buffer_file


@stops_cleanly("rl")
def main(config: RLConfig) -> int:
    log = setup_logging("launch")
    run_dir = config.run_dir
    try:
        warmup = plan_warmup(config)  # every folder checked before anything is removed, written or started
        _check_run_folder(config)
        if config.resume:
            _cut_to_checkpoint(run_dir, config.trainer.ckpt.resume_step or 0, log)
        if warmup is not None:
            run_warmup(config, warmup, log)
        configs = _write_process_configs(config)
        return _run(config, configs, log)
    except RunFailed as err:
        print(f"tandem rl: {err}", file=sys.stderr)
        return 1
    finally:
        log.info("run folder: %s", run_dir)


def _check_run_folder(config: RLConfig) -> None:
    """Refuse or clean an earlier run (`tandem.config.run_folder`); only node 0 does, the other nodes share its folder."""
    run_dir = config.run_dir
    is_first_node = config.deployment.cluster.node_rank == 0
    has_results = results_in(run_dir) if is_first_node else []
    if has_results and config.clean:
        remove_run(run_dir)
    elif has_results and not config.resume:
        raise RunFailed(f"{run_dir} already holds a run ({', '.join(has_results)}); pass --resume to continue it or --clean to start over")
    for sub in ("configs", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)


def _cut_to_checkpoint(run_dir: Path, step: int, log) -> None:
    """Records of steps after the checkpoint the processes resume from (the resolved `ckpt.resume_step`, 0
    without one) are recomputed: remove them first."""
    removed = cut_run_records(run_dir, step)
    log.info("resuming after step %d%s", step, f"; removed the stopped run's later records: {', '.join(removed)}" if removed else "")


def _write_process_configs(config: RLConfig) -> dict[str, Path]:
    """Write the resolved config of each process (each inference server included), and the whole RL
    config, under `configs/`; secrets redacted: each process gets them in its environment (`_process_env`). On
    several nodes a server's file carries its node (`inference.node1.toml`): servers of one name on two nodes may
    differ (a decode server's prefill servers are its node's), and the folder is shared."""
    paths = {}
    servers = set(inference_server_names(config))
    for name, process_config in process_configs(config).items():
        paths[name] = config.run_dir / "configs" / f"{name}{_node_suffix(config) if name in servers else ''}.toml"
        atomic_write_text(paths[name], to_toml(process_config))
    atomic_write_text(config.run_dir / "configs" / f"rl{_node_suffix(config)}.toml", to_toml(config))
    return paths


def _node_suffix(config: RLConfig) -> str:
    """`.node<R>` in the names of one node's own files of a multi-node run (their folder is shared)."""
    cluster = config.deployment.cluster
    return f".node{cluster.node_rank}" if cluster.num_nodes > 1 else ""


SHARED_GPU_ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
"""Given to every process when trainer and engine share a GPU (unless the caller set the variable): memory that
one process's caching allocator holds in fixed segments, cut up by shapes that change step to step, is memory the
other cannot have; expandable segments grow and shrink in place, so each holds closer to what it uses."""


def _child_env(cuda_devices: list[int] | None, shares_a_gpu: bool = False) -> dict[str, str]:
    # The configs written above are already resolved: TANDEM_* variables must not apply twice.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONUNBUFFERED"] = "1"
    if shares_a_gpu:
        env = SHARED_GPU_ALLOCATOR | env
    if cuda_devices is not None:
        # `deployment.*_devices` index the devices this launcher sees, which CUDA_VISIBLE_DEVICES may already narrow.
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = seen.split(",") if seen else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[d] if ids else str(d) for d in cuda_devices)
    return env


def _process_env(config: RLConfig, name: str, cuda_devices: list[int] | None) -> dict[str, str]:
    """`_child_env` and the secrets of the config that process `name` reads (a preflight reads its process's),
    which its file holds redacted (`tandem.config.secret`)."""
    reads = process_configs(config).get(name.removesuffix("-preflight"))
    return {**_child_env(cuda_devices, config.deployment.shares_a_gpu), **(secret_env(reads) if reads is not None else {})}


def _commands(config: RLConfig, configs: dict[str, Path]) -> dict[str, tuple[list[str], list[int] | None]]:
    py = [sys.executable, "-m", "tandem.cli"]
    deployment = config.deployment
    gpu = deployment.type == "gpu"
    hosts = cluster_hosts(config)
    trainer = trainer_argv(deployment, str(configs["trainer"]), hosts[0], str(int(deployment.cluster.node_rank == 0)))
    slices = deployment.inference_device_slices
    servers = {name: ([*py, "inference", "@", str(configs[name])], slices[i] if gpu else None)
               for i, name in enumerate(_server_urls(config))}
    return {
        **servers,
        "orchestrator": ([*py, "orchestrator", "@", str(configs["orchestrator"])], [] if gpu else None),
        "orchestrator-preflight": ([*py, "orchestrator-preflight", "@", str(configs["orchestrator"])], [] if gpu else None),
        "trainer": (trainer, deployment.trainer_devices if gpu else None),
        "trainer-preflight": (trainer_argv(deployment, str(configs["trainer"]), hosts[0], str(int(deployment.cluster.node_rank == 0)),
                                           command="trainer-preflight"), deployment.trainer_devices if gpu else None),
    }


def _run(config: RLConfig, configs: dict[str, Path], log) -> int:
    """Start this node's processes and watch them (and, on several nodes, the other nodes) to the end."""
    cluster = config.deployment.cluster
    roles = cluster.roles(cluster.node_rank)
    peers: Peers | None = None
    procs: dict[str, ManagedProcess] = {}
    mirror: WandbMirror | None = None
    try:
        peers = _join(config, log) if cluster.num_nodes > 1 else None
        mirror = _wandb_mirror(config, roles)
        if peers and "inference" in roles:
            _wait_for_remote_prefill_servers(config, peers, log)
        if _start(config, configs, roles, procs, log):
            return 0  # `preflight_only`: the preflight ran and passed
        _watch(config, procs, peers, mirror)
        if "orchestrator" in roles:
            report = write_report(config.run_dir)
            summary = summarize(config.run_dir)
            log.info("summary: %s", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
            log.info("report: %s", report)
            if mirror:
                mirror.finish(summary, report, failed=False)
                mirror = None
        if peers:
            peers.beacon.close("ended")
        return 0
    except (RunFailed, Stopped) as err:
        if peers:
            peers.beacon.close("failed", str(err).splitlines()[0])
        raise
    finally:
        with held_signals():  # a signal during the stop (after a failure) lets it end: every process is stopped
            if mirror:
                mirror.finish(None, None, failed=True)
            # A trainer sharing its base started first and stops last: the servers read its memory until they stop.
            for proc in reversed(procs.values()) if _shares_base(config) else procs.values():
                proc.stop()
            if _shares_base(config) and (buffer := shared_buffer_file(config.run_dir)) is not None:
                buffer.unlink(missing_ok=True)


def _wandb_mirror(config: RLConfig, roles: list[str]) -> WandbMirror | None:
    """The W&B run of `wandb.project`, on the node that runs the orchestrator (its folder view is the run's);
    started before any process, so that W&B refusing (no login, no network online) stops the run at once."""
    if config.wandb.project is None or "orchestrator" not in roles or config.preflight_only:
        return None
    try:
        return WandbMirror(config)
    except Exception as err:  # wandb raises its own error types for login, network and permission failures
        raise RunFailed(f"W&B logging (`wandb.project` = {config.wandb.project!r}) could not start: {err}") from err


def _join(config: RLConfig, log) -> Peers:
    """Start this node's heartbeat and wait for every other node's (`deployment.cluster.join_timeout_s`)."""
    cluster = config.deployment.cluster
    hosts = cluster_hosts(config)
    beacon = Beacon(config.run_dir, cluster.rendezvous_id, cluster.node_rank, hosts[cluster.node_rank])
    watch = PeerWatch(config.run_dir, cluster.rendezvous_id, cluster.node_rank, hosts, cluster.peer_timeout_s)
    log.info("node %d of %d (%s): waiting for the other nodes", cluster.node_rank, cluster.num_nodes, hosts[cluster.node_rank])
    try:
        watch.wait_joined(cluster.join_timeout_s)
    except (RunFailed, Stopped) as err:
        beacon.close("failed", str(err))
        raise
    log.info("all %d nodes joined", cluster.num_nodes)
    return Peers(beacon, watch)


def _wait_for_remote_prefill_servers(config: RLConfig, peers: Peers, log) -> None:
    """Before this node's decode servers start, the prefill servers of other nodes they hand prompts to answer
    `/health`: a decode server gives its prefill servers `inference.disaggregation.peer_timeout_s` at start, less than
    another node may take to load the model. RunFailed when a node fails meanwhile or
    `orchestrator.client.health_timeout_s` passes."""
    placed, rank = placed_servers(config), config.deployment.cluster.node_rank
    remote = sorted({peer.url for s in placed if s.node == rank and s.role == "decode"
                     for peer in prefill_peers(placed, s) if peer.node != rank})
    timeout_s = config.orchestrator.client.health_timeout_s
    deadline = time.monotonic() + timeout_s
    for url in remote:
        log.info("waiting for the prefill server %s", url)
        while not _answers_health(url):
            peers.watch.check()
            if time.monotonic() > deadline:
                raise RunFailed(f"the prefill server {url} did not answer {url}/health within {timeout_s:.0f} s "
                                "(`orchestrator.client.health_timeout_s`)")
            time.sleep(0.5)


def _answers_health(base_url: str) -> bool:
    try:
        return httpx.get(base_url.rstrip("/") + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _start(config: RLConfig, configs: dict[str, Path], roles: list[str], procs: dict[str, ManagedProcess], log) -> bool:
    """Start `roles` in order; for `inference`, every inference server of this node, each until it answers
    `/health`, then the preflight (one node only: its probe runs the trainer beside the servers). True when
    `preflight_only` ends the run there. Without a preflight and with no GPU shared, the servers do not hold
    the rest back: every process starts at once and the launcher waits for the servers' health after."""
    commands = _commands(config, configs)
    logs = config.run_dir / "logs"
    suffix = _node_suffix(config)
    urls = _server_urls(config)
    together = _starts_together(config)
    sharing = _shares_base(config)
    if sharing:  # the servers map the trainer's base: the trainer starts first, and an old run's files must not serve
        roles = ["trainer", *(role for role in roles if role != "trainer")]
        for path in (shared_base_file(config.run_dir), shared_base_released_file(config.run_dir)):
            path.unlink(missing_ok=True)
    for name in (n for role in roles for n in (urls if role == "inference" else [role])):
        argv, devices = commands[name]
        with held_signals():  # no signal between the start and `procs`: the stop on the way out reaches every process
            procs[name] = ManagedProcess(name, argv, logs / f"{name}{suffix}.log", _process_env(config, name, devices))
        atomic_write_text(logs / f"pids{suffix}.json", json.dumps({n: p.pid for n, p in procs.items()}))
        if name == "trainer" and sharing:
            log.info("waiting for the trainer to share its base (%s)", shared_base_file(config.run_dir))
            _wait_for_shared_base(config, procs[name])
        if name in urls:
            log.info("starting inference server %s (%s)", name, urls[name])
            if together:
                continue
            wait_healthy(urls[name], procs[name], config.orchestrator.client.health_timeout_s)
            if name == list(urls)[-1] and _runs_preflight(config):
                _preflight(config, commands)
                if config.preflight_only:
                    return True
    if together:
        for name in (n for n in urls if n in procs):
            wait_healthy(urls[name], procs[name], config.orchestrator.client.health_timeout_s,
                         beside=[p for p in procs.values() if p is not procs[name]])
    log.info("%s started; logs in %s", ", ".join(roles), logs)
    return False


def _starts_together(config: RLConfig) -> bool:
    """Whether this node's processes may start at once instead of after its servers are healthy: not when the
    preflight runs (it goes between the servers and the trainer), nor when trainer and server share a GPU (the
    engine sizes its KV cache from the memory it finds free, which a trainer starting beside it would take), nor
    when this node runs both pools (a decode server checks its prefill servers as it starts), nor when the servers
    map the trainer's base (`trainer.lora.share_base`: the trainer first)."""
    both_pools = {"prefill", "decode"} <= {s.role for s in node_servers(config)}
    return not (_runs_preflight(config) or config.deployment.shares_a_gpu or both_pools or _shares_base(config))


def _shares_base(config: RLConfig) -> bool:
    return config.trainer.lora.enabled and config.trainer.lora.share_base


def _wait_for_shared_base(config: RLConfig, trainer: ManagedProcess) -> None:
    """Return once the trainer has published its base (`shared_base.json`); RunFailed if it exits first or takes
    longer than a server may take to start (`orchestrator.client.health_timeout_s`)."""
    path = shared_base_file(config.run_dir)
    deadline = time.monotonic() + config.orchestrator.client.health_timeout_s
    while not path.is_file():
        if trainer.poll() is not None:
            tail = "\n".join(f"  | {line}" for line in trainer.tail(20))
            raise RunFailed(f"the trainer process failed at start (exit code {trainer.poll()}); last lines of "
                            f"{trainer.log_path}:\n{tail}")
        if time.monotonic() > deadline:
            raise RunFailed(f"the trainer did not share its base ({path}) within "
                            f"{config.orchestrator.client.health_timeout_s:.0f} s (`orchestrator.client.health_timeout_s`)")
        time.sleep(0.2)


def _finished(config: RLConfig, name: str, proc: ManagedProcess) -> bool:
    """Whether a finite process is done: exited 0, or a trainer that holds its shared base for the servers after its
    last step (`tandem.trainer.shared_base.hold_for_servers`), stopped with them."""
    if proc.poll() == 0:
        return True
    return (name == "trainer" and _shares_base(config) and proc.poll() is None
            and shared_base_released_file(config.run_dir).is_file())


def _runs_preflight(config: RLConfig) -> bool:
    return config.preflight.enabled and config.deployment.cluster.num_nodes == 1


def _server_urls(config: RLConfig) -> dict[str, str]:
    """This node's inference servers by process name (prefill servers first), each at its port of
    `deployment.inference_ports`: at the URL the resolution gave it on one node; on several, at the address it
    binds, loopback for every interface (the resolved URLs name the node's host, which this launcher need not
    reach itself through)."""
    servers = node_servers(config)
    if config.deployment.cluster.num_nodes == 1:
        return {s.name: s.url for s in servers}
    host = config.inference.server.host
    return {s.name: f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{s.port}" for s in servers}


def _watch(config: RLConfig, procs: dict[str, ManagedProcess], peers: Peers | None, mirror: WandbMirror | None) -> None:
    """Return once this node's orchestrator and trainer exited 0 (and, on several nodes, every node's);
    RunFailed at the first failure here or on another node. `mirror` follows the run folder."""
    finite = [n for n in ("orchestrator", "trainer") if n in procs]
    progress = ProgressPrinter(config.run_dir, config.max_steps) if "orchestrator" in procs else None
    hang_watches = {name: HangWatch(url, config.hang_timeout_s) for name, url in _server_urls(config).items() if name in procs}
    try:
        finished = False
        while not finished or (peers and not peers.watch.all_in(("finished", "ended"))):
            with held_signals():  # a signal stops the watch between two looks, never amid one (W&B, a server's stop)
                if progress:
                    progress.update()
                if mirror:
                    mirror.update()
                _raise_on_failure(config, procs, peers)
                for name, hang_watch in hang_watches.items():
                    _raise_if_hung(hang_watch, procs[name])
                if not finished and all(_finished(config, n, procs[n]) for n in finite):
                    finished = True
                    if peers:
                        peers.beacon.set_state("finished")
                    continue
            time.sleep(0.5)
        if progress:
            progress.finish()
    finally:
        if progress:
            progress.close()


def _raise_on_failure(config: RLConfig, procs: dict[str, ManagedProcess], peers: Peers | None) -> None:
    """RunFailed naming a failed process of this node (and the other node that explains it), or a failed or lost node."""
    failed = [(n, p.poll()) for n, p in procs.items() if p.poll() not in (None, 0)]
    if failed:
        name, code = failed[0]
        tail = "\n".join(f"  | {line}" for line in procs[name].tail(20))
        here = f"the {name} process failed (exit code {code}); last lines of {procs[name].log_path}:\n{tail}"
        cause = peers.watch.explain(config.deployment.cluster.peer_timeout_s) if peers else None
        raise RunFailed(f"{cause}; on this node {here}" if cause else here)
    if peers:
        peers.watch.check()
    exited = [name for name in _server_urls(config) if name in procs and procs[name].poll() == 0]
    if exited:
        raise RunFailed(f"the {exited[0]} process exited before the run finished")


def _raise_if_hung(hang_watch: HangWatch, server: ManagedProcess) -> None:
    """A hung server is killed at once: it would not use the grace period that SIGTERM gives the others."""
    silent_s = hang_watch.silent_for()
    if silent_s is not None and server.poll() is None:
        server.stop(grace=0)
        raise RunFailed(f"the inference server is hung: alive, but no answer to {hang_watch.url} for {silent_s:.0f} s "
                        f"(`hang_timeout_s`); the log of {server.name}: {server.log_path}")


def _preflight(config: RLConfig, commands: dict[str, tuple[list[str], list[int] | None]]) -> None:
    """The checks of `tandem.launch.preflight`, each process's part in a process of its own (stopped on the way out)."""
    from tandem.launch.preflight import run_preflight  # torch (the server's dtype): imported only when on

    started: list[ManagedProcess] = []

    def start(name: str) -> ManagedProcess:
        argv, devices = commands[name]
        with held_signals():  # no signal between the start and `started`: the stop below reaches every process
            started.append(ManagedProcess(name, argv, config.run_dir / "logs" / f"{name}.log", _process_env(config, name, devices)))
        return started[-1]

    try:
        run_preflight(config, start)
    finally:
        with held_signals():
            for proc in started:
                proc.stop()


def wait_healthy(base_url: str, proc: ManagedProcess, timeout_s: float, beside: list[ManagedProcess] | None = None) -> None:
    """Return once the server of `proc` answers `GET /health` with 200; RunFailed if it exits, a process
    started `beside` it fails, or `timeout_s` passes."""
    url = base_url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for other in (proc, *(beside or [])):
            if other.poll() is not None:  # before the server answers, no process of the run may end
                tail = "\n".join(f"  | {line}" for line in other.tail(20))
                raise RunFailed(f"the {other.name} process failed at start (exit code {other.poll()}); last lines of "
                                f"{other.log_path}:\n{tail}")
        if _answers_health(base_url):
            return
        time.sleep(0.2)
    raise RunFailed(f"the inference server did not answer {url} within {timeout_s:.0f} s")
