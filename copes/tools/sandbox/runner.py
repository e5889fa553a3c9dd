"""A real Python sandbox for the agent's code tool, built for code written by a policy that is rewarded for
right answers and so learns to look for them.

`PythonSandbox.run(code)` starts `sandbox_child.py` (standard library only, `python -I -S`) in a new session
with a scrubbed environment; the child puts every layer in place and checks it from inside (see its docstring):
a whole-run cgroup (memory, pids, CPU time: the caller kills a run whose processes together spend its CPU
budget), a fresh per-run uid (as root) inside its own user namespace that may make no nested one, private network,
mount, IPC, pid and cgroup namespaces, a fresh session keyring, a fresh read-only tmpfs root with only what the
interpreter needs (asked of it; see `_root_layout`), a size-limited work dir, rlimits, no capabilities,
no_new_privs, a seccomp filter (`seccomp.py`), oom_score_adj 1000. docs/sandbox.md has the threat model.

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
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, cached_property, lru_cache
from pathlib import Path
from typing import TypedDict

from copes.errors import ConfigError
from copes.tools.sandbox import child as sandbox_child
from copes.tools.sandbox import landlock, seccomp
from copes.tools.sandbox.cgroups import RunCgroup

logger = logging.getLogger(__name__)

CHILD_SCRIPT = sandbox_child.__file__
# Standard-library modules the bootstrap loads by path (it runs from a memfd, so it has no package to import from).
CHILD_HELPERS = {"seccomp": seccomp.__file__, "landlock": landlock.__file__}
PROTECTIONS = sandbox_child.PROTECTIONS
# Per-run uids come from a range no distribution allocates, so a collision with a real account is implausible.
# "auto": namespaces where user namespaces can be had, else Landlock; "landlock": Landlock even where they can.
TIERS = ("auto", "landlock")
_SANDBOX_UIDS = range(1_000_000_000, 2_000_000_000)
# System library directories the interpreter and compiled extensions load from (never data).
_LIBRARY_PATHS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")
# Host directories the new root may be assembled on (covered only inside the run's own mount namespace): the first
# that holds none of what the root binds, so covering it hides no bind source.
_STAGING_CANDIDATES = ("/tmp", "/mnt", "/media", "/srv", "/opt", "/var/tmp", "/run", "/home", "/boot")
_READ_CHUNK_BYTES = 64 << 10
# How often the caller reads the run's CPU time while it runs, and, in the Landlock tier, its work dir's size (a
# tmpfs writer fills about 1 GB/s here: 10 ms lets it past max_disk_bytes by some 10 MB before it is killed).
_CPU_POLL_S = 0.05
_DISK_POLL_S = 0.01
# The bootstrap and init processes of a run count against its pids limit too.
_RUN_OWN_PROCESSES = 2
# How long the bootstrap may take to tear the run down after SIGTERM before its whole group gets SIGKILL.
_STOP_GRACE_S = 5.0
_HOW_TO_ALLOW = (
    "the sandbox needs user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1; "
    "in Docker a seccomp profile that allows unshare) or, without them, Landlock (kernel 5.13+, landlock in the "
    "lsm= boot parameter), and writable cgroup memory and pids controllers "
    "(run as root, or delegate a cgroup v2 subtree to this user); or pass --unsafe-sandbox "
    "(config unsafe_sandbox: true) to run model-written code without these protections"
)
_gaps_already_logged: set[tuple[str, ...]] = set()


class RootLayout(TypedDict):
    """The part of the child's configuration that describes its new root (see `_root_layout`)."""

    binds: list[str]
    symlinks: dict[str, str]
    top_level: list[str]
    staging: str


@dataclass
class _Collected:
    """What `_collect_output` read, and why it stopped early if it did."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    report: bytes = b""
    timed_out: bool = False
    truncated: bool = False
    cpu_exceeded: bool = False
    disk_exceeded: bool = False


class _SharedMemoryReservations:
    """The /dev/shm bytes this process's runs may hold: each run's max_disk_bytes, from its start until its work
    dir is removed. A Landlock-tier run starts only where /dev/shm has room for its own and all of these."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reserved = 0

    def reserve(self, size: int) -> int:
        """Reserve `size` bytes; returns what the other runs hold."""
        with self._lock:
            others = self._reserved
            self._reserved += size
            return others

    def release_after(self, removals: list[Future], size: int) -> None:
        """Release `size` bytes once every removal is done (the remover runs them in order: the last one last)."""
        if removals:
            removals[-1].add_done_callback(lambda _: self._release(size))
        else:
            self._release(size)

    def _release(self, size: int) -> None:
        with self._lock:
            self._reserved -= size


