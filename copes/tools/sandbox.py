"""A real Python sandbox for the agent's code tool, built for code written by a policy that is rewarded for
right answers and so learns to look for them.

`PythonSandbox.run(code)` starts `sandbox_child.py` (standard library only, `python -I -S`) in a new session
with a scrubbed environment; the child puts every layer in place and checks it from inside (see its docstring):
a whole-run cgroup (memory, pids), a fresh per-run uid (as root) inside its own user namespace, private network,
mount, IPC and pid namespaces, a fresh session keyring, a fresh read-only tmpfs root with only the
interpreter, its libraries and site-packages, a size-limited work dir, rlimits, no capabilities, no_new_privs.

Fail closed: unless every layer is verified, the run stops before the code starts and `run` raises
`SandboxUnavailable` naming what is missing. `PythonSandbox(unsafe=True)` runs with whatever this machine
allows instead, and logs one loud warning per process. `SandboxResult.isolation` holds what the child verified.

Why a bootstrap script and not `preexec_fn`: preexec_fn is unsafe when the caller runs threads (the agent loop
calls tools from threads). Why a pid namespace: when its pid 1 dies the kernel kills every process in it, so
ending the run also ends children that left the process group (fork bombs, daemons).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from copes.errors import ConfigError
from copes.tools import sandbox_child
from copes.tools.cgroups import RunCgroup

logger = logging.getLogger(__name__)

CHILD_SCRIPT = sandbox_child.__file__
# Every protection the child verifies; strict mode needs all of them.
PROTECTIONS = ("user", "network", "filesystem", "pid_namespace", "ipc", "keyring", "capabilities", "memory",
               "process_limit", "disk", "rlimits")
# Per-run uids come from a range no distribution allocates, so a collision with a real account is implausible.
_SANDBOX_UIDS = range(1_000_000_000, 2_000_000_000)
# System library directories the interpreter and compiled extensions load from (never data).
_LIBRARY_PATHS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")
_READ_CHUNK_BYTES = 64 << 10
# The bootstrap and init processes of a run count against its pids limit too.
_RUN_OWN_PROCESSES = 2
# How long the bootstrap may take to tear the run down after SIGTERM before its whole group gets SIGKILL.
_STOP_GRACE_S = 5.0
_HOW_TO_ALLOW = (
    "the sandbox needs user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1; "
    "in Docker a seccomp profile that allows unshare) and writable cgroup memory and pids controllers "
    "(run as root, or delegate a cgroup v2 subtree to this user); or pass --unsafe-sandbox "
    "(config unsafe_sandbox: true) to run model-written code without these protections"
)
_gaps_already_logged: set[tuple[str, ...]] = set()


class SandboxUnavailable(ConfigError):
    """The sandbox cannot isolate code on this machine; the message names what is missing and how to allow it."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. `exit_status` follows subprocess: negative means killed by that signal.

    `isolation` maps each protection in PROTECTIONS to what the child verified: a sentence that starts with
    "yes", or with "no" followed by the reason (only ever seen in unsafe mode).
    """

    stdout: str
    stderr: str
    exit_status: int
    timed_out: bool
    output_truncated: bool
    isolation: dict[str, str]

    def enforced(self, protection: str) -> bool:
        return self.isolation.get(protection, "no").startswith("yes")


class PythonSandbox:
    """Runs untrusted Python code; see the module docstring for the layers. Thread-safe: one process per run.

    `memory_bytes` bounds the whole run (every process together) and each process's address space;
    `max_processes` the processes of the whole run; `max_disk_bytes` / `max_files` its work dir.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        cpu_seconds: int = 10,
        memory_bytes: int = 1 << 30,
        max_processes: int = 64,
        max_open_files: int = 64,
        max_file_bytes: int = 16 << 20,
        max_output_bytes: int = 64 << 10,
        max_disk_bytes: int = 64 << 20,
        max_files: int = 4096,
        python: str = sys.executable,
        unsafe: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        positive_ints = {
            "cpu_seconds": cpu_seconds,
            "memory_bytes": memory_bytes,
            "max_processes": max_processes,
            "max_open_files": max_open_files,
            "max_file_bytes": max_file_bytes,
            "max_output_bytes": max_output_bytes,
            "max_disk_bytes": max_disk_bytes,
            "max_files": max_files,
        }
        for name, value in positive_ints.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"python must be an executable interpreter path, got {python!r}")
        self.timeout_s = float(timeout_s)
        self.cpu_seconds = cpu_seconds
        self.memory_bytes = memory_bytes
        self.max_processes = max_processes
        self.max_open_files = max_open_files
        self.max_file_bytes = max_file_bytes
        self.max_output_bytes = max_output_bytes
        self.max_disk_bytes = max_disk_bytes
        self.max_files = max_files
        self.python = os.path.abspath(python)
        self.unsafe = unsafe

    def check(self) -> SandboxResult:
        """Run a trivial program; raises SandboxUnavailable (strict mode) when the machine cannot isolate it.
        The trainer calls this at start-up so a run that uses the Python tool fails before training starts."""
        result = self.run("print('ok')")
        if result.stdout != "ok\n":
            raise SandboxUnavailable(f"the sandbox could not run a trivial program: {result.stderr.strip()[-300:]}")
        return result

    def run(self, code: str) -> SandboxResult:
        if not isinstance(code, str):
            raise ValueError(f"code must be a str, got {type(code).__name__}")
        cgroup = RunCgroup.create(self.memory_bytes, self.max_processes + _RUN_OWN_PROCESSES)
        try:
            result, host_workdir = self._execute(code, cgroup)
        finally:
            if isinstance(cgroup, RunCgroup):
                cgroup.remove()
        if host_workdir is not None:
            remove_tree(host_workdir)
        _log_gaps_once(result.isolation)
        return result

    def _execute(self, code: str, cgroup: RunCgroup | str) -> tuple[SandboxResult, str | None]:
        report_read, report_write = os.pipe()
        # surrogatepass keeps odd model output byte-faithful; the interpreter then reports it as a SyntaxError.
        code_bytes = code.encode("utf-8", errors="surrogatepass")
        code_fd = os.memfd_create("copes-sandbox-code", 0)
        os.write(code_fd, code_bytes)
        config = {
            "unsafe": self.unsafe,
            "python": self.python,
            "run_uid": _pick_sandbox_uid(),
            "report_fd": report_write,
            "code_fd": code_fd,
            "code_bytes": len(code_bytes),
            "cgroup": None if isinstance(cgroup, str) else {
                "procs_files": cgroup.procs_files, "memory": cgroup.memory, "pids": cgroup.pids},
            "cgroup_unavailable": cgroup if isinstance(cgroup, str) else None,
            "caller_namespaces": sandbox_child.namespace_ids(),
            "caller_keyring": sandbox_child.session_keyring_id(),
            "disk_bytes": self.max_disk_bytes,
            "max_files": self.max_files,
            "rlimits": self._rlimits(),
            "environment": self._environment(),
            **_root_layout(self.python),
        }
        try:
            process = subprocess.Popen(
                [self.python, "-I", "-S", CHILD_SCRIPT, json.dumps(config)],
                cwd="/",
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(report_write, code_fd),
            )
        except BaseException:
            os.close(report_read)
            raise
        finally:
            os.close(report_write)
            os.close(code_fd)
        with os.fdopen(report_read, "rb") as report_pipe:
            try:
                stdout, stderr, timed_out, truncated = self._collect_output(process)
            finally:
                _stop(process)
                process.stdout.close()
                process.stderr.close()
            report = _parse_report(report_pipe.read())
        if not report["isolation"].get("pid_namespace", "no").startswith("yes"):
            _kill_group(process)  # without a pid namespace, children may still run in the bootstrap's group
        isolation = report["isolation"]
        missing = [name for name in PROTECTIONS if not isolation.get(name, "no").startswith("yes")]
        if missing and not self.unsafe:
            refused = [name for name in missing if name in isolation]
            why = "; ".join(f"{name} ({isolation[name]})" for name in refused)
            if not refused:  # the bootstrap itself failed: its traceback says why
                said = stderr.decode(errors="replace").strip()[-300:]
                why = f"{', '.join(missing)} not checked; the bootstrap said: {said!r}"
            raise SandboxUnavailable(f"the Python sandbox cannot isolate code on this machine: {why}. "
                                     f"To allow it: {_HOW_TO_ALLOW}")
        result = SandboxResult(
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            exit_status=report.get("exit_status", process.returncode),
            timed_out=timed_out,
            output_truncated=truncated,
            isolation=report["isolation"] or {"bootstrap": "no: the sandbox bootstrap reported nothing"},
        )
        return result, report.get("host_workdir")

    def _collect_output(self, process: subprocess.Popen) -> tuple[bytes, bytes, bool, bool]:
        """Read both pipes in chunks until EOF, the wall-clock deadline, or the output cap, whichever is first."""
        deadline = time.monotonic() + self.timeout_s
        buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
        timed_out = truncated = False
        with selectors.DefaultSelector() as selector:
            for fd in buffers:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and not truncated:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(remaining):
                    chunk = os.read(key.fd, _READ_CHUNK_BYTES)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    buffer = buffers[key.fd]
                    room = self.max_output_bytes - len(buffer)
                    buffer += chunk[:room]
                    truncated |= len(chunk) > room
        if not (timed_out or truncated):
            # Both pipes are closed; the bootstrap exits right after its children, unless something keeps it alive.
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
        stdout, stderr = buffers.values()
        return bytes(stdout), bytes(stderr), timed_out, truncated

    def _rlimits(self) -> dict[str, int]:
        return {
            "cpu_seconds": self.cpu_seconds,
            "memory_bytes": self.memory_bytes,
            # Counted per uid inside the run's own user namespace; the pids cgroup is the whole-run limit.
            "processes": self.max_processes + _RUN_OWN_PROCESSES,
            "open_files": self.max_open_files,
            "file_bytes": self.max_file_bytes,
        }

    def _environment(self) -> dict[str, str]:
        return {
            "PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Unbuffered, so what the code printed before a timeout kill still reaches the caller.
            "PYTHONUNBUFFERED": "1",
            "PYTHONIOENCODING": "utf-8",
            # One BLAS/OpenMP thread: thread pools reserve address space and count against the process limit.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
        }


