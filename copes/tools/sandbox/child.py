"""The sandbox's child side: `python -I -S /proc/self/fd/SCRIPT CONFIG_FD`, started by `PythonSandbox.run`.

Standard library only, on purpose: it runs before any isolation exists, so it must not import site-packages
(or this package) that the code under test could have influenced, and it must start fast. It runs from a memfd
and reads its configuration from another (both closed at once), so /proc/1/cmdline tells the code nothing;
the standard-library helpers it needs (the seccomp filter) it loads by the paths the configuration names.

    bootstrap  oom_score_adj 1000 (the run dies first under memory pressure); join the run's cgroups (whole-run
               memory, pids, CPU accounting) and check them from inside; root: build the new root (below) while
               still root, become a fresh per-run uid; then unshare USER (our uid -> uid 1000 inside), NET, NS,
               IPC, PID, CGROUP, and check every namespace differs from the caller's
      fork --> init (pid 1 of the new pid namespace): a fresh session keyring; a fresh tmpfs root holding only
               read-only binds of what the interpreter needs, /dev/null|zero|urandom, a fresh /proc and a
               size-limited writable work dir; pivot_root into it, check every mount; max_user_namespaces 0 in
               the run's user namespace, so the code can never make one of its own
        fork --> user code: rlimits, every capability dropped (checked), no_new_privs, the seccomp filter
               (checked by calling what it denies), exec python main.py

Every check lands in the report (JSON lines on `report_fd`) as "yes: ..." or "no: ...". In strict mode
(the default) a single "no" ends the run before the code starts: the caller raises SandboxUnavailable.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import platform
import resource
import signal
import socket
import stat
import sys
import tempfile
import traceback
from typing import NamedTuple, NoReturn, TypedDict


class Namespace(NamedTuple):
    flag: int  # CLONE_NEW* of <sched.h>; Python 3.11 has no os.unshare
    proc_entry: str  # its /proc/self/ns entry, to check from inside that it is not the caller's
    protection: str  # the protection it provides (reported as missing when it cannot be had)


# One table of protections: each verified by the child and reported as "yes: ..." or "no: ..." (the caller adds
# cpu_budget); strict mode needs all of them. The namespaces tier gets these from its namespaces.
PROTECTIONS = ("user", "network", "filesystem", "pid_namespace", "ipc", "keyring", "capabilities", "memory",
               "process_limit", "disk", "rlimits", "nested_namespaces", "seccomp", "oom", "cpu_budget",
               "bootstrap_hidden")
NAMESPACES = {
    "user": Namespace(0x10000000, "user", "user"),
    "network": Namespace(0x40000000, "net", "network"),
    "mount": Namespace(0x00020000, "mnt", "filesystem"),
    "ipc": Namespace(0x08000000, "ipc", "ipc"),
    "pid": Namespace(0x20000000, "pid", "pid_namespace"),
    "cgroup": Namespace(0x02000000, "cgroup", "bootstrap_hidden"),
}


class CgroupConfig(TypedDict):
    procs_files: list[str]  # what the run's first process writes its pid to
    memory: tuple[str, str, int]  # (limit file, path the child must see in /proc/self/cgroup, expected value)
    pids: tuple[str, str, int]


class RlimitConfig(TypedDict):
    cpu_seconds: int
    memory_bytes: int
    processes: int | None  # None: leave RLIMIT_NPROC as inherited (it would count the caller's own processes)
    open_files: int
    file_bytes: int


class ChildConfig(TypedDict):
    """What `PythonSandbox.run` hands the bootstrap (as JSON through a memfd)."""

    unsafe: bool
    tier: str  # runner.TIERS
    python: str
    run_uid: int | None  # root: the run's own uid; None: keep the caller's
    report_fd: int
    code_fd: int
    code_bytes: int
    helpers: dict[str, str]  # standard-library helper modules by path: seccomp, landlock
    cgroup: CgroupConfig | None
    cgroup_unavailable: str | None  # why there is no cgroup, when cgroup is None
    caller_namespaces: dict[str, str]
    caller_keyring: int | None
    disk_bytes: int
    disk_reserved_by_others: int  # /dev/shm bytes the caller's other runs may hold (see _shared_memory_room)
    max_files: int
    rlimits: RlimitConfig
    environment: dict[str, str]
    binds: list[str]  # the new root's read-only binds (real paths), see runner._root_layout
    symlinks: dict[str, str]
    top_level: list[str]
    staging: str
    kept_uid_because: str | None  # the Landlock tier, where root cannot switch to run_uid: why


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
# statvfs flags -> mount flags: a read-only remount of a bind must keep these, the kernel locks them in a
# user namespace (and dropping them would loosen nosuid/nodev/noexec).
_LOCKED_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
                 os.ST_NOATIME: 0x400, os.ST_NODIRATIME: 0x800, os.ST_RELATIME: 0x200000}
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEY_SPEC_SESSION_KEYRING = 0, 1, -3
# Syscalls glibc has no wrapper for, per architecture.
SYSCALLS = {"x86_64": {"keyctl": 250, "pivot_root": 155}, "aarch64": {"keyctl": 219, "pivot_root": 41}}
INSIDE_ID = 1000  # the code's uid and gid inside its user namespace: not 0, so exec leaves it no capabilities
WORKDIR = "/sandbox"
OOM_SCORE_ADJ = 1000  # the kernel's maximum: under memory pressure the run is killed before anything else
DEVICES = ("null", "zero", "urandom")
# /proc files a pid namespace does not narrow that count the host's threads and forks (a channel between concurrent
# runs, as sysinfo() is): they read empty. glibc's cpu count falls back to the affinity mask.
HOST_COUNTERS = ("loadavg", "stat")
# Queued signals (real-time ones, and any sent with sigqueue) the whole run may hold: the count is the uid's, so
# it is the run's share of a non-root trainer's RLIMIT_SIGPENDING. Python's own signal handling queues none.
PENDING_SIGNALS = 64
# Tasks a non-root caller keeps of its RLIMIT_NPROC beyond what a run may take: its own next forks and threads.
CALLER_PROCESS_RESERVE = 8
EXIT_UNAVAILABLE = 124  # a required protection is missing; the code never ran
EXIT_SETUP_FAILED = 125
EXIT_EXEC_FAILED = 127

libc = ctypes.CDLL(None, use_errno=True)
SECCOMP = LANDLOCK = None  # the helper modules, loaded by `main`
PR_SET_CHILD_SUBREAPER = 36
# The Landlock tier's work dir goes on this tmpfs where there is one: its pages are charged to the run's memory
# cgroup, so the whole-run memory limit bounds the disk the run can fill.
SHARED_MEMORY = "/dev/shm"


class Refused(OSError):
    """A protection could not be put in place; the message says which call failed and why."""


def _check(result: int, what: str) -> int:
    if result == -1:
        errno = ctypes.get_errno()
        raise Refused(errno, f"{what}: {os.strerror(errno)}")
    return result


def _syscall(name: str, *args: object) -> int:
    number = SYSCALLS.get(platform.machine(), {}).get(name)
    if number is None:
        raise Refused(0, f"{name}: syscall number unknown on {platform.machine()}")
    return _check(libc.syscall(ctypes.c_long(number), *args), name)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else os.fsencode(text)  # noqa: E731
    _check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def session_keyring_id() -> int | None:
    """The serial of the calling process's session keyring, None when it has none (also used by the caller)."""
    try:
        return _syscall("keyctl", ctypes.c_int(KEYCTL_GET_KEYRING_ID), ctypes.c_int(KEY_SPEC_SESSION_KEYRING),
                        ctypes.c_int(0))
    except Refused:
        return None


