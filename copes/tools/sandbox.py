"""A real Python sandbox for the agent's code tool.

`PythonSandbox.run(code)` executes untrusted code in a fresh interpreter wrapped in every protection this
machine lets us enforce, and reports which ones were in force (`SandboxResult.isolation`), never pretending:

    caller --Popen--> bootstrap  (this file run as a script: new session, scrubbed env, stdin closed, pipes)
                        unshare(NET | NS | PID): private network (no interface up), mount table, pid numbering
                        fork --> init  (pid 1 of the new pid namespace)
                                   every mount read-only except the private work dir; a fresh /proc
                                   fork --> user code: rlimits, drop to a per-run uid, exec python main.py

Why a bootstrap script and not `preexec_fn`: preexec_fn is unsafe when the caller runs threads (the agent loop
calls tools from threads), and namespaces must be entered while still privileged, whereas `Popen(user=...)`
drops privileges before preexec_fn runs.
Why a pid namespace: when its pid 1 dies the kernel kills every process in it, so ending the run (SIGKILL to that
pid 1) also ends children that called setsid() to leave the process group (fork bombs, daemons).
Why a fresh uid per run rather than `nobody`: RLIMIT_NPROC counts processes per real uid, so a uid of its own
makes `max_processes` bound this run alone, and concurrent runs cannot signal or read one another.
A caller that cannot switch uid (not root, or root of a rootless container) gets the namespaces through a user
namespace when the kernel allows one, mapped to a non-zero uid so the exec drops every capability; RLIMIT_NPROC
is then shared with the caller's own processes (said in `isolation`). The code always runs with no_new_privs.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

logger = logging.getLogger(__name__)

# Flags from <sched.h> and <sys/mount.h>; Python 3.11 has no os.unshare and no mount wrapper.
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_NO_NEW_PRIVS = 38
# Per-mount flags a read-only remount must carry over: dropping them is refused inside a user namespace
# (they are "locked") and would silently loosen nosuid/nodev/noexec elsewhere.
_PRESERVED_MOUNT_FLAGS = {
    "nosuid": 0x2,
    "nodev": 0x4,
    "noexec": 0x8,
    "noatime": 0x400,
    "nodiratime": 0x800,
    "relatime": 0x200000,
    "strictatime": 0x1000000,
}
_PROC_MOUNT_FLAGS = 0x2 | 0x4 | 0x8  # nosuid, nodev, noexec

# Per-run uids come from a range no distribution allocates, so a collision with a real account is implausible.
_SANDBOX_UIDS = range(1_000_000_000, 2_000_000_000)
# The id a root caller that cannot switch uid (rootless container) is mapped to in its user namespace.
_NOBODY = 65534
_READ_CHUNK_BYTES = 64 << 10
# Exit codes of the bootstrap itself, distinct from anything the user's interpreter returns for normal errors.
_EXIT_SETUP_FAILED = 125
_EXIT_EXEC_FAILED = 127
# How long the bootstrap may take to tear the run down after SIGTERM before its whole group gets SIGKILL.
_STOP_GRACE_S = 5.0
_gaps_already_logged: set[tuple[str, ...]] = set()


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. `exit_status` follows subprocess: negative means killed by that signal.

    `isolation` maps each protection ("user", "network", "filesystem", "pid_namespace", "process_limit",
    "rlimits") to a sentence that starts with "yes", or with "no"/"partial" followed by the reason.
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
    """Runs untrusted Python code; see the module docstring for the layers. Thread-safe: one process per run."""

    def __init__(
        self,
        timeout_s: float = 10.0,
        cpu_seconds: int = 10,
        memory_bytes: int = 1 << 30,
        max_processes: int = 64,
        max_open_files: int = 64,
        max_file_bytes: int = 16 << 20,
        max_output_bytes: int = 64 << 10,
        python: str = sys.executable,
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
        self.python = os.path.abspath(python)

    def run(self, code: str) -> SandboxResult:
        if not isinstance(code, str):
            raise ValueError(f"code must be a str, got {type(code).__name__}")
        workdir = Path(tempfile.mkdtemp(prefix="copes_sandbox_")).resolve()
        try:
            # surrogatepass keeps odd model output byte-faithful; the interpreter then reports it as a SyntaxError.
            (workdir / "main.py").write_bytes(code.encode("utf-8", errors="surrogatepass"))
            sandbox_uid = _pick_sandbox_uid()
            if sandbox_uid is not None:
                os.chown(workdir, sandbox_uid, sandbox_uid)
                os.chown(workdir / "main.py", sandbox_uid, sandbox_uid)
            result = self._execute(workdir, sandbox_uid)
        finally:
            _remove_tree(workdir)
        _log_gaps_once(result.isolation)
        return result

    def _execute(self, workdir: Path, sandbox_uid: int | None) -> SandboxResult:
        report_read, report_write = os.pipe()
        config = {
            "workdir": str(workdir),
            "python": self.python,
            "uid": sandbox_uid,
            "report_fd": report_write,
            "rlimits": self._rlimits(sandbox_uid),
            "interpreter_paths": self._interpreter_paths(),
        }
        try:
            process = subprocess.Popen(
                [self.python, "-I", "-S", os.path.abspath(__file__), json.dumps(config)],
                cwd=workdir,
                env=self._environment(workdir),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(report_write,),
            )
        except BaseException:
            os.close(report_read)
            raise
        finally:
            os.close(report_write)
        with os.fdopen(report_read, "rb") as report_pipe:
            try:
                stdout, stderr, timed_out, truncated = self._collect_output(process)
            finally:
                _stop(process)
                process.stdout.close()
                process.stderr.close()
            report = _parse_report(report_pipe.read())
        if not report.get("isolation", {}).get("pid_namespace", "no").startswith("yes"):
            _kill_group(process)  # without a pid namespace, children may still run in the bootstrap's group
        exit_status = report.get("exit_status", process.returncode)
        return SandboxResult(
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            exit_status=exit_status,
            timed_out=timed_out,
            output_truncated=truncated,
            isolation=report.get("isolation", {"bootstrap": "no: the sandbox bootstrap reported nothing"}),
        )

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

    def _rlimits(self, sandbox_uid: int | None) -> dict[str, int]:
        if sandbox_uid is not None:
            process_limit = self.max_processes
        else:
            # Same uid as the caller: the count includes the caller's processes, so allow them on top.
            process_limit = _count_processes_of_uid(os.getuid()) + self.max_processes
        return {
            "cpu_seconds": self.cpu_seconds,
            "memory_bytes": self.memory_bytes,
            "processes": process_limit,
            "open_files": self.max_open_files,
            "file_bytes": self.max_file_bytes,
        }

    def _interpreter_paths(self) -> list[str]:
        """Where the sandboxed interpreter reads from: its install prefix, and for our own interpreter also the
        import path (site-packages, editable installs such as this package)."""
        interpreter = os.path.realpath(self.python)
        paths = {interpreter, os.path.dirname(os.path.dirname(interpreter))}
        if interpreter == os.path.realpath(sys.executable):
            paths.update([sys.prefix, sys.base_prefix, *(entry for entry in sys.path if os.path.isabs(entry))])
        return sorted(path for path in paths if os.path.exists(path))

    def _environment(self, workdir: Path) -> dict[str, str]:
        return {
            "PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Unbuffered, so what the code printed before a timeout kill still reaches the caller.
            "PYTHONUNBUFFERED": "1",
            "PYTHONIOENCODING": "utf-8",
            # One BLAS/OpenMP thread: thread pools reserve address space and count against RLIMIT_NPROC.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
        }


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
    """End the run and return once every process of it is gone (see `_bootstrap` for how SIGTERM is handled)."""
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
    if not report["isolation"]:
        del report["isolation"]
    return report


def _log_gaps_once(isolation: dict[str, str]) -> None:
    gaps = tuple(f"{name} ({status})" for name, status in sorted(isolation.items()) if not status.startswith("yes"))
    if gaps and gaps not in _gaps_already_logged:
        _gaps_already_logged.add(gaps)
        logger.warning("Python sandbox: protections not fully in force on this machine: %s", "; ".join(gaps))


def _count_processes_of_uid(uid: int) -> int:
    count = 0
    for status_path in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status_path.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue  # the process ended while we looked
        count += int(uid_line.split()[1]) == uid
    return count


def _remove_tree(path: Path) -> None:
    def make_writable_and_retry(function, failed_path, _exc_info) -> None:
        # The code may have chmod-ed its own directories to 000; as root this never triggers.
        os.chmod(os.path.dirname(failed_path), 0o700)
        if os.path.isdir(failed_path):
            os.chmod(failed_path, 0o700)
        function(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)


# ---------------------------------------------------------------------------------------------------------
# Everything below runs in the bootstrap process (`python -I -S sandbox.py CONFIG`), never in the caller.
# ---------------------------------------------------------------------------------------------------------


def _libc_call(libc: ctypes.CDLL, function: str, *args) -> None:
    if getattr(libc, function)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{function}{args!r}: {os.strerror(errno)}")


def _unshare(libc: ctypes.CDLL, flags: int) -> str | None:
    """Enter new namespaces; returns None on success or the reason it was refused."""
    try:
        _libc_call(libc, "unshare", ctypes.c_int(flags))
    except OSError as error:
        return os.strerror(error.errno)
    return None


def _mount(
    libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    _libc_call(libc, "mount", encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))


def _enter_user_namespace(libc: ctypes.CDLL, inside_id: int) -> str | None:
    """Enter a new user namespace, where we hold the capabilities the other namespaces need, with our uid and gid
    mapped to `inside_id`. That id is not 0 on purpose: exec of a non-root uid clears every capability, so the
    code cannot undo the read-only mounts. Returns None on success or the reason it was refused."""
    uid, gid = os.geteuid(), os.getegid()
    refused = _unshare(libc, CLONE_NEWUSER)
    if refused:
        return refused
    try:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{inside_id} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{inside_id} {gid} 1")
    except OSError as error:
        return f"id maps refused: {error.strerror}"
    return None


def _mounts() -> list[tuple[str, int, bool]]:
    """(mount point, per-mount flags to preserve, read-only) for every mount, parents before children."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        options = fields[5].split(",")
        flags = 0
        for option in options:
            flags |= _PRESERVED_MOUNT_FLAGS.get(option, 0)
        mounts.append((mount_point, flags, "ro" in options))
    return mounts


