"""The `tandem` command: one entry point, one subcommand per process or tool.

Configs are parsed and validated before any heavy import (torch), so a typo costs
milliseconds and shows a clear message, never a traceback.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import signal
import sys
from dataclasses import dataclass

from tandem.config.loader import ConfigError, parse_args


@dataclass(frozen=True)
class Command:
    config: str
    """`module:Class` of the config the subcommand takes."""
    entry: str
    """`module:function` run with the validated config; returns an exit code."""
    help: str
    parse: str | None = None
    """`module:function(argv) -> config` where reading the config needs more than validation (`tandem rl`
    resolves its processes' configs); None: `parse_args` of `config`."""


COMMANDS: dict[str, Command] = {
    "rl": Command("tandem.config.rl:RLConfig", "tandem.launch.rl:main",
                  "Run async RL: inference server, orchestrator and trainer together.",
                  parse="tandem.config.resolve:parse_rl_args"),
    "sft": Command("tandem.config.sft:SFTConfig", "tandem.trainer.sft.train:main",
                   "Supervised fine-tuning on local chat or prompt/completion data."),
    "eval": Command("tandem.config.eval:EvalConfig", "tandem.orchestrator.eval_entry:main",
                    "Evaluate a model on environments against an inference server."),
    "trainer": Command("tandem.config.trainer:TrainerConfig", "tandem.trainer.rl.train:main",
                       "The RL trainer process (FSDP2)."),
    "replay": Command("tandem.config.replay:ReplayConfig", "tandem.trainer.replay:main",
                      "Recompute one step of a run offline: `tandem replay RUN_DIR --step N [--loss.type ...]`.",
                      parse="tandem.config.replay:parse_replay_args"),
    "trainer-preflight": Command("tandem.config.trainer:TrainerConfig", "tandem.trainer.preflight:main",
                                 "The trainer's preflight mode, run by `tandem rl` before step 1 (probe logprobs, memory plan)."),
    "orchestrator": Command("tandem.config.orchestrator:OrchestratorConfig", "tandem.orchestrator.main:main",
                            "The orchestrator process: rollouts, advantages, batches."),
    "orchestrator-preflight": Command("tandem.config.orchestrator:OrchestratorConfig", "tandem.orchestrator.preflight:main",
                                      "The orchestrator's preflight mode, run by `tandem rl` before step 1 (probe batch, prefix check)."),
    "inference": Command("tandem.config.inference:InferenceConfig", "tandem.inference.entry:main",
                         "The OpenAI-compatible inference server."),
}


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _usage() -> str:
    lines = ["usage: tandem <command> [@ file.toml ...] [--key value ...] [--dry-run]",
             "       tandem rl ... --slurm | --k8s   (render the run for a cluster; see docs/deployment.md)", "", "commands:"]
    for name, cmd in COMMANDS.items():
        lines.append(f"  {name:<13} {cmd.help}")
    lines.append(f"  {'model':<13} Model tools: `tandem model init --preset tiny --out DIR`.")
    lines += ["", "Later files override earlier ones, then TANDEM_<SECTION>__<KEY> variables, then flags.",
              "`tandem <command> --help` lists the command's keys."]
    return "\n".join(lines)


def _help_of(config_cls) -> str:
    from tandem.config.dump import describe

    return describe(config_cls)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "model":
        from tandem.models.cli import main as model_main

        return model_main(rest)
    if name not in COMMANDS:
        print(f"tandem: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    cmd = COMMANDS[name]
    try:
        config_cls = _load(cmd.config)
    except ModuleNotFoundError as err:
        print(_missing_module(name, err), file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        print(f"tandem {name}: {cmd.help}\n\n{_help_of(config_cls)}")
        return 0
    dry_run = "--dry-run" in rest
    rest = [a for a in rest if a != "--dry-run"]
    if name == "rl":
        rest = _launcher_flags(rest)
    try:
        config = _load(cmd.parse)(rest) if cmd.parse else parse_args(config_cls, rest)
    except ConfigError as err:
        print(f"tandem {name}: config error: {err}", file=sys.stderr)
        return 2
    if name == "rl" and config.deployment.launcher != "local":
        from tandem.launch.render import render

        return render(config, rest, dry_run)
    if dry_run:
        from tandem.config.dump import dump_process_configs

        print(dump_process_configs(config))
        return 0
    try:
        entry = _load(cmd.entry)
    except ModuleNotFoundError as err:
        print(_missing_module(name, err), file=sys.stderr)
        return 2
    # `kill -USR1 <pid>` (pids in the run's logs/pids.json) prints every thread's Python stack into the
    # process's log and lets it go on: what a process that seems hung is waiting for, without a debugger.
    # The process's own stderr (`sys.__stderr__`): a caller in the same process may have replaced `sys.stderr`
    # with an object that has no file descriptor (pytest's capture).
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    code = int(entry(config) or 0)
    # What the command built is garbage now, but objects in reference cycles wait for a collection, which might come
    # only in the interpreter's teardown: a trainer's process groups, held by its FSDP modules, would then end their
    # native threads there (`tandem.trainer.parallel.dims.close_parallel`). Collected here, they end first.
    gc.collect()
    return code


def _launcher_flags(argv: list[str]) -> list[str]:
    """`--slurm` and `--k8s` are `--deployment.launcher slurm|k8s`."""
    from tandem.launch.render import FLAGS

    return [part for arg in argv for part in (["--deployment.launcher", FLAGS[arg]] if arg in FLAGS else [arg])]


def _missing_module(command: str, err: ModuleNotFoundError) -> str:
    """Name the module that failed to import: a missing dependency, not a missing command."""
    return (f"tandem {command}: cannot import the Python module {err.name!r} ({err}); "
            "install tandem with its dependencies (`pip install -e .` or `make venv`)")


if __name__ == "__main__":
    sys.exit(main())