def namespace_ids() -> dict[str, str]:
    """`user:[4026531837]`-style identities of our namespaces (also used by the caller)."""
    return {name: os.readlink(f"/proc/self/ns/{namespace.proc_entry}") for name, namespace in NAMESPACES.items()}


class Report:
    def __init__(self, fd: int, strict: bool) -> None:
        self.fd, self.strict = fd, strict
        self.isolation: dict[str, str] = {}

    def verdict(self, protection: str, ok: bool, detail: str) -> bool:
        self.isolation[protection] = f"{'yes' if ok else 'no'}: {detail}"
        return ok

    def send(self, **entry: object) -> None:
        os.write(self.fd, (json.dumps({"isolation": self.isolation, **entry}) + "\n").encode())
        self.isolation = {}

    def stop_if_missing(self, missing: list[str]) -> None:
        """Strict mode: end the run before the code starts when anything required is missing."""
        if missing and self.strict:
            self.send(unavailable=missing)
            os._exit(EXIT_UNAVAILABLE)


# ---------------------------------------------------------------- bootstrap: cgroups, identity, namespaces


def _join_cgroups(config: ChildConfig, report: Report) -> list[str]:
    """Enter the run's cgroups before anything forks, so every process of the run is counted; check the limits
    from here (membership in /proc/self/cgroup, the limit files read back)."""
    cgroup = config["cgroup"]
    if cgroup is None:
        reason = config["cgroup_unavailable"]
        report.verdict("memory", False, f"no whole-run memory limit: {reason}")
        report.verdict("process_limit", False, "no whole-run process limit: no cgroup either (see memory)")
        return ["memory", "process_limit"]
    try:
        for procs_file in cgroup["procs_files"]:
            with open(procs_file, "w") as file:
                file.write(str(os.getpid()))
        membership = open("/proc/self/cgroup").read()
        checks = {"memory": cgroup["memory"], "process_limit": cgroup["pids"]}
        missing = []
        for protection, (limit_file, member_path, expected) in checks.items():
            value = open(limit_file).read().strip()
            ok = f":{member_path}\n" in membership and value == str(expected)
            report.verdict(protection, ok, f"cgroup {os.path.basename(limit_file)} = {value} for the whole run, "
                                           f"every process of it inside {member_path}")
            missing += [] if ok else [protection]
        return missing
    except OSError as error:
        report.verdict("memory", False, f"cannot join the run's cgroup: {error}")
        report.verdict("process_limit", False, f"cannot join the run's cgroup: {error}")
        return ["memory", "process_limit"]


def _caller_process_headroom(config: ChildConfig, report: Report) -> list[str]:
    """A non-root caller's runs count against its uid's RLIMIT_NPROC, which counts every task of the uid (the
    trainer's own threads too): a run starts only where its whole pids limit still leaves the caller
    CALLER_PROCESS_RESERVE, so the trainer's next fork never meets EAGAIN because of it. Returns what failed."""
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.getuid() == 0 or limit == resource.RLIM_INFINITY or config["cgroup"] is None:
        return []
    run_tasks = config["cgroup"]["pids"][2]
    used = _tasks_of_uid(os.getuid())
    if limit - used >= run_tasks + CALLER_PROCESS_RESERVE:
        report.isolation["process_limit"] += (f"; the caller's uid runs {used} of its RLIMIT_NPROC {limit} tasks, "
                                              f"leaving it room beside the run's {run_tasks}")
        return []
    report.verdict("process_limit", False, f"the caller's uid {os.getuid()} runs {used} of its RLIMIT_NPROC "
                                           f"{limit} tasks (threads included): a run of up to {run_tasks} would "
                                           f"leave it fewer than {CALLER_PROCESS_RESERVE}; lower max_processes, "
                                           f"run fewer at once or raise ulimit -u")
    return ["process_limit"]