def _open_closed_directories(libc: ctypes.CDLL, needed_paths: list[str]) -> list[str]:
    """Let the dropped uid reach the interpreter when it lives under a directory others cannot search (a pyenv
    under /root, mode 700): in this mount namespace only, such a directory is covered by an empty tmpfs holding
    bind mounts of just the entries on the way to the needed paths. Returns the entries made reachable."""
    wanted: dict[Path, set[str]] = {}
    for needed in needed_paths:
        parts = Path(needed).parts
        for depth in range(1, len(parts)):
            directory = Path(*parts[:depth])
            if not os.stat(directory).st_mode & 0o001:
                wanted.setdefault(directory, set()).add(parts[depth])
    exposed = []
    # Parents first: a deeper closed directory is reached through the bind mounts made for its parent.
    for directory in sorted(wanted, key=lambda path: len(path.parts)):
        handles = {name: os.open(directory / name, os.O_PATH) for name in sorted(wanted[directory])}
        try:
            _mount(libc, "tmpfs", str(directory), "tmpfs", 0, "mode=755,size=64k")
            for name, handle in handles.items():
                entry = directory / name
                if os.path.isdir(f"/proc/self/fd/{handle}"):
                    entry.mkdir()
                else:
                    entry.touch()
                _mount(libc, f"/proc/self/fd/{handle}", str(entry), None, MS_BIND | MS_REC)
                exposed.append(str(entry))
        finally:
            for handle in handles.values():
                os.close(handle)
    return exposed