_shared_memory = _SharedMemoryReservations()


class SandboxUnavailable(ConfigError):
    """The sandbox cannot isolate code on this machine; the message names what is missing and how to allow it."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. `exit_status` follows subprocess: negative means killed by that signal.

    `isolation` maps each protection in PROTECTIONS to what the child verified: a sentence that starts with
    "yes", or with "no" followed by the reason (only ever seen in unsafe mode). `tier` names how the run was
    isolated: "namespaces", "landlock", or "none" (unsafe mode where neither could be had).
    `cpu_budget_exceeded`: the run's processes together used up its CPU budget and the run was killed.
    `disk_quota_exceeded`: the Landlock tier's work dir (with the run's shared memory) outgrew `max_disk_bytes` and
    the run was killed (the namespaces tier's work dir is a tmpfs of that size: writes past it get ENOSPC).
    """

    stdout: str
    stderr: str
    exit_status: int
    timed_out: bool
    output_truncated: bool
    isolation: dict[str, str]
    tier: str = "none"
    cpu_budget_exceeded: bool = False
    disk_quota_exceeded: bool = False

    def enforced(self, protection: str) -> bool:
        return self.isolation.get(protection, "no").startswith("yes")


class PythonSandbox:
    """Runs untrusted Python code; see the module docstring for the layers. Thread-safe: one process per run.

    `memory_bytes` bounds the whole run (every process together) and each process's address space;
    `max_processes` the processes of the whole run; `max_disk_bytes` / `max_files` its work dir; `cpu_seconds`
    each process (RLIMIT_CPU, SIGXCPU), and `cpu_seconds + 1` (the per-process hard limit) the whole run.
    `tier` (TIERS) picks how the run is isolated.
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
        tier: str = "auto",
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
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
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
        self.tier = tier

    @cached_property
    def _layout(self) -> RootLayout:
        return _root_layout(self.python)

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
        host_workdirs: list[str] = []  # filled as soon as the report names one, so a refused run leaves none
        reserved_by_others = _shared_memory.reserve(self.max_disk_bytes)
        try:
            result = self._execute(code, cgroup, host_workdirs, reserved_by_others)
        finally:
            if isinstance(cgroup, RunCgroup):
                cgroup.remove()  # first: it kills whatever of the run could still write to the work dir
            # A Landlock work dir keeps its share of /dev/shm until it is removed.
            _shared_memory.release_after([remove_later(path) for path in host_workdirs], self.max_disk_bytes)
        _log_gaps_once(result.isolation)
        return result

    def _execute(self, code: str, cgroup: RunCgroup | str, host_workdirs: list[str],
                 reserved_by_others: int) -> SandboxResult:
        report_read, report_write = os.pipe()
        # surrogatepass keeps odd model output byte-faithful; the interpreter then reports it as a SyntaxError.
        code_bytes = code.encode("utf-8", errors="surrogatepass")
        code_fd = _memfd("copes-sandbox-code", code_bytes)
        config: sandbox_child.ChildConfig = {
            "unsafe": self.unsafe,
            "tier": self.tier,
            "python": self.python,
            "run_uid": _pick_sandbox_uid(),
            "kept_uid_because": None,
            "report_fd": report_write,
            "code_fd": code_fd,
            "code_bytes": len(code_bytes),
            "helpers": CHILD_HELPERS,
            "cgroup": None if isinstance(cgroup, str) else sandbox_child.CgroupConfig(
                procs_files=cgroup.procs_files, memory=cgroup.memory, pids=cgroup.pids),
            "cgroup_unavailable": cgroup if isinstance(cgroup, str) else None,
            "caller_namespaces": sandbox_child.namespace_ids(),
            "caller_keyring": sandbox_child.session_keyring_id(),
            "disk_bytes": self.max_disk_bytes,
            "disk_reserved_by_others": reserved_by_others,
            "max_files": self.max_files,
            "rlimits": self._rlimits(),
            "environment": self._environment(),
            **self._layout,
        }
        # The bootstrap and its configuration come through file descriptors, so /proc/1/cmdline (which the code
        # can read) shows neither this checkout's path nor the cgroup paths and the caller's pid.
        script_fd = _memfd("copes-sandbox-bootstrap", _child_source())
        config_fd = _memfd("copes-sandbox-config", json.dumps(config).encode())
        try:
            process = subprocess.Popen(
                [self.python, "-I", "-S", f"/proc/self/fd/{script_fd}", str(config_fd)],
                cwd="/",
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(report_write, code_fd, script_fd, config_fd),
            )
        except BaseException:
            os.close(report_read)
            raise
        finally:
            for fd in (report_write, code_fd, script_fd, config_fd):
                os.close(fd)
        with os.fdopen(report_read, "rb") as report_pipe:
            try:
                collected = self._collect_output(process, cgroup, report_pipe.fileno())
                _stop(process)
                self._drain_after_stop(process, collected)
            finally:
                _stop(process)  # on an exception above; returns at once when the run is already stopped
                process.stdout.close()
                process.stderr.close()
            report = _parse_report(collected.report + report_pipe.read())
        stdout, stderr = collected.stdout, collected.stderr
        host_workdirs += [report["host_workdir"]] if "host_workdir" in report else []
        if report.get("tier") != "namespaces":
            _kill_group(process)  # without a pid namespace, children may still run in the bootstrap's group
        isolation = report["isolation"]
        if isolation:
            isolation["cpu_budget"] = self._cpu_budget_verdict(cgroup)
        missing = [name for name in PROTECTIONS if not isolation.get(name, "no").startswith("yes")]
        refused = [name for name in missing if name in isolation]
        # Every verdict is sent before the code starts (the child's `_exec_user_code`): a deadline that came with
        # verdicts unsent and none refused came while the sandbox was setting up (a loaded machine), so none of the
        # code ran. That run timed out; the machine can isolate code as well as before.
        stopped_during_setup = bool(collected.timed_out and missing and not refused)
        if missing and not self.unsafe and not stopped_during_setup:
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
            timed_out=collected.timed_out,
            output_truncated=collected.truncated,
            isolation=isolation or ({} if stopped_during_setup else
                                    {"bootstrap": "no: the sandbox bootstrap reported nothing"}),
            tier=report.get("tier", "none"),
            cpu_budget_exceeded=collected.cpu_exceeded,
            disk_quota_exceeded=collected.disk_exceeded,
        )
        return result

    @property
    def run_cpu_seconds(self) -> int:
        """The whole run's CPU budget: one process alone meets its own hard RLIMIT_CPU first."""
        return self.cpu_seconds + 1

    def _cpu_budget_verdict(self, cgroup: RunCgroup | str) -> str:
        if isinstance(cgroup, str):
            return "no: no run cgroup to account the run's CPU time in (see memory)"
        if cgroup.cpu_usage_file is None:
            return (f"yes: {self.run_cpu_seconds} CPU-seconds for the whole run, summed from /proc over the run "
                    f"cgroup's processes every {_CPU_POLL_S * 1000:g} ms (no cgroup CPU counter here); "
                    f"RLIMIT_CPU {self.cpu_seconds} s per process")
        return (f"yes: {self.run_cpu_seconds} CPU-seconds for the whole run, every process together, read from "
                f"cgroup {os.path.basename(cgroup.cpu_usage_file)}; RLIMIT_CPU {self.cpu_seconds} s per process")

    def _collect_output(self, process: subprocess.Popen, cgroup: RunCgroup | str, report_fd: int) -> _Collected:
        """Read both pipes and the report in chunks until EOF, the wall-clock deadline, the output cap, the run's
        CPU budget or (Landlock tier, which the report names before the code starts) its disk quota, whichever is
        first."""
        deadline = time.monotonic() + self.timeout_s
        meter = None if isinstance(cgroup, str) else cgroup
        collected = _Collected()
        buffers = {process.stdout.fileno(): collected.stdout, process.stderr.fileno(): collected.stderr}
        next_cpu_reading = time.monotonic() + _CPU_POLL_S
        poll_s = _CPU_POLL_S
        with selectors.DefaultSelector() as selector:
            for fd in [*buffers, report_fd]:
                selector.register(fd, selectors.EVENT_READ)
            while any(fd in selector.get_map() for fd in buffers) and not collected.truncated:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    collected.timed_out = True
                    break
                for key, _ in selector.select(min(remaining, poll_s)):
                    chunk = os.read(key.fd, _READ_CHUNK_BYTES)
                    if not chunk:
                        selector.unregister(key.fd)
                    elif key.fd == report_fd:
                        collected.report += chunk
                        poll_s = _DISK_POLL_S if b'"tier": "landlock"' in collected.report else poll_s
                    else:
                        self._keep(collected, buffers[key.fd], chunk)
                if meter is None:
                    continue
                if poll_s == _DISK_POLL_S and (meter.shared_memory_bytes() or 0) > self.max_disk_bytes:
                    collected.disk_exceeded = True
                    break
                if time.monotonic() >= next_cpu_reading:
                    next_cpu_reading = time.monotonic() + _CPU_POLL_S
                    used = meter.cpu_seconds_used()
                    if used is not None and used >= self.run_cpu_seconds:
                        collected.cpu_exceeded = True
                        break
        if not (collected.timed_out or collected.truncated or collected.cpu_exceeded or collected.disk_exceeded):
            # Both pipes are closed; the bootstrap exits right after its children, unless something keeps it alive.
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                collected.timed_out = True
        return collected

    def _keep(self, collected: _Collected, buffer: bytearray, chunk: bytes) -> None:
        """Append what fits under the output cap and note whether anything was cut."""
        room = self.max_output_bytes - len(buffer)
        buffer += chunk[:room]
        collected.truncated |= len(chunk) > room

    def _drain_after_stop(self, process: subprocess.Popen, collected: _Collected) -> None:
        """Read what the code wrote before it was stopped but `_collect_output` had not read yet: on a loaded machine
        the reader can wake after the deadline with output waiting. Only what is already in the pipes, so a writer
        that outlived the stop cannot hold the run."""
        for pipe, buffer in ((process.stdout, collected.stdout), (process.stderr, collected.stderr)):
            os.set_blocking(pipe.fileno(), False)
            while not collected.truncated:
                try:
                    chunk = os.read(pipe.fileno(), _READ_CHUNK_BYTES)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                self._keep(collected, buffer, chunk)

    def _rlimits(self) -> sandbox_child.RlimitConfig:
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