def _tasks_of_uid(uid: int) -> int:
    """Threads of every process whose /proc entry `uid` owns (its effective uid), this one included."""
    tasks = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                tasks += int(open(f"/proc/{entry.name}/stat").read().rsplit(")", 1)[1].split()[17])  # num_threads
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    return tasks


def _become_run_user(config: ChildConfig) -> None:
    """Root: a uid and gid of this run's own, so nothing else on the machine shares them (keyring quotas, signals)."""
    run_id = config["run_uid"]
    if run_id is None:
        return
    os.setgroups([])
    os.setresgid(run_id, run_id, run_id)
    os.setresuid(run_id, run_id, run_id)
    # A uid change makes the process non-dumpable, which makes /proc/self/uid_map root's; we must write it.
    _check(libc.prctl(PR_SET_DUMPABLE, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
           "prctl(PR_SET_DUMPABLE)")


def _enter_namespaces(config: ChildConfig, report: Report) -> list[str]:
    outside_uid, outside_gid = os.geteuid(), os.getegid()
    missing = []
    for name, namespace in NAMESPACES.items():
        try:
            _check(libc.unshare(ctypes.c_int(namespace.flag)), f"unshare({name})")
            if name == "user":
                for path, text in (("setgroups", "deny"), ("uid_map", f"{INSIDE_ID} {outside_uid} 1"),
                                   ("gid_map", f"{INSIDE_ID} {outside_gid} 1")):
                    with open(f"/proc/self/{path}", "w") as file:
                        file.write(text)
        except OSError as error:
            missing.append(name)
            if name == "user":  # without it the other namespaces need privileges we gave up
                report.verdict("user", False, f"{error}; the code would run as uid {outside_uid}")
                for other, namespace in NAMESPACES.items():
                    if other != "user":
                        report.verdict(namespace.protection, False, "needs the user namespace")
                return list(NAMESPACES)
            report.verdict(namespace.protection, False, str(error))
    return missing


def _check_namespaces(config: ChildConfig, report: Report, not_entered: list[str]) -> list[str]:
    """Check from inside that each namespace we entered really is a fresh one; returns those that are not."""
    caller, ours = config["caller_namespaces"], namespace_ids()
    failed = []
    if "network" not in not_entered:
        interfaces = [interface for _, interface in socket.if_nameindex()]
        fresh = ours["network"] != caller["network"] and interfaces == ["lo"]
        if not report.verdict("network", fresh, f"private network namespace {ours['network']}, interfaces: "
                                                f"{', '.join(interfaces)}, all down"):
            failed.append("network")
    if "ipc" not in not_entered:
        fresh = ours["ipc"] != caller["ipc"]
        if not report.verdict("ipc", fresh, f"private System V IPC and POSIX message queues {ours['ipc']}"):
            failed.append("ipc")
    if "user" not in not_entered:
        uid_map = open("/proc/self/uid_map").read().split()
        user_ok = ours["user"] != caller["user"] and uid_map[:1] == [str(INSIDE_ID)] and len(uid_map) == 3
        detail = (f"per-run uid {uid_map[1]} (uid {INSIDE_ID} of its own user namespace)" if config["run_uid"]
                  else f"uid {INSIDE_ID} of its own user namespace, mapped to the caller's uid {uid_map[1]}")
        if not report.verdict("user", user_ok, detail):
            failed.append("user")
    return failed


# ---------------------------------------------------------------- init: keyring, filesystem


def _fresh_keyring(config: ChildConfig, report: Report) -> list[str]:
    try:
        _syscall("keyctl", ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
        ours = session_keyring_id()
    except Refused as error:
        report.verdict("keyring", False, str(error))
        return ["keyring"]
    ok = ours is not None and ours != config["caller_keyring"]
    report.verdict("keyring", ok, f"fresh anonymous session keyring {ours} (the caller's: {config['caller_keyring']})")
    return [] if ok else ["keyring"]


def _make_path(root: str, path: str, like: str) -> str:
    """Create `path` under `root` as an empty file or directory matching the host entry `like`."""
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.isdir(like):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        open(target, "a").close()
    return target


def _bind_read_only(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    locked = 0
    host_flags = os.statvfs(source).f_flag
    for statvfs_flag, mount_flag in _LOCKED_FLAGS.items():
        locked |= mount_flag if host_flags & statvfs_flag else 0
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | locked)


def _build_root(config: ChildConfig) -> None:
    """In a mount namespace of our own: assemble the new root on the staging directory (one that holds nothing
    the root binds, so covering it hides no source), pivot into it, make it read-only.

    Root does this before giving up root, so it can reach an interpreter the run's uid could not (a pyenv under
    /root, mode 700); the user namespace's mount namespace then inherits these mounts locked read-only. On failure
    the staging mount is taken away again, so the host filesystem is as it was (unsafe mode runs there)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the caller
    root = config["staging"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    try:
        _assemble_root(config, root)
    except OSError:
        libc.umount2(os.fsencode(root), ctypes.c_int(MNT_DETACH))
        raise
    os.chdir(root)
    _syscall("pivot_root", b".", b".")  # the old root ends up stacked under the new one; detach it
    _check(libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _assemble_root(config: ChildConfig, root: str) -> None:
    for link, target in config["symlinks"].items():
        os.makedirs(os.path.dirname(root + link), mode=0o755, exist_ok=True)
        os.symlink(target, root + link)
    for path in [*config["binds"], *(f"/dev/{device}" for device in DEVICES)]:
        try:
            _bind_read_only(path, _make_path(root, path, path))
        except OSError as error:
            raise Refused(error.errno, f"cannot bind {path} into the new root: {error.strerror}") from error
    os.symlink("/proc/self/fd", root + "/dev/fd")
    # The kernel mounts a fresh proc (in `_finish_root`) only where a full one is already visible.
    os.makedirs(root + "/proc", mode=0o555)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _make_path(root, WORKDIR, "/")
    # Empty and read-only (unless an interpreter lives below it): code that writes to /tmp fails loudly.
    os.makedirs(root + "/tmp", 0o755, exist_ok=True)


def _finish_root(config: ChildConfig) -> str:
    """In the run's pid and user namespaces: a /proc showing only the run, and the size-limited work dir."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for counters in HOST_COUNTERS:
        _bind_read_only("/dev/null", f"/proc/{counters}")
    _mount("tmpfs", WORKDIR, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={config['disk_bytes']},nr_inodes={config['max_files']},mode=0700,uid={INSIDE_ID},gid={INSIDE_ID}")
    return WORKDIR


def _check_filesystem(config: ChildConfig, report: Report) -> bool:
    """Every mount read-only except the work dir (and /proc, which holds only this run's processes)."""
    writable, seen = [], []
    for line in open("/proc/self/mountinfo").read().splitlines():
        fields = line.split()
        mount_point, options = fields[4], fields[5].split(",")
        seen.append(mount_point)
        if "ro" not in options and mount_point not in (WORKDIR, "/proc"):
            writable.append(mount_point)
    disk = os.statvfs(WORKDIR)
    size_ok = disk.f_blocks * disk.f_frsize <= config["disk_bytes"] and disk.f_files <= config["max_files"]
    ok = not writable and size_ok and sorted(os.listdir("/")) == sorted(config["top_level"])
    detail = (f"fresh tmpfs root with read-only binds of {', '.join(config['binds'])}, "
              f"/dev/{{{','.join(DEVICES)}}} and a fresh /proc; writable: only {WORKDIR}")
    if writable:
        detail += f"; also writable: {', '.join(writable)}"
    report.verdict("filesystem", ok, detail)
    report.verdict("disk", size_ok, f"{WORKDIR} is a tmpfs of {disk.f_blocks * disk.f_frsize >> 20} MiB and "
                                    f"{disk.f_files} inodes for the whole run")
    return ok and size_ok


def _host_workdir(report: Report) -> str:
    """Unsafe mode without a private filesystem: a host temp dir, removed by the caller after the run."""
    path = tempfile.mkdtemp(prefix="copes_sandbox_")
    report.send(host_workdir=path)
    return path


# ---------------------------------------------------------------- user code


def _drop_capabilities() -> str:
    """Empty every capability set, set no_new_privs, and read the result back. The bounding set is emptied where
    that is allowed (CAP_SETPCAP); a non-root caller cannot, and need not: under no_new_privs neither set-uid
    binaries nor file capabilities grant anything, so a full bounding set with empty other sets holds nothing."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), "prctl(PR_SET_NO_NEW_PRIVS)")
    libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0), ctypes.c_ulong(0),
               ctypes.c_ulong(0))
    _drop_bounding_set()
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    held = {name: status[name].strip() for name in ("CapInh", "CapPrm", "CapEff", "CapAmb") if int(status[name], 16)}
    if held or status["NoNewPrivs"].strip() != "1":
        raise Refused(0, f"capabilities still held: {held}")
    bounding = ("bounding set empty" if not int(status["CapBnd"], 16) else
                "bounding set left full (only CAP_SETPCAP may empty it; under no_new_privs it grants nothing)")
    return f"none: effective, permitted, inheritable and ambient sets empty; no_new_privs; {bounding}"


def _drop_bounding_set() -> None:
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last_cap + 1):
        libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _set_rlimits(limits: RlimitConfig) -> bool:
    """Set every per-process limit and read them back; True when all hold. Not one is inherited from the caller
    (only a caller's lower hard limit stays): no real-time priority, no lowering of nice, and the quotas the kernel
    keeps per uid (pending signals, locked memory) capped, so a run never takes the share a non-root trainer needs."""
    wanted = {
        resource.RLIMIT_CPU: (limits["cpu_seconds"], limits["cpu_seconds"] + 1),
        resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
        resource.RLIMIT_FSIZE: (limits["file_bytes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_RTPRIO: (0, 0),
        resource.RLIMIT_NICE: (0, 0),
        resource.RLIMIT_MEMLOCK: (0, 0),  # also SysV SHM_LOCK, charged to the uid, not the process
        resource.RLIMIT_SIGPENDING: (PENDING_SIGNALS,) * 2,
    }
    if limits["processes"] is not None:
        wanted[resource.RLIMIT_NPROC] = (limits["processes"],) * 2
    for limit, values in wanted.items():
        hard = resource.getrlimit(limit)[1]  # a caller's lower hard limit stays: raising it needs privilege
        wanted[limit] = values = tuple(value if hard == resource.RLIM_INFINITY else min(value, hard)
                                       for value in values)
        resource.setrlimit(limit, values)
    return all(resource.getrlimit(limit) == values for limit, values in wanted.items())


def _ordinary_scheduling() -> None:
    """No real-time policy and a nice of 0 or weaker: a trainer running real-time or at a negative nice must not
    hand that to the run (its processes inherit the bootstrap's). Lowering one's own priority needs no privilege
    (SCHED_IDLE and SCHED_BATCH stay: leaving SCHED_IDLE would raise it)."""
    policy = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    if os.getpriority(os.PRIO_PROCESS, 0) < 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def _install_seccomp(report: Report, without_namespaces: bool) -> bool:
    try:
        SECCOMP.install(without_namespaces)
    except (OSError, KeyError) as error:
        return report.verdict("seccomp", False, f"cannot install the seccomp filter: {error}")
    answers = SECCOMP.probe(without_namespaces)
    open_calls = sorted(call for call, denied in answers.items() if not denied)
    mode = [line for line in open("/proc/self/status") if line.startswith("Seccomp:")]
    return report.verdict("seccomp", not open_calls,
                          f"filter installed ({mode[0].split()[1] if mode else '?'} = filter mode), each checked "
                          f"denied: {', '.join(sorted(answers))}" if not open_calls else f"still allowed: "
                          f"{', '.join(open_calls)}")


def _confine_and_check(config: ChildConfig, report: Report, without_namespaces: bool) -> list[str]:
    """The seccomp filter, then the checks only the code's own process can make; returns what failed."""
    seccomp_ok = _install_seccomp(report, without_namespaces)
    oom = open("/proc/self/oom_score_adj").read().strip()
    locked = ""
    if not without_namespaces and LANDLOCK.abi():  # the Landlock tier locks it with its own, wider ruleset
        try:
            LANDLOCK.restrict([], [WORKDIR, *(f"/dev/{device}" for device in DEVICES)], LANDLOCK.abi(),
                              writes_only=True)
            locked = "; locked there: Landlock denies every write outside the work dir"
        except OSError as error:
            locked = f"; not locked ({error}): the code may lower it to the trainer's value"
    oom_ok = report.verdict("oom", oom == str(OOM_SCORE_ADJ), f"oom_score_adj {oom}: the run's processes are "
                                                                f"the kernel's first OOM victims{locked}")
    nested = _nested_user_namespaces(without_namespaces)
    nested_ok = report.verdict("nested_namespaces", nested is None, nested or (
        "none: " + ("" if without_namespaces else "max_user_namespaces 0 in the run's user namespace, and ")
        + "seccomp denies unshare, clone and setns with namespace flags"))
    checks = [("seccomp", seccomp_ok), ("oom", oom_ok), ("nested_namespaces", nested_ok)]
    if not without_namespaces:  # the Landlock tier checks it once /proc is out of reach
        hidden = _bootstrap_visible()
        checks.append(("bootstrap_hidden", report.verdict("bootstrap_hidden", hidden is None, hidden or (
            "/proc/1/cmdline names no path, cgroup or caller pid (the configuration came through a memfd); "
            "/proc/self/cgroup shows a private cgroup namespace's root"))))
    return [name for name, ok in checks if not ok]


def _nested_user_namespaces(without_namespaces: bool) -> str | None:
    """None when the code cannot make a user namespace, else why it can."""
    if not without_namespaces:
        try:
            allowed = open("/proc/sys/user/max_user_namespaces").read().strip()
        except OSError as error:
            return f"cannot read max_user_namespaces: {error}"
        if allowed != "0":
            return f"max_user_namespaces is {allowed} in the run's user namespace"
    return None if SECCOMP.probe(without_namespaces)["unshare(CLONE_NEWUSER)"] else "unshare(CLONE_NEWUSER) allowed"


def _bootstrap_visible() -> str | None:
    """None when nothing of the bootstrap's configuration shows in /proc, else what does."""
    try:
        arguments = open("/proc/1/cmdline", "rb").read().split(b"\0")[:-1]
        cgroups = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None  # /proc is out of reach altogether (the Landlock tier)
    if len(arguments) != 5 or not arguments[3].startswith(b"/proc/self/fd/") or not arguments[4].isdigit():
        return f"/proc/1/cmdline shows {len(b''.join(arguments))} bytes of configuration"
    shown = [line for line in cgroups if not line.endswith(":/")]
    return f"/proc/self/cgroup shows the run's cgroup paths: {shown[0]}" if shown else None


def _confine_with_landlock(config: ChildConfig, report: Report, workdir: str) -> list[str]:
    """The Landlock tier's filesystem, network and scoping, then checks of each from inside."""
    version = LANDLOCK.abi()
    devices = [f"/dev/{device}" for device in DEVICES]
    try:
        said = LANDLOCK.restrict(config["binds"], [workdir, *devices], version)
    except OSError as error:
        report.verdict("filesystem", False, f"cannot apply Landlock: {error}")
        return ["filesystem"]
    outside = [path for path in ("/", "/tmp", "/proc/self/status") if _reachable(path)]
    written = [path for path in config["binds"][:1] if _writable(path)]
    fs_ok = report.verdict("filesystem", not outside and not written and _writable(workdir),
                           f"{said}" if not (outside or written) else f"still reachable: {outside + written}")
    bootstrap = f"/proc/{os.getppid()}/cmdline"
    hidden_ok = report.verdict("bootstrap_hidden", not _reachable(bootstrap),
                               f"{bootstrap} and the rest of /proc are out of reach (Landlock)")
    return [name for name, ok in (("filesystem", fs_ok), ("bootstrap_hidden", hidden_ok)) if not ok]


def _reachable(path: str) -> bool:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path, "rb").close()
    except OSError:
        return False
    return True


def _writable(directory: str) -> bool:
    probe = os.path.join(directory if os.path.isdir(directory) else os.path.dirname(directory), ".copes-probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return False
    os.unlink(probe)
    return True


def _user_namespaces_allowed() -> bool:
    """Whether this process may make a user namespace (a forked child tries; a container's seccomp profile or
    a sysctl may forbid it)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(ctypes.c_int(NAMESPACES["user"].flag)) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _enter_landlock_tier(config: ChildConfig, report: Report, missing: list[str]) -> NoReturn:
    """Who the code runs as here. Root becomes a per-run uid, as in the first tier, so nothing that authorises by
    uid alone (prlimit, scheduling, file modes and times, per-uid quotas) treats another root process or a
    root-owned file as its own; where it cannot (the interpreter lies under a directory other uids cannot search,
    such as a pyenv under a 0700 /root), the run is refused rather than left uid 0. A non-root caller keeps its uid:
    from ABI 6 Landlock scopes its signals and ptrace to the run, and seccomp confines the calls that act on
    another process to the caller itself and denies those that change a file's attributes."""
    if config["cgroup"] is not None:  # no init process here: give its place in the pids limit to nobody
        pids_file, _, limit = config["cgroup"]["pids"]
        with open(pids_file, "w") as file:  # before any uid switch: a per-run uid may not write it
            file.write(str(limit - 1))
    unreachable = _unreachable_by_other_uids([config["python"], *config["binds"]])
    if config["run_uid"] is not None and unreachable:
        config["run_uid"] = None
        config["kept_uid_because"] = f"the interpreter lies under {unreachable}, which other uids cannot search"
    _become_run_user(config)
    _landlock_tier(config, report, missing)


def _unreachable_by_other_uids(paths: list[str]) -> str | None:
    """The first directory on the way to `paths` that a uid other than its owner cannot search, else None."""
    for path in paths:
        parts = path.split("/")
        for depth in range(2, len(parts) + 1):
            directory = "/".join(parts[:depth]) or "/"
            try:
                mode = os.stat(directory).st_mode
            except OSError:
                return directory
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                return directory
    return None


def _landlock_tier(config: ChildConfig, report: Report, missing: list[str]) -> NoReturn:
    """No user namespace to be had: the bootstrap itself runs the code, confined by Landlock, the seccomp filter
    (which then also denies sockets and IPC lookups) and rlimits; it reaps every orphan, and when the code ends
    kills whatever of the run is left (its cgroup says which processes those are)."""
    version = LANDLOCK.abi()
    run_uid = config["run_uid"]
    scoped = version >= 6
    for namespace in NAMESPACES.values():
        report.isolation.pop(namespace.protection, None)
    if not version:
        report.verdict("filesystem", False, "no Landlock on this kernel (5.13+, landlock in the lsm= boot parameter)")
        missing.append("filesystem")
    kept = f" ({config['kept_uid_because']})" if config["kept_uid_because"] else ""
    if not run_uid and _is_host_root():
        # Neither Landlock nor seccomp sees file ownership: uid 0 would keep root's reach over the host's
        # root-owned files (modes, times, extended attributes) and share root's per-uid quotas.
        report.verdict("user", False, f"the code would keep uid 0{kept}; the Landlock tier never runs code as "
                                      "root: use the namespaces tier (tier='auto' where user namespaces can be "
                                      "had) or an interpreter other uids can reach")
    else:
        report.verdict("user", bool(run_uid) or scoped,
                       (f"per-run uid {run_uid}" if run_uid else f"the caller's uid {os.getuid()}")
                       + (", its signals and ptrace scoped to the run by Landlock" if scoped else
                          "" if run_uid else " with nothing to scope its signals")
                       + "; seccomp lets prlimit, scheduling and I/O priority act on the calling process only")
    report.verdict("network", True, "seccomp denies socket() for every address family, connect(), and "
                                    "socketpair() other than a unix stream pair"
                                    + ("; Landlock denies TCP bind and connect" if version >= 4 else ""))
    report.verdict("ipc", True, "seccomp denies System V IPC lookups and every call that takes an IPC id, and "
                                "every POSIX message queue call"
                                + ("; Landlock scopes abstract unix sockets to the run" if scoped else ""))
    report.verdict("pid_namespace", bool(run_uid) or scoped,
                   "no pid namespace: the bootstrap reaps every orphan and kills what is left of the run (its "
                   "cgroup's members) when the code ends; /proc is out of reach")
    try:  # a container's own seccomp profile may deny keyctl already
        _syscall("keyctl", ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
    except Refused:
        pass
    report.verdict("keyring", True, "seccomp denies every keyring call (checked with the filter)")
    missing += [name for name in ("user", "pid_namespace") if not report.isolation[name].startswith("yes")]
    shared = SHARED_MEMORY if _is_tmpfs(SHARED_MEMORY) else None
    workdir = tempfile.mkdtemp(prefix="copes_sandbox_", dir=shared)
    if not report.verdict("disk", *_shared_memory_room(config, workdir, shared)):
        missing.append("disk")
    report.send(host_workdir=workdir, tier="landlock")
    report.stop_if_missing(missing)
    with open(os.path.join(workdir, "main.py"), "wb") as file:
        file.write(os.pread(config["code_fd"], config["code_bytes"], 0))
    os.close(config["code_fd"])
    _check(libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), "prctl(PR_SET_CHILD_SUBREAPER)")
    if not run_uid:
        # RLIMIT_NPROC counts every process of the uid, the caller's own threads too: the pids cgroup bounds the run.
        config["rlimits"]["processes"] = None
    user_pid = os.fork()
    if user_pid == 0:
        _exec_user_code(config, report, workdir, landlock=True)

    def end_the_run(_signum: int, _frame: object) -> None:
        # As the namespaces tier's pid 1 dies: every process of the run first (reaped, so no zombie is handed to
        # the caller's subreaper), then the bootstrap, by SIGKILL.
        _kill_the_rest_of_the_run(config)
        os.kill(os.getpid(), signal.SIGKILL)

    signal.signal(signal.SIGTERM, end_the_run)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == user_pid:
            break
    _kill_the_rest_of_the_run(config)
    report.send(exit_status=os.waitstatus_to_exitcode(status))
    os._exit(0)


def _shared_memory_room(config: ChildConfig, workdir: str, shared: str | None) -> tuple[bool, str]:
    """(whether the Landlock work dir is bounded, in words): on a tmpfs with room for this run's max_disk_bytes
    and those of the caller's other runs that may still hold theirs; the caller kills the run past its quota."""
    quota, others = config["disk_bytes"], config["disk_reserved_by_others"]
    if shared is None:
        return False, f"work dir {workdir} on the host disk, bounded per file only ({SHARED_MEMORY} is no tmpfs)"
    disk = os.statvfs(shared)
    free = disk.f_bavail * disk.f_frsize
    if free < quota + others:
        return False, (f"{shared} has {free >> 20} MiB free, less than the {quota >> 20} MiB this run may write "
                       f"and the {others >> 20} MiB the caller's other runs may hold there: fewer runs at once, a "
                       f"smaller max_disk_bytes, a larger {shared}, or the namespaces tier")
    return True, (f"work dir {workdir} on tmpfs, charged to the run's memory cgroup, its size (with the run's "
                  f"shared memory) read by the caller every 10 ms: the run is killed past {quota >> 20} MiB; "
                  f"{shared} had room for it and the caller's other runs; RLIMIT_FSIZE per file")


def _is_host_root() -> bool:
    """Whether our uid is 0 and maps to uid 0 of the parent user namespace (not a rootless container's root)."""
    if os.getuid() != 0:
        return False
    for line in open("/proc/self/uid_map").read().splitlines():
        inside, outside, count = map(int, line.split())
        if inside <= 0 < inside + count:
            return outside - inside == 0
    return False


def _is_tmpfs(mount_point: str) -> bool:
    for line in open("/proc/self/mountinfo").read().splitlines():
        fields = line.split()
        if fields[4] == mount_point:
            return fields[fields.index("-") + 1] == "tmpfs"
    return False


def _kill_the_rest_of_the_run(config: ChildConfig) -> None:
    """Every process of the run but this one (daemons that left the process group too), until none is left; then
    reap until this process has no child at all. A process leaves cgroup.procs when it exits, before it is reaped:
    what is still unreaped when the bootstrap dies would become a zombie of the caller's nearest subreaper."""
    if config["cgroup"] is not None:  # else (unsafe mode only) the caller kills our process group
        procs_file = config["cgroup"]["procs_files"][0]
        for _ in range(1000):
            others = [int(pid) for pid in open(procs_file).read().split() if int(pid) != os.getpid()]
            if not others:
                break
            for pid in others:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            _reap(blocking=False)
    _reap(blocking=config["cgroup"] is not None)


def _reap(blocking: bool) -> None:
    """Reap children (orphans come to us as subreaper); blocking: until there is none left."""
    while True:
        try:
            if os.waitpid(-1, 0 if blocking else os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _exec_user_code(config: ChildConfig, report: Report, workdir: str, landlock: bool = False) -> NoReturn:
    limits = config["rlimits"]
    try:
        rlimits_ok = _set_rlimits(limits)
        report.verdict("rlimits", rlimits_ok, f"cpu {limits['cpu_seconds']} s, address space "
                                              f"{limits['memory_bytes'] >> 20} "
                                        f"MiB, open files {limits['open_files']}, file size "
                                        f"{limits['file_bytes'] >> 20} MiB, core 0, real-time priority 0, "
                                        f"nice never lowered, locked memory 0, {PENDING_SIGNALS} queued signals")
        try:
            ok = report.verdict("capabilities", True, _drop_capabilities())
        except Refused as error:
            ok = report.verdict("capabilities", False, str(error))
        missing = [name for name, held in (("capabilities", ok), ("rlimits", rlimits_ok)) if not held]
        missing += _confine_and_check(config, report, without_namespaces=landlock)
        if landlock:  # last: from here on /proc is out of reach
            missing += _confine_with_landlock(config, report, workdir)
        report.stop_if_missing(missing)
        report.send()
        os.set_inheritable(report.fd, False)  # the code must not be able to forge the report
        os.close(report.fd)
        os.chdir(workdir)
        env = dict(config["environment"], HOME=workdir, TMPDIR=workdir)
    except BaseException:  # a forked child must end here, with a code the caller can tell apart
        traceback.print_exc()
        os._exit(EXIT_SETUP_FAILED)
    python = config["python"]
    try:
        os.execve(python, [python, "-s", "main.py"], env)
    except OSError as error:
        print(f"sandbox: cannot start {python}: {error.strerror}", file=sys.stderr)
    os._exit(EXIT_EXEC_FAILED)


def _run_init(config: ChildConfig, report: Report, root_built: bool, root_error: str | None, private: bool,
              own_user_namespace: bool, private_pids: bool) -> NoReturn:
    """pid 1 of the run: keyring, filesystem, no nested user namespaces, start the user child, reap every orphan
    until it exits."""
    try:
        code = os.pread(config["code_fd"], config["code_bytes"], 0)
        os.close(config["code_fd"])
        missing = _fresh_keyring(config, report)
        if private_pids:
            pid_namespace = os.readlink("/proc/self/ns/pid")
            fresh = os.getpid() == 1 and pid_namespace != config["caller_namespaces"]["pid"]
            if not report.verdict("pid_namespace", fresh, f"pid 1 of a private pid namespace {pid_namespace}: "
                                                          "every process of the run dies with it"):
                missing.append("pid")
        workdir = None
        if private and root_error is not None:
            report.verdict("filesystem", False, f"cannot build the private root: {root_error}")
            missing.append("filesystem")
        elif private:
            try:
                if not root_built:
                    _build_root(config)
                workdir = _finish_root(config)
                missing += [] if _check_filesystem(config, report) else ["filesystem"]
            except OSError as error:
                report.verdict("filesystem", False, f"cannot build the private root: {error}")
                missing.append("filesystem")
        else:
            report.verdict("filesystem", False, "no private mount namespace: the host filesystem is visible")
            missing.append("filesystem")
        if own_user_namespace:
            # Per user namespace, and nested ones count against it: the code can never make one of its own (and
            # with it capabilities over new network, mount and cgroup namespaces). Never written outside our own.
            with open("/proc/sys/user/max_user_namespaces", "w") as file:
                file.write("0")
        report.stop_if_missing(missing)
        if workdir is None:
            workdir = _host_workdir(report)
        with open(os.path.join(workdir, "main.py"), "wb") as file:
            file.write(code)
        report.send()
        user_pid = os.fork()
        if user_pid == 0:
            _exec_user_code(config, report, workdir)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == user_pid:
                break
        report.send(exit_status=os.waitstatus_to_exitcode(status))
    except BaseException:  # a forked child must end here, with a code the caller can tell apart
        traceback.print_exc()
        os._exit(EXIT_SETUP_FAILED)
    os._exit(0)


def _build_root_as_root(config: ChildConfig) -> tuple[bool, str | None]:
    """Root with CAP_SYS_ADMIN builds the new root right away (see `_build_root`); otherwise (not root, or a
    container that withholds CAP_SYS_ADMIN) init builds it inside the user namespace. Returns (built, why not):
    a mount namespace we may not make means "let init try"; a root that fails to build is the real cause."""
    if config["run_uid"] is None:
        return False, None
    try:
        _check(libc.unshare(ctypes.c_int(NAMESPACES["mount"].flag)), "unshare(mount)")
    except OSError:
        return False, None
    try:
        _build_root(config)
    except OSError as error:
        return False, str(error)
    return True, None


def _load_helpers(config: ChildConfig) -> dict:
    """The standard-library modules named in the configuration, loaded by path (see the module docstring)."""
    helpers = {}
    for name, path in config["helpers"].items():
        spec = importlib.util.spec_from_file_location(f"copes_sandbox_{name}", path)
        helpers[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(helpers[name])
    return helpers


def main(config: ChildConfig) -> NoReturn:
    global SECCOMP, LANDLOCK
    report = Report(config["report_fd"], strict=not config["unsafe"])
    helpers = _load_helpers(config)
    SECCOMP, LANDLOCK = helpers["seccomp"], helpers["landlock"]
    with open("/proc/self/oom_score_adj", "w") as file:  # raising it needs no privilege; lowering it does
        file.write(str(OOM_SCORE_ADJ))
    _ordinary_scheduling()
    missing = _join_cgroups(config, report) + _caller_process_headroom(config, report)
    if config["tier"] == "landlock" or (not _user_namespaces_allowed() and LANDLOCK.abi()):
        _enter_landlock_tier(config, report, missing)
    root_built, root_error = _build_root_as_root(config)
    _become_run_user(config)
    unavailable = _enter_namespaces(config, report)
    if "user" in unavailable:  # and so no Landlock either (see above): neither tier can be had
        report.isolation["user"] += ("; and no Landlock, the tier without namespaces (kernel 5.13+ with "
                                     "landlock in lsm=)")
    missing += unavailable + _check_namespaces(config, report, unavailable)
    report.stop_if_missing(missing)
    report.send(tier="namespaces" if "user" not in unavailable else "none")
    init_pid = os.fork()
    pid_namespace = "pid" not in unavailable
    if init_pid == 0:
        _run_init(config, report, root_built, root_error, private="mount" not in unavailable,
                  own_user_namespace="user" not in unavailable, private_pids=pid_namespace)

    def end_the_run(_signum: int, _frame: object) -> None:
        if pid_namespace:
            # The kernel kills every process of a pid namespace whose pid 1 dies, and reaps that pid 1 only
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


def _read_config() -> ChildConfig:
    """The configuration from the fd in argv[1]; that fd and the one the script came from are closed."""
    config_fd = int(sys.argv[1])
    chunks = []
    while chunk := os.pread(config_fd, 1 << 20, sum(map(len, chunks))):
        chunks.append(chunk)
    os.close(config_fd)
    os.close(int(sys.argv[0].rsplit("/", 1)[1]))
    return json.loads(b"".join(chunks))


if __name__ == "__main__":
    main(_read_config())