def _make_filesystem_read_only(libc: ctypes.CDLL, config: dict, fresh_proc: bool) -> str:
    """In the private mount namespace: remount everything read-only except the work dir; returns the verdict."""
    workdir = config["workdir"]
    # Private first: otherwise mount events would propagate back to the caller's namespace.
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    # A bind mount of the work dir onto itself is a mount of its own, left writable when its parent turns ro.
    _mount(libc, workdir, workdir, None, MS_BIND)
    notes = []
    if config["uid"] is not None:
        exposed = _open_closed_directories(libc, config["interpreter_paths"])
        if exposed:
            notes.append(f"closed directories hidden except {', '.join(exposed)} (the interpreter lives there)")
    if fresh_proc:
        try:
            _mount(libc, "proc", "/proc", "proc", _PROC_MOUNT_FLAGS)
        except OSError as error:
            notes.append(f"/proc of the pid namespace not mounted ({error.strerror}), the caller's /proc is visible")
    failed = []
    for mount_point, flags, read_only in _mounts():
        if read_only or mount_point == workdir:
            continue
        try:
            _mount(libc, None, mount_point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as error:
            failed.append(f"{mount_point} ({error.strerror})")
    if failed:
        return "partial: still writable: " + ", ".join(failed)
    return "; ".join(["yes: every mount read-only except the private work dir", *notes])


def _write_report(report_fd: int, entry: dict) -> None:
    os.write(report_fd, (json.dumps(entry) + "\n").encode())


def _set_rlimits(limits: dict[str, int]) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)