def _root_layout(python: str) -> dict:
    """What the child's fresh root holds: read-only binds of the interpreter's install, its virtualenv and
    site-packages, the system libraries; the host's top-level symlinks (/lib -> usr/lib); nothing else."""
    interpreter = os.path.realpath(python)
    paths = {os.path.dirname(os.path.dirname(interpreter)), sys.base_prefix, sys.prefix}
    if interpreter == os.path.realpath(sys.executable):
        paths.update(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
        paths.update(entry for entry in sys.path if entry.endswith(("site-packages", "dist-packages")))
    paths.update(_LIBRARY_PATHS)
    real = sorted({os.path.realpath(path) for path in paths if os.path.exists(path)})
    # Drop paths inside another bound path: the outer bind already shows them.
    binds = [path for path in real if not any(path.startswith(other + "/") for other in real if other != path)]
    symlinks = {f"/{entry}": os.readlink(f"/{entry}") for entry in os.listdir("/") if os.path.islink(f"/{entry}")}
    symlinks = {link: target for link, target in symlinks.items()
                if any(f"{bind}/".startswith(os.path.realpath(link) + "/") for bind in binds)}
    top_level = {path.split("/")[1] for path in [*binds, *symlinks]} | {"dev", "proc", "tmp",
                                                                         sandbox_child.WORKDIR.split("/")[1]}
    return {"binds": binds, "symlinks": symlinks, "top_level": sorted(top_level)}


def _pick_sandbox_uid() -> int | None:
    """A fresh uid for this run, or None when we cannot switch to one: not root, or root of a user namespace
    (rootless container) whose uid map does not cover the range."""
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/uid_map").read_text().splitlines():
        inside, _outside, count = map(int, line.split())
        if inside <= _SANDBOX_UIDS.start and inside + count >= _SANDBOX_UIDS.stop:
            return secrets.choice(_SANDBOX_UIDS)
    return None


def _stop(process: subprocess.Popen) -> None:
    """End the run and return once every process of it is gone (see the child's `main` for SIGTERM)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(process)
    process.wait()


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _parse_report(raw: bytes) -> dict:
    """Merge the JSON lines the bootstrap, init and user child wrote on the report pipe."""
    report: dict = {"isolation": {}}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        entry = json.loads(line)
        report["isolation"].update(entry.pop("isolation", {}))
        report.update(entry)
    return report


def _log_gaps_once(isolation: dict[str, str]) -> None:
    gaps = tuple(f"{name} ({status})" for name, status in sorted(isolation.items()) if not status.startswith("yes"))
    if gaps and gaps not in _gaps_already_logged:
        _gaps_already_logged.add(gaps)
        logger.warning("UNSAFE Python sandbox: model-written code runs WITHOUT these protections: %s", "; ".join(gaps))


def remove_tree(path: str) -> None:
    """Delete a directory tree the code controlled; never raises and never recurses (the code may nest
    directories thousands deep or chmod them to 000), so a failure only leaves files behind, logged."""
    try:
        _remove_tree_iteratively(path)
    except OSError as error:
        logger.warning("sandbox: could not remove %s: %s", path, error)


def _remove_tree_iteratively(path: str) -> None:
    # One open directory at a time, walked by file descriptor, so neither depth nor path length matters.
    names: list[str] = []  # the directories we descended through, below `path`
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        while True:
            with os.scandir(fd) as entries:
                entry = next(entries, None)
            if entry is None:
                if not names:
                    break
                parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(names.pop(), dir_fd=fd)
            elif entry.is_dir(follow_symlinks=False):
                os.chmod(entry.name, 0o700, dir_fd=fd)
                child = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
                names.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)
