"""A cgroup per sandbox run, so memory and process limits hold for the whole run rather than per process.

cgroup v2 is used when the memory and pids controllers can be enabled for children of our cgroup, of its parent
(a trainer started in a leaf of a delegated subtree) or of the hierarchy's root (root on a systemd machine: the
kernel's no-internal-processes rule forbids enabling controllers for children of a cgroup that holds processes,
such as a session's); otherwise cgroup v1 memory and pids hierarchies we can write to (a hybrid setup, as on
this project's machines). Without either, `RunCgroup.create` returns the reason and the strict sandbox refuses
to run. Run cgroups go as close to our own cgroup as allowed, so a container's limits still bound them, and are
removed after the run with everything nested in them; removal never raises.

The run's CPU use is read from the same cgroup where the cpu controller (v2) or a cpuacct hierarchy (v1) can be
had (`cpu_usage_file`), else summed from /proc over the run cgroup's members, for the caller's whole-run budget.
Each run cgroup's name carries the trainer's pid (`copes-sandbox-<pid>-<random>`): the first run of a process
removes those a dead trainer left behind.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import time
from dataclasses import dataclass, field
from functools import lru_cache

logger = logging.getLogger(__name__)
_REMOVE_ATTEMPTS = 50  # x 10 ms: the kernel frees a cgroup a moment after its last process is reaped
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_RUN_NAME = re.compile(r"copes-sandbox-(\d+)-[0-9a-f]+")
_swept: set[tuple[int, str]] = set()  # (our pid, parent directory) already cleaned of dead trainers' leftovers


@dataclass(frozen=True)
class _Hierarchy:
    mount_point: str
    path: str  # our cgroup, relative to the mount point

    @property
    def directory(self) -> str:
        return os.path.join(self.mount_point, self.path.lstrip("/"))


@lru_cache(maxsize=1)
def _hierarchies(pid: int) -> tuple[_Hierarchy | None, dict[str, _Hierarchy]]:
    """(the cgroup v2 hierarchy, {v1 controller: hierarchy}) of process `pid` (the key also invalidates the
    cache in a forked child)."""
    paths = {}
    for line in open(f"/proc/{pid}/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        paths[controllers] = path
    unified, v1 = None, {}
    for line in open(f"/proc/{pid}/mountinfo").read().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, super_options = fields[separator + 1], fields[separator + 3].split(",")
        if fstype == "cgroup2" and "" in paths:
            unified = _Hierarchy(fields[4], paths[""])
        elif fstype == "cgroup":
            for controllers, path in paths.items():
                if controllers and set(controllers.split(",")) <= set(super_options):
                    for controller in controllers.split(","):
                        v1[controller] = _Hierarchy(fields[4], path)
    return unified, v1


def _write(path: str, value: str) -> None:
    with open(path, "w") as file:
        file.write(value)


@dataclass
class RunCgroup:
    """The cgroup directories of one run; `procs_files` are what the run's first process writes its pid to, and
    `memory` / `pids` say (limit file, path the child must see in /proc/self/cgroup, expected value);
    `cpu_usage_file` is the run's CPU time counter (v2 cpu.stat, v1 cpuacct.usage), None where neither exists."""

    directories: list[str]
    procs_files: list[str]
    memory: tuple[str, str, int]
    pids: tuple[str, str, int]
    cpu_usage_file: str | None = None
    # Without a cgroup CPU counter: the last CPU time read from /proc for each process of the run.
    cpu_seen: dict[int, float] = field(default_factory=dict)

    def cpu_seconds_used(self) -> float | None:
        """CPU time of every process of the run so far: the cgroup's counter (dead processes included), else the
        sum of what /proc showed for each member when last read (a process's time after that reading is lost)."""
        if self.cpu_usage_file is None:
            return self._cpu_seconds_from_proc()
        try:
            text = open(self.cpu_usage_file).read()
        except OSError:
            return None
        if self.cpu_usage_file.endswith("cpu.stat"):
            return int(text.split("usage_usec", 1)[1].split()[0]) / 1e6
        return int(text) / 1e9

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> RunCgroup | str:
        """A fresh cgroup with both limits set, or the reason none can be made here."""
        try:
            unified, v1 = _hierarchies(os.getpid())
        except OSError as error:
            return f"cannot read this process's cgroups: {error}"
        name = f"copes-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        reasons = []
        # v2: under our own cgroup, else beside it (a trainer started in a leaf of a delegated subtree), else under
        # the hierarchy's root (root on a systemd machine, whose session cgroup holds processes).
        paths = [] if unified is None else [unified.path, os.path.dirname(unified.path), "/"]
        for path in dict.fromkeys(paths):
            parent = _Hierarchy(unified.mount_point, path)
            made = cls._create_v2(parent, name, memory_bytes, max_processes)
            if isinstance(made, cls):
                return made
            reasons.append(f"cgroup v2: {made}")
        if "memory" in v1 and "pids" in v1:
            made = cls._create_v1(v1["memory"], v1["pids"], v1.get("cpuacct"), name, memory_bytes, max_processes)
            if isinstance(made, cls):
                return made
            reasons.append(f"cgroup v1: {made}")
        else:
            reasons.append("no cgroup v1 memory and pids hierarchies mounted")
        return "; ".join(reasons)

    @classmethod
    def _create_v2(cls, hierarchy: _Hierarchy, name: str, memory_bytes: int, max_processes: int) -> RunCgroup | str:
        parent = hierarchy.directory
        try:
            enabled = open(os.path.join(parent, "cgroup.subtree_control")).read().split()
            if not {"memory", "pids"} <= set(enabled):
                # Refused (EBUSY) when the cgroup holds processes itself (the kernel's no-internal-processes rule).
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        except OSError as error:
            return f"memory and pids controllers not delegated to {parent} ({error.strerror})"
        _remove_leftovers(parent)
        directory = os.path.join(parent, name)
        try:
            os.mkdir(directory)
            _write(os.path.join(directory, "memory.max"), str(memory_bytes))
            _write(os.path.join(directory, "memory.swap.max"), "0")
            _write(os.path.join(directory, "pids.max"), str(max_processes))
        except OSError as error:
            remove_cgroups([directory])
            return f"cannot set limits in {directory} ({error.strerror})"
        member = os.path.join(hierarchy.path, name)
        # cpu.stat's usage_usec is there with or without the cpu controller enabled.
        return cls([directory], [os.path.join(directory, "cgroup.procs")],
                   (os.path.join(directory, "memory.max"), member, memory_bytes),
                   (os.path.join(directory, "pids.max"), member, max_processes),
                   os.path.join(directory, "cpu.stat"))

    @classmethod
    def _create_v1(
        cls, memory: _Hierarchy, pids: _Hierarchy, cpuacct: _Hierarchy | None, name: str, memory_bytes: int,
        max_processes: int,
    ) -> RunCgroup | str:
        memory_dir, pids_dir = os.path.join(memory.directory, name), os.path.join(pids.directory, name)
        cpuacct_dir = None
        if cpuacct is not None and os.access(cpuacct.directory, os.W_OK):
            cpuacct_dir = os.path.join(cpuacct.directory, name)
        made = []
        try:
            for directory in dict.fromkeys(path for path in (memory_dir, pids_dir, cpuacct_dir) if path):
                _remove_leftovers(os.path.dirname(directory))
                os.mkdir(directory)
                made.append(directory)
            _write(os.path.join(memory_dir, "memory.limit_in_bytes"), str(memory_bytes))
            swap_limit = os.path.join(memory_dir, "memory.memsw.limit_in_bytes")
            if os.path.exists(swap_limit):  # swap accounting on: the limit covers swap too
                _write(swap_limit, str(memory_bytes))
            _write(os.path.join(pids_dir, "pids.max"), str(max_processes))
        except OSError as error:
            remove_cgroups(made)
            return f"cannot create a limited cgroup under {memory.directory} and {pids.directory} ({error.strerror})"
        return cls(made, [os.path.join(directory, "cgroup.procs") for directory in made],
                   (os.path.join(memory_dir, "memory.limit_in_bytes"), os.path.join(memory.path, name), memory_bytes),
                   (os.path.join(pids_dir, "pids.max"), os.path.join(pids.path, name), max_processes),
                   cpuacct_dir and os.path.join(cpuacct_dir, "cpuacct.usage"))

    def shared_memory_bytes(self) -> int | None:
        """The run's tmpfs and shared memory pages (memory.stat `shmem`): a work dir on /dev/shm, as the Landlock
        tier's, is charged there. None when it cannot be read."""
        try:
            text = open(os.path.join(os.path.dirname(self.memory[0]), "memory.stat")).read()
        except OSError:
            return None
        return int(text.split("\nshmem ", 1)[1].split()[0]) if "\nshmem " in text else None

    def _cpu_seconds_from_proc(self) -> float:
        try:
            members = open(self.procs_files[0]).read().split()
        except OSError:
            members = []
        for pid in members:
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone: its last reading stays counted
            self.cpu_seen[int(pid)] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime
        return sum(self.cpu_seen.values())

    def remove(self) -> None:
        remove_cgroups(self.directories)


def _remove_leftovers(parent: str) -> None:
    """Remove the run cgroups under `parent` of trainers that died without removing them (once per process)."""
    if (os.getpid(), parent) in _swept:
        return
    _swept.add((os.getpid(), parent))
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = _RUN_NAME.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            remove_cgroups([os.path.join(parent, name)])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    return True


def remove_cgroups(directories: list[str]) -> None:
    """Kill whatever is still inside, then remove the directories and every cgroup nested in them, deepest first
    (code that could write there may have made some); logs instead of raising."""
    for top in directories:
        nested = [os.path.join(path, name) for path, names, _ in os.walk(top, topdown=False) for name in names]
        for directory in [*nested, top]:
            _remove_cgroup(directory)


def _remove_cgroup(directory: str) -> None:
    for _ in range(_REMOVE_ATTEMPTS):
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: processes inside (unsafe mode without a pid namespace), or not yet freed
            _kill_members(directory)
            time.sleep(0.01)
    logger.warning("sandbox: could not remove cgroup %s; it holds processes that would not die", directory)


def _kill_members(directory: str) -> None:
    try:
        pids = open(os.path.join(directory, "cgroup.procs")).read().split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass  # already gone