def _exec_user_code(config: dict, libc: ctypes.CDLL) -> NoReturn:
    """In the user child: rlimits, give up root, exec the interpreter on main.py. Fails closed."""
    report_fd, limits, uid = config["report_fd"], config["rlimits"], config["uid"]
    try:
        _set_rlimits(limits)
        # no_new_privs: set-uid binaries (su, mount...) and file capabilities no longer grant anything.
        _libc_call(libc, "prctl", ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), *[ctypes.c_ulong(0)] * 3)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            user = f"yes: per-run uid {uid}, gid {uid}, no supplementary groups, no_new_privs"
            process_limit = f"yes: RLIMIT_NPROC={limits['processes']} for a uid of its own"
        else:
            user = (
                f"no: cannot switch uid; the code runs as the caller's uid {config['caller_uid']}, without capabilities"
            )
            process_limit = (
                f"partial: RLIMIT_NPROC={limits['processes']} counts every process of uid {config['caller_uid']}, "
                "the caller's included"
            )
        rlimits = (
            f"yes: cpu {limits['cpu_seconds']} s, address space {limits['memory_bytes'] >> 20} MiB, "
            f"open files {limits['open_files']}, file size {limits['file_bytes'] >> 20} MiB, core 0"
        )
        _write_report(report_fd, {"isolation": {"user": user, "process_limit": process_limit, "rlimits": rlimits}})
        os.set_inheritable(report_fd, False)  # the code must not be able to forge the report
        os.chdir(config["workdir"])
    except BaseException:  # a forked child must end here, with a code the caller can tell apart
        traceback.print_exc()
        os._exit(_EXIT_SETUP_FAILED)
    python = config["python"]
    try:
        os.execve(python, [python, "-s", "main.py"], os.environ)
    except OSError as error:
        print(f"sandbox: cannot start {python}: {error.strerror}", file=sys.stderr)
    os._exit(_EXIT_EXEC_FAILED)


def _run_init(
    config: dict, libc: ctypes.CDLL, isolation: dict[str, str], mounts_refused: str | None, pid_namespace: bool
) -> NoReturn:
    """pid 1 of the run: lock the filesystem, start the user child, reap every orphan until it exits."""
    report_fd = config["report_fd"]
    try:
        try:
            if mounts_refused is not None:
                raise OSError(f"unshare(NEWNS): {mounts_refused}")
            isolation["filesystem"] = _make_filesystem_read_only(libc, config, fresh_proc=pid_namespace)
        except OSError as error:
            isolation["filesystem"] = (
                f"no: {error}; writes are limited only by file permissions "
                "(world-writable directories such as /tmp stay writable)"
            )
        _write_report(report_fd, {"isolation": isolation})
        user_pid = os.fork()
        if user_pid == 0:
            _exec_user_code(config, libc)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == user_pid:
                break
        _write_report(report_fd, {"exit_status": os.waitstatus_to_exitcode(status)})
    except BaseException:  # a forked child must end here, with a code the caller can tell apart
        traceback.print_exc()
        os._exit(_EXIT_SETUP_FAILED)
    os._exit(0)


def _bootstrap(config: dict) -> NoReturn:
    libc = ctypes.CDLL(None, use_errno=True)
    isolation: dict[str, str] = {}
    config["caller_uid"] = os.geteuid()
    if config["uid"] is None:
        inside_id = os.geteuid() or _NOBODY
        refused = _enter_user_namespace(libc, inside_id)
        isolation["user_namespace"] = (
            f"yes: caller mapped to uid {inside_id} of a user namespace" if refused is None else f"no: {refused}"
        )
    refused = _unshare(libc, CLONE_NEWNET)
    isolation["network"] = (
        "yes: private network namespace, no interface up" if refused is None else f"no: unshare(NEWNET): {refused}"
    )
    mounts_refused = _unshare(libc, CLONE_NEWNS)
    pid_refused = _unshare(libc, CLONE_NEWPID)
    isolation["pid_namespace"] = (
        "yes: every process of the run dies with it"
        if pid_refused is None
        else f"no: unshare(NEWPID): {pid_refused}; processes that leave the process group can outlive the run"
    )
    init_pid = os.fork()
    if init_pid == 0:
        _run_init(config, libc, isolation, mounts_refused, pid_namespace=pid_refused is None)

    def end_the_run(_signum: int, _frame: object) -> None:
        if pid_refused is None:
            # The kernel kills every process of a pid namespace whose pid 1 dies, and that pid 1 is only reaped
            # once they are all gone: waiting for it below means the caller never sees a half-dead run.
            os.kill(init_pid, signal.SIGKILL)
        else:
            os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, end_the_run)
    _, status = os.waitpid(init_pid, 0)
    if os.WIFSIGNALED(status):  # die the same way, so the caller's returncode says which signal ended the run
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    _bootstrap(json.loads(sys.argv[1]))
