"""Running untrusted code (a model's edits and the tests that import them) in a subprocess with
limits, inside one directory.

On Linux, `run_python_sandboxed` enforces:
- always: CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later), address space
  (RLIMIT_AS: allocations fail with MemoryError), size of any file written (RLIMIT_FSIZE), 64 open
  files, no core dumps, no privilege gain on exec (PR_SET_NO_NEW_PRIVS), wall-clock time and
  output size (the parent kills the whole process group when either runs out);
- when the parent runs as root (as in our containers): a fresh uid per run, owning only the
  sandbox directory, so the code cannot write anywhere root owns; a process-count limit
  (RLIMIT_NPROC, which counts per uid, so fork bombs stop there); every process of that uid is
  killed after the run, including ones that left the process group; a network namespace with
  no interface but a down loopback (no network); and a mount namespace in which /tmp, /var/tmp,
  /dev/shm and /run/lock are private tmpfs that vanish with the run (the work directory and a
  report folder, if under one of them, are bound back at their paths; the interpreter's
  installation is bound read-only into the private /tmp, since the fresh uid may not reach it
  where it is, e.g. under root's 0700 home; a virtual environment's site-packages too, when its
  interpreter runs with its packages).
- when not root: none of the root-only parts. Such a sandbox can write wherever the user can
  and reach the network, and a fork bomb is bounded only by CPU and wall-clock time; the
  `enforced` dict of each result says which parts held, and tests needing them skip.
Not enforced anywhere: reading files the uid may read (the code sees the file system), and a
test harness in the same process as the code it tests can be subverted by code that inspects
the harness (see `code_fix_workspace`).
"""

import asyncio
import json
import os
import random
import signal
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
_REPORT_PREFIX = b"TANDEM_SANDBOX "
# Uids handed to sandboxes: far above any real account, one fresh value per run.
_UID_RANGE = (1_900_000_000, 2_000_000_000)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 10
    """CPU seconds of the sandboxed process (each process of it, as RLIMIT_CPU counts)."""
    memory_mb: int = 1024
    """Address-space limit per process, MiB."""
    wall_s: float = 30.0
    """Wall-clock seconds before the whole run is killed."""
    output_bytes: int = 100_000
    """Bytes of stdout+stderr kept; more kills the run."""
    file_bytes: int = 4_000_000
    """Largest file the run may write (RLIMIT_FSIZE); also the size of each private tmpfs."""
    max_processes: int = 32
    """Processes of the sandbox uid at once (root only: see the module docstring)."""
    isolate: bool = True
    """Use network and mount namespaces where the kernel allows."""


@dataclass
class SandboxResult:
    returncode: int | None
    """Exit status; negative = killed by that signal; None = killed by us (see `violation`)."""
    output: str
    violation: str | None = None
    """Why the run was stopped: `wall_time`, `output_size`, `cpu_time`, `file_size`,
    `signal <n>`; None when it exited on its own. Callers may add their own
    (`code_fix`: `memory`, and `file_size` since Python ignores SIGXFSZ and raises instead)."""
    enforced: dict[str, bool] = field(default_factory=dict)
    """Which root-only confinements held (`network`, `private_tmp`, `own_uid`, `max_processes`)."""