# Asked of the interpreter itself (site on, user site off, as the code will run): where its parts are.
_INTERPRETER_FACTS = """
import json, sys, sysconfig
paths = sysconfig.get_paths()
print(json.dumps({"prefix": sys.prefix, "base_prefix": sys.base_prefix, "path": sys.path,
                  "stdlib": [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")],
                  "libdir": sysconfig.get_config_var("LIBDIR")}))
"""


@cache
def _interpreter_facts(python: str) -> dict:
    try:
        completed = subprocess.run([python, "-s", "-c", _INTERPRETER_FACTS], capture_output=True, text=True,
                                   env={"PATH": "/usr/bin:/bin"}, cwd="/", timeout=60, check=True)
        return json.loads(completed.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        raise SandboxUnavailable(f"cannot ask {python} where its standard library and site-packages are: "
                                 f"{error}") from error


def _interpreter_parts(python: str) -> list[str]:
    """What the interpreter needs, no more: itself, its ELF loader, libpython and the shared libraries beside it
    (a conda-style prefix), the standard library, lib-dynload, site-packages (a virtualenv's pyvenv.cfg)."""
    facts = _interpreter_facts(python)
    parts = [python, *facts["stdlib"], *_elf_interpreter(os.path.realpath(python))]
    parts += [entry for entry in facts["path"]
              if entry.endswith(("site-packages", "dist-packages", "lib-dynload")) or entry.endswith(".zip")]
    if facts["prefix"] != facts["base_prefix"]:
        parts.append(os.path.join(facts["prefix"], "pyvenv.cfg"))
    libdir = facts["libdir"] or ""
    system = any(os.path.realpath(libdir).startswith(os.path.realpath(path) + "/") or
                 os.path.realpath(libdir) == os.path.realpath(path) for path in _LIBRARY_PATHS)
    if libdir and not system and os.path.isdir(libdir):
        parts += [os.path.join(libdir, name) for name in sorted(os.listdir(libdir))
                  if name.startswith("lib") and ".so" in name]
    return [*parts, *_LIBRARY_PATHS]


def _elf_interpreter(binary: str) -> list[str]:
    """The ELF loader (PT_INTERP) of a 64-bit little-endian executable: `/lib64/ld-linux-x86-64.so.2`, reached
    through the /lib64 link on Debian."""
    try:
        with open(binary, "rb") as file:
            header = file.read(64)
            if header[:6] != b"\x7fELF\x02\x01":
                return []
            phoff, = struct.unpack_from("<Q", header, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
            file.seek(phoff)
            table = file.read(phentsize * phnum)
            for index in range(phnum):
                kind, = struct.unpack_from("<I", table, index * phentsize)
                if kind == 3:  # PT_INTERP
                    offset, = struct.unpack_from("<Q", table, index * phentsize + 8)
                    size, = struct.unpack_from("<Q", table, index * phentsize + 32)
                    file.seek(offset)
                    return [file.read(size).rstrip(b"\0").decode()]
    except (OSError, struct.error, UnicodeDecodeError):
        pass
    return []


def _resolve(path: str, links: dict[str, str]) -> str:
    """The real path of `path`, adding each symlink met on the way to `links` ({link: target}, the link named by
    its real parent), so the new root can hold the same links."""
    resolved, pending = "/", [part for part in path.split("/") if part]
    for _ in range(256):  # the kernel's own bound on links followed (40) is lower
        if not pending:
            return resolved
        part = pending.pop(0)
        if part == ".":
            continue
        candidate = os.path.dirname(resolved) if part == ".." else os.path.join(resolved, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links[candidate] = target
            pending = [part for part in target.split("/") if part] + pending
            resolved = "/" if target.startswith("/") else resolved
        else:
            resolved = candidate
    raise SandboxUnavailable(f"too many levels of symbolic links in {path}")


def _root_layout(python: str) -> RootLayout:
    """What the child's fresh root holds: read-only binds (real paths) of what the interpreter needs and of the
    system libraries, the symlinks met on the way to them (a venv's bin/python, /lib64 -> usr/lib64, a linked
    venv directory), the host's top-level links into them (/lib -> usr/lib); nothing else."""
    links: dict[str, str] = {}
    real = sorted({_resolve(path, links) for path in _interpreter_parts(python) if os.path.exists(path)})
    # Drop paths inside another bound path: the outer bind already shows them (and the links inside it).
    binds = [path for path in real if not any(path.startswith(other + "/") for other in real if other != path)]
    inside = lambda path: any(path.startswith(bind + "/") for bind in binds)  # noqa: E731
    top_links = {f"/{entry}": os.readlink(f"/{entry}") for entry in os.listdir("/") if os.path.islink(f"/{entry}")}
    links.update({link: target for link, target in top_links.items()
                  if any(f"{bind}/".startswith(os.path.realpath(link) + "/") for bind in binds)})
    symlinks = {link: target for link, target in sorted(links.items()) if not inside(link) and link not in binds}
    top_level = {path.split("/")[1] for path in [*binds, *symlinks]} | {"dev", "proc", "tmp",
                                                                         sandbox_child.WORKDIR.split("/")[1]}
    return RootLayout(binds=binds, symlinks=symlinks, top_level=sorted(top_level), staging=_staging(binds))


def _staging(binds: list[str]) -> str:
    for candidate in _STAGING_CANDIDATES:
        real = os.path.realpath(candidate)
        clear = all(not f"{bind}/".startswith(f"{real}/") and not real.startswith(f"{bind}/") for bind in binds)
        if os.path.isdir(candidate) and not os.path.islink(candidate) and clear:
            return candidate
    raise SandboxUnavailable(f"no directory to assemble the sandbox root on: each of {', '.join(_STAGING_CANDIDATES)} "
                             "is missing or holds part of the interpreter")


@lru_cache(maxsize=1)
def _child_source() -> bytes:
    return Path(CHILD_SCRIPT).read_bytes()


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    return fd


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
        _remove_tree_in_one_pass(path)
    except OSError as error:
        logger.warning("sandbox: could not remove %s: %s", path, error)


def _remove_tree_in_one_pass(path: str) -> None:
    # One open directory at a time, walked by file descriptor, so neither depth nor path length matters; each
    # directory is listed once (files unlinked as the listing streams by), so removal is linear in its entries.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    above: list[tuple[str, list[str]]] = []  # (directory we descended into, its parent's subdirectories left)
    try:
        pending = _unlink_files(fd)
        while pending or above:
            if pending:
                name = pending.pop()
                os.chmod(name, 0o700, dir_fd=fd)  # a directory: the listing said so, and the run is gone
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
                above.append((name, pending))
                pending = _unlink_files(fd)
            else:
                name, pending = above.pop()
                parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _unlink_files(directory_fd: int) -> list[str]:
    """Unlink every entry of the directory but its subdirectories, which it returns."""
    subdirectories = []
    with os.scandir(directory_fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirectories.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=directory_fd)
    return subdirectories


# Work dirs are removed here, one at a time, so a run that filled its work dir with millions of entries costs the
# caller nothing; the executor's thread finishes what is queued before the interpreter exits.
_remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copes-sandbox-cleanup")


def remove_later(path: str) -> Future:
    """Queue `remove_tree(path)` off the caller's critical path; the future says when it is done."""
    return _remover.submit(remove_tree, path)
