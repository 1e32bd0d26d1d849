"""Run by path as `python -I sandbox_launch.py <limits json> <python args...>`: confine this
process, report what was confined as the first line of stdout, then exec this Python
interpreter with the args (its standard library only, or with its installed packages when the
limits say `packages`).

Kept free of tandem imports (`-I` ignores PYTHONPATH) and of threads, so it can do what
`preexec_fn` must not: the parent (`sandbox.py`) may have threads. Order matters: namespaces
need root's capabilities, so they come before the uid drop, and RLIMIT_NPROC counts per uid, so
it only means something once the uid is the sandbox's own.
"""

from __future__ import annotations  # the interpreter of a repository's environment may be older

import ctypes
import json
import os
import resource
import sys
import sysconfig

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
# World-writable places a sandbox must not leave files in: each gets a private, small tmpfs.
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# Where the interpreter's installation is bind-mounted (in the private /tmp) for a sandbox uid
# that could not reach it at its own path (e.g. under root's 0700 home).
PYTHON_MOUNT = "/tmp/.tandem-python"
# A virtual environment rebuilt around the mounted interpreter, its site-packages bound read-only.
VENV_MOUNT = "/tmp/.tandem-venv"


def isolate(libc: ctypes.CDLL, tmpfs_bytes: int, kept: list[str]) -> dict[str, bool]:
    """A network namespace without interfaces but loopback, and a mount namespace whose shared
    writable directories are private tmpfs, except the directories `kept` (the work directory
    first). Each part is skipped when the kernel refuses it."""
    done = {"network": libc.unshare(CLONE_NEWNET) == 0, "private_tmp": False}
    # Mounts are made only after the whole tree is private, or they would reach the host.
    if libc.unshare(CLONE_NEWNS) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return done
    handles = {path: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in kept}
    options = f"size={tmpfs_bytes},mode=1777".encode()
    mounted = [
        libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0
        for path in SHARED_WRITABLE
        if os.path.isdir(path)
    ]
    for path, handle in handles.items():
        if not os.path.isdir(path):
            # It was under a shadowed directory: bind it back at its own path (the descriptor
            # opened before still leads to the real directory).
            os.makedirs(path)
            mounted.append(libc.mount(f"/proc/self/fd/{handle}".encode(), path.encode(), None, MS_BIND, None) == 0)
        os.close(handle)
    os.chdir(kept[0])
    done["private_tmp"] = all(mounted)
    return done


def reachable_python(libc: ctypes.CDLL, installation: Installation, packages: bool) -> tuple[str, dict[str, str]] | None:
    """(interpreter path, extra env) of this interpreter's installation mounted read-only at
    `PYTHON_MOUNT`, and with `packages` its virtual environment's at `VENV_MOUNT`; None when the
    mounts fail."""
    if not bind_read_only(libc, installation.prefix, PYTHON_MOUNT):
        return None
    python = os.path.join(PYTHON_MOUNT, installation.executable)
    if packages and installation.venv is not None:
        python = rebuilt_venv(libc, installation, python)
        if python is None:
            return None
    return python, {"LD_LIBRARY_PATH": os.path.join(PYTHON_MOUNT, "lib")}


def bind_read_only(libc: ctypes.CDLL, source: str, target: str) -> bool:
    os.makedirs(target)
    if libc.mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        return False
    return libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0


def rebuilt_venv(libc: ctypes.CDLL, installation: Installation, python: str) -> str | None:
    """The interpreter of a virtual environment at `VENV_MOUNT` (root's, read-only to the sandbox
    uid) whose base is the mounted `python` and whose site-packages is the real one, bound."""
    with open(os.path.join(installation.venv, "pyvenv.cfg")) as file:
        lines = [line for line in file.read().splitlines() if not line.replace(" ", "").startswith("home=")]
    os.makedirs(os.path.join(VENV_MOUNT, "bin"))
    with open(os.path.join(VENV_MOUNT, "pyvenv.cfg"), "w") as file:
        file.write("\n".join([f"home = {os.path.dirname(python)}", *lines]) + "\n")
    os.symlink(python, os.path.join(VENV_MOUNT, "bin", "python"))
    if not bind_read_only(libc, installation.site_packages, os.path.join(VENV_MOUNT, installation.site_packages_in_venv)):
        return None
    return os.path.join(VENV_MOUNT, "bin", "python")


class Installation:
    """This interpreter's installation, resolved before the private /tmp hides anything: a virtual
    environment under /tmp (its `bin/python` a link to the base interpreter) is out of sight once /tmp
    is a fresh tmpfs, so the links are followed now. An installation itself under /tmp stays
    unreachable from the sandbox (its runs then fail, and are scored 0)."""

    def __init__(self):
        self.prefix = os.path.realpath(sys.base_prefix)
        self.real_executable = os.path.realpath(sys.executable)
        self.executable = os.path.relpath(self.real_executable, self.prefix)
        self.venv_executable = sys.executable
        """The interpreter as invoked: a virtual environment's own `bin/python` finds its packages."""
        self.venv = sys.prefix if sys.prefix != sys.base_prefix else None
        self.site_packages = os.path.realpath(sysconfig.get_path("purelib"))
        self.site_packages_in_venv = os.path.relpath(sysconfig.get_path("purelib"), sys.prefix)


def set_limits(limits: dict, own_uid: bool) -> None:
    cpu_s = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    memory = limits["memory_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if own_uid:  # RLIMIT_NPROC counts every process of the uid: it binds only a uid of our own
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))


def main() -> None:
    limits, args = json.loads(sys.argv[1]), sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    enforced = {"network": False, "private_tmp": False, "own_uid": False}
    installation = Installation()
    if limits["isolate"]:
        kept = [os.getcwd()] + ([limits["report_dir"]] if limits["report_dir"] else [])
        enforced.update(isolate(libc, limits["file_bytes"], kept))
    python = installation.venv_executable if limits["packages"] else installation.real_executable
    env = dict(os.environ)
    # A uid of its own needs the interpreter where that uid can run it: in the private /tmp.
    mounted = None
    if limits["uid"] is not None and enforced["private_tmp"]:
        mounted = reachable_python(libc, installation, limits["packages"])
    if mounted is not None:
        python, extra_env = mounted
        env.update(extra_env)
        os.setgroups([])
        os.setgid(limits["uid"])
        os.setuid(limits["uid"])
        enforced["own_uid"] = True
    set_limits(limits, enforced["own_uid"])
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    enforced["max_processes"] = enforced["own_uid"]
    sys.stdout.write(f"TANDEM_SANDBOX {json.dumps(enforced)}\n")
    sys.stdout.flush()
    os.execve(python, [python, *args], env)


if __name__ == "__main__":
    main()