async def run_python_sandboxed(
    args: list[str], workdir: Path, limits: SandboxLimits, stdin: bytes = b"",
    interpreter: str | None = None, report_dir: Path | None = None,
) -> SandboxResult:
    """Run `python <args>` in `workdir` under `limits`; never raises for what the program does.

    `interpreter` None: this process's interpreter, its standard library only (`-I`). A path: that
    interpreter with the packages installed in it (a virtual environment's too), run with `-E -s -B`
    rather than `-I`, so that the working directory comes first on `sys.path` as `python -m pytest`
    in a checkout expects. `report_dir`: an empty folder outside `workdir` that the run may write too
    (handed to the sandbox uid, kept visible under the private /tmp), for output read after the run."""
    uid = random.randrange(*_UID_RANGE) if os.geteuid() == 0 else None
    if uid is not None:
        _chown_tree(workdir, uid)
        if report_dir is not None:
            os.lchown(report_dir, uid, uid)
    config = {**asdict(limits), "uid": uid, "packages": interpreter is not None,
              "report_dir": None if report_dir is None else str(report_dir)}
    flags = ["-I"] if interpreter is None else ["-E", "-s", "-B"]
    proc = await asyncio.create_subprocess_exec(
        interpreter or sys.executable, "-I", str(LAUNCHER), json.dumps(config), *flags, *args,
        cwd=workdir, env=_clean_env(workdir), start_new_session=True,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output = bytearray()
    try:
        exceeded = await asyncio.wait_for(_communicate(proc, stdin, output, limits.output_bytes), limits.wall_s)
        violation = "output_size" if exceeded else None
    except TimeoutError:
        violation = "wall_time"
    finally:
        _kill_group(proc.pid)
        if uid is not None:
            await _kill_uid(uid)
    try:
        # asyncio reports the exit only once the output pipe is closed, and a reader left paused on a full
        # buffer (a run stopped for its output size) never sees the EOF: read the rest away first.
        await asyncio.wait_for(_discard_until_eof(proc.stdout), _REAP_TIMEOUT_S)
        returncode: int | None = await asyncio.wait_for(proc.wait(), _REAP_TIMEOUT_S)
    except TimeoutError:
        returncode, violation = None, violation or "unreaped"
    report, rest = _split_report(bytes(output[: limits.output_bytes + 512]))
    if violation is None and returncode is not None and returncode < 0:
        violation = _SIGNAL_VIOLATIONS.get(-returncode, f"signal {-returncode}")
    return SandboxResult(None if violation in ("wall_time", "output_size", "unreaped") else returncode,
                         rest[: limits.output_bytes].decode(errors="replace"), violation, report)


def _split_report(output: bytes) -> tuple[dict[str, bool], bytes]:
    """(the launcher's report, the program's output); an empty report if the launcher died first."""
    if not output.startswith(_REPORT_PREFIX) or b"\n" not in output:
        return {}, output
    line, rest = output.split(b"\n", 1)
    return json.loads(line[len(_REPORT_PREFIX):]), rest


_REAP_TIMEOUT_S = 10.0
"""Seconds to wait for the rest of a killed run's output and for its exit status; past them the run is
reported `unreaped` (a grandchild that left the process group may hold the pipe open)."""

# SIGKILL is left out: the hard CPU limit sends it, but so does the kernel's OOM killer.
_SIGNAL_VIOLATIONS = {signal.SIGXCPU: "cpu_time", signal.SIGXFSZ: "file_size"}


async def _communicate(proc: asyncio.subprocess.Process, stdin: bytes, output: bytearray, limit: int) -> bool:
    """Feed `stdin`, collect stdout into `output` until EOF and exit; True (and stop reading)
    once it passes `limit` bytes plus room for the launcher's report line."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(stdin)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading its input
    while chunk := await proc.stdout.read(65536):
        output += chunk
        if len(output) > limit + 512:
            return True
    await proc.wait()
    return False


async def _discard_until_eof(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


def _clean_env(workdir: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _chown_tree(root: Path, uid: int) -> None:
    """Hand the tree to the sandbox uid. Symlinks are not followed (lchown, and rglob does not
    descend them), and a file with several hard links is skipped: it may be a link that an
    earlier run made to a file outside."""
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode) or info.st_nlink == 1:
            os.lchown(path, uid, uid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _live_pids_of_uid(uid: int) -> list[int]:
    """Processes of `uid` that are not zombies (a zombie is dead; its parent reaps it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            pass  # it exited while we looked
    return pids


async def _kill_uid(uid: int) -> None:
    """Kill every process of the sandbox's uid: those that left the process group too. Rounds
    repeat while a fork bomb is still spawning (RLIMIT_NPROC keeps each round small)."""
    for _ in range(50):
        pids = _live_pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await asyncio.sleep(0.01)
    raise RuntimeError(f"could not kill the processes of sandbox uid {uid}: {_live_pids_of_uid(uid)}")
