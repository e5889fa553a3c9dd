"""The sandbox's seccomp filter, built as classic BPF with struct and installed with prctl (standard library only:
the sandbox bootstrap loads this file by path before any isolation exists).

Denied with EPERM, in both tiers:
- io_uring, perf_event_open, userfaultfd, bpf, the keyring calls, inotify and fanotify (a view of other runs' and
  the trainer's file activity), setns, and unshare / clone asking for any new namespace. clone3 gets ENOSYS, because
  its flags sit behind a pointer the filter cannot read: glibc then falls back to clone, whose flags it can.
- Calls that act on another process by pid and authorise by uid alone (which Landlock does not hook): prlimit64,
  sched_setaffinity/setscheduler/setparam/setattr and ioprio_set only on the caller itself (pid 0), setpriority
  only as PRIO_PROCESS of the caller (never PRIO_PGRP or PRIO_USER, which reach every process of the uid).
- fcntl's F_SETLEASE (a lease stalls another process's open), F_NOTIFY (dnotify: inotify by another name),
  F_SETPIPE_SZ (the uid's pipe pages are shared with the trainer), and every byte-range lock command, plus flock:
  locks on the shared read-only bound inodes are a channel between concurrent runs.
- Page-cache control and inspection: fadvise64 POSIX_FADV_DONTNEED, madvise MADV_COLD/MADV_PAGEOUT, mincore and
  cachestat (evicting or probing the cache of shared files is a channel, and drops the trainer's cached pages),
  process_madvise (MADV_PAGEOUT by another call), preadv2/pwritev2 with RWF_NOWAIT (EAGAIN tells an uncached page).
- Host-wide quotas no cgroup here counts: io_setup (the host's AIO contexts, fs.aio-max-nr), mmap MAP_HUGETLB,
  memfd_create MFD_HUGETLB and shmget SHM_HUGETLB (the hugetlb pool); sysinfo (the host's thread count, a channel
  between concurrent runs).
- socket(AF_VSOCK): vsock ignores network namespaces.
The Landlock tier (no namespaces) also denies what the private network and IPC namespaces would contain: `socket`
(every family), `connect`, `socketpair` other than SOCK_STREAM (a datagram socket can `sendto` any host pathname
socket), the System V IPC lookups and every call that takes an IPC id, and every POSIX message queue call; what
Landlock does not hook: every call that changes a file's mode, owner, times or extended attributes (chmod, chown,
utimensat, setxattr, ... and their fd forms: Landlock lets the run open bound files for reading, which the fd forms
would then change), and statfs/fstatfs (the shared /dev/shm's free space is a channel between runs). System calls
of a foreign ABI (i386 or x32 on x86_64) are denied as a whole.

`probe()` checks from inside that the filter answers: it makes each denied call with arguments the kernel itself
would reject differently (EINVAL, EFAULT, EBADF, ESRCH), so a working filter is told apart from a missing one and a
probe never creates or changes anything.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000
# The kernel's own numbers, one table per architecture: the two lists name the same calls on purpose (only the
# numbers differ), which is why they look alike.
SYSCALLS = {
    "x86_64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "perf_event_open": 298,
               "userfaultfd": 323, "bpf": 321, "add_key": 248, "request_key": 249, "keyctl": 250,
               "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300, "setns": 308, "unshare": 272,
               "clone": 56, "clone3": 435, "socket": 41, "shmget": 29, "semget": 64, "msgget": 68,
               "mq_open": 240, "landlock_create_ruleset": 444, "prlimit64": 302, "sched_setparam": 142,
               "sched_setscheduler": 144, "sched_setaffinity": 203, "sched_setattr": 314, "setpriority": 141,
               "ioprio_set": 251, "fcntl": 72, "flock": 73, "fadvise64": 221, "madvise": 28, "mincore": 27,
               "cachestat": 451, "socketpair": 53, "connect": 42, "shmat": 30, "shmctl": 31, "semop": 65,
               "semctl": 66, "semtimedop": 220, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "mq_unlink": 241,
               "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
               "io_setup": 206, "process_madvise": 440, "preadv2": 327, "pwritev2": 328, "sysinfo": 99,
               "mmap": 9, "memfd_create": 319, "statfs": 137, "fstatfs": 138, "chmod": 90, "fchmod": 91,
               "fchmodat": 268, "fchmodat2": 452, "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260,
               "utime": 132, "utimes": 235, "futimesat": 261, "utimensat": 280, "setxattr": 188, "lsetxattr": 189,
               "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "setxattrat": 463,
               "removexattrat": 466},
    "aarch64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "perf_event_open": 241,
                "userfaultfd": 282, "bpf": 280, "add_key": 217, "request_key": 218, "keyctl": 219,
                "inotify_init1": 26, "fanotify_init": 262, "setns": 268, "unshare": 97, "clone": 220,
                "clone3": 435, "socket": 198, "shmget": 194, "semget": 190, "msgget": 186,
                "mq_open": 180, "landlock_create_ruleset": 444, "prlimit64": 261, "sched_setparam": 118,
                "sched_setscheduler": 119, "sched_setaffinity": 122, "sched_setattr": 274, "setpriority": 140,
                "ioprio_set": 30, "fcntl": 25, "flock": 32, "fadvise64": 223, "madvise": 233, "mincore": 232,
                "cachestat": 451, "socketpair": 199, "connect": 203, "shmat": 196, "shmctl": 195, "semop": 193,
                "semctl": 191, "semtimedop": 192, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "mq_unlink": 181,
                "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185,
                "io_setup": 0, "process_madvise": 440, "preadv2": 286, "pwritev2": 287, "sysinfo": 179,
                "mmap": 222, "memfd_create": 279, "statfs": 43, "fstatfs": 44, "fchmod": 52, "fchmodat": 53,
                "fchmodat2": 452, "fchown": 55, "fchownat": 54, "utimensat": 88, "setxattr": 5, "lsetxattr": 6,
                "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16, "setxattrat": 463,
                "removexattrat": 466},
}
DENIED = ("io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open", "userfaultfd", "bpf",
          "add_key", "request_key", "keyctl", "inotify_init", "inotify_init1", "fanotify_init", "setns", "flock",
          "mincore", "cachestat", "io_setup", "process_madvise", "sysinfo")
# Landlock does not hook these: under the run's uid they change modes, owners, times and extended attributes of any
# file that uid owns (or, for times set to now, may write), wherever it is. The namespaces tier's binds are read-only.
ATTRIBUTE_CHANGES = ("chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime",
                     "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr",
                     "lremovexattr", "fremovexattr", "setxattrat", "removexattrat")
# Without namespaces these stand in for the private network and IPC namespaces; statfs shows the shared /dev/shm.
DENIED_WITHOUT_NAMESPACES = ("socket", "connect", "shmget", "semget", "msgget", "shmat", "shmctl", "semop", "semctl",
                             "semtimedop", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
                             "mq_timedreceive", "mq_notify", "mq_getsetattr", *ATTRIBUTE_CHANGES, "statfs",
                             "fstatfs")
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_CLONE_FS, _CLONE_SETTLS, _CLONE_NEWUSER = 0x200, 0x80000, 0x10000000
_PRIO_PROCESS, _IOPRIO_WHO_PROCESS = 0, 1
_F_SETLEASE, _F_NOTIFY, _F_SETPIPE_SZ = 1024, 1026, 1031
_LOCK_COMMANDS = (5, 6, 7, 36, 37, 38)  # F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
_POSIX_FADV_DONTNEED, _MADV_COLD, _MADV_PAGEOUT = 4, 20, 21
_RWF_NOWAIT, _MAP_HUGETLB, _MFD_HUGETLB, _SHM_HUGETLB = 0x8, 0x40000, 0x4, 0x800
_AF_UNIX, _AF_VSOCK, _SOCK_STREAM, _SOCK_TYPE_MASK = 1, 40, 1, 0xF

# Argument rules: a call is denied when any of its rules says so. A rule reads the low 32 bits of one argument
# (every argument checked is an int or a pid_t in the kernel): ("unless", arg, value) denies unless it equals
# value; ("any_of", arg, values) denies when it equals one of them; ("masked_unless", arg, mask, value) denies
# unless (arg & mask) == value; ("any_bit", arg, mask) denies when any bit of mask is set.
Rule = tuple
_ONLY_SELF: tuple[Rule, ...] = (("unless", 0, 0),)
ARGUMENT_RULES: dict[str, tuple[Rule, ...]] = {
    "prlimit64": _ONLY_SELF, "sched_setparam": _ONLY_SELF, "sched_setscheduler": _ONLY_SELF,
    "sched_setaffinity": _ONLY_SELF, "sched_setattr": _ONLY_SELF,
    "setpriority": (("unless", 0, _PRIO_PROCESS), ("unless", 1, 0)),
    "ioprio_set": (("unless", 0, _IOPRIO_WHO_PROCESS), ("unless", 1, 0)),
    "fcntl": (("any_of", 1, (_F_SETLEASE, _F_NOTIFY, _F_SETPIPE_SZ, *_LOCK_COMMANDS)),),
    "fadvise64": (("any_of", 3, (_POSIX_FADV_DONTNEED,)),),
    "madvise": (("any_of", 2, (_MADV_COLD, _MADV_PAGEOUT)),),
    "socket": (("any_of", 0, (_AF_VSOCK,)),),
    # RWF_NOWAIT answers EAGAIN for pages not in the page cache: mincore by another name.
    "preadv2": (("any_bit", 5, _RWF_NOWAIT),), "pwritev2": (("any_bit", 5, _RWF_NOWAIT),),
    # The hugetlb pool is the host's, and no cgroup limit here counts it.
    "mmap": (("any_bit", 3, _MAP_HUGETLB),), "memfd_create": (("any_bit", 1, _MFD_HUGETLB),),
    "shmget": (("any_bit", 2, _SHM_HUGETLB),),
    "unshare": (("any_bit", 0, NAMESPACE_FLAGS),),
    "clone": (("any_bit", 0, NAMESPACE_FLAGS),),
}
ARGUMENT_RULES_WITHOUT_NAMESPACES: dict[str, tuple[Rule, ...]] = {
    "socketpair": (("unless", 0, _AF_UNIX), ("masked_unless", 1, _SOCK_TYPE_MASK, _SOCK_STREAM)),
}
_LD_W_ABS, _ALU_AND_K, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x54, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_NR_OFFSET, _ARCH_OFFSET, _ARGS_OFFSET = 0, 4, 16  # struct seccomp_data, little-endian: args[i] low word at 16 + 8i
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2

libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _deny(errno_value: int) -> int:
    return _RET_ERRNO | errno_value


def _rule_ops(rule: Rule) -> list[bytes]:
    """Load the rule's argument and return EPERM when the rule says so; fall through otherwise."""
    kind, argument, *values = rule
    ops = [_op(_LD_W_ABS, _ARGS_OFFSET + 8 * argument)]
    deny = _op(_RET_K, _deny(errno.EPERM))
    if kind == "unless":
        return ops + [_op(_JEQ_K, values[0], jt=1), deny]
    if kind == "masked_unless":
        return ops + [_op(_ALU_AND_K, values[0]), _op(_JEQ_K, values[1], jt=1), deny]
    if kind == "any_bit":
        return ops + [_op(_JSET_K, values[0], jf=1), deny]
    choices = values[0]  # any_of: each equality jumps to the deny at the end
    return ops + [_op(_JEQ_K, value, jt=len(choices) - index, jf=0) for index, value in enumerate(choices)] + [
        _op(0x05, 1), deny]  # BPF_JMP|BPF_JA over the deny when none matched


def program(without_namespaces: bool, machine: str | None = None, also_deny: tuple[str, ...] = ()) -> bytes:
    """The filter for this machine's architecture (`also_deny`: more calls of SYSCALLS to deny with EPERM, as a
    container's own profile may); raises KeyError on an architecture we have no syscall table for."""
    machine = machine or platform.machine()
    numbers = SYSCALLS[machine]
    ops = [_op(_LD_W_ABS, _ARCH_OFFSET), _op(_JEQ_K, _ARCH[machine], jt=1), _op(_RET_K, _deny(errno.EPERM)),
           _op(_LD_W_ABS, _NR_OFFSET)]
    if machine == "x86_64":
        ops += [_op(_JGE_K, _X32_SYSCALL_BIT, jf=1), _op(_RET_K, _deny(errno.EPERM))]
    denied = DENIED + (DENIED_WITHOUT_NAMESPACES if without_namespaces else ()) + also_deny
    for name in denied:
        if name in numbers:  # aarch64 has no inotify_init
            ops += [_op(_JEQ_K, numbers[name], jf=1), _op(_RET_K, _deny(errno.EPERM))]
    ops += [_op(_JEQ_K, numbers["clone3"], jf=1), _op(_RET_K, _deny(errno.ENOSYS))]
    rules = {**ARGUMENT_RULES, **(ARGUMENT_RULES_WITHOUT_NAMESPACES if without_namespaces else {})}
    for name, call_rules in rules.items():
        if name in denied:
            continue
        # Each block ends in RET ALLOW, so the accumulator it clobbered never matters to what follows.
        block = [op for rule in call_rules for op in _rule_ops(rule)] + [_op(_RET_K, _RET_ALLOW)]
        ops += [_op(_JEQ_K, numbers[name], jf=len(block))] + block
    ops.append(_op(_RET_K, _RET_ALLOW))
    return b"".join(ops)


def install(without_namespaces: bool, also_deny: tuple[str, ...] = ()) -> None:
    """Install the filter on the calling thread (inherited over fork and exec); needs no_new_privs set first."""
    code = program(without_namespaces, also_deny=also_deny)
    fprog = _SockFprog(len(code) // 8, code)
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(ctypes.get_errno())}")


def _answer(name: str, *args: int | None) -> int:
    """The errno one raw call gives (0 when it succeeded, which closes the fd it may have returned)."""
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(SYSCALLS[platform.machine()][name]), *[ctypes.c_long(a or 0) for a in args])
    if result >= 0:
        if name.startswith("inotify"):
            libc.close(result)
        return 0
    return ctypes.get_errno()


_NO_SUCH_PID = 0x3FFFFFFF  # above pid_max's ceiling (4M): the kernel answers ESRCH


def probe(without_namespaces: bool) -> dict[str, bool]:
    """{call: denied by the filter} for each call the filter must deny, made with arguments that the kernel
    itself answers with another errno (or, for inotify_init, success)."""
    numbers = SYSCALLS[platform.machine()]
    calls = {
        "io_uring_setup": ("io_uring_setup", 0, None), "perf_event_open": ("perf_event_open", None, 0, -1, -1, 0),
        "userfaultfd": ("userfaultfd", 0xFFFF), "bpf": ("bpf", -1, None, 0), "add_key": ("add_key", None),
        "keyctl": ("keyctl", -1), "inotify_init1": ("inotify_init1", 0xFFFFFFFF), "setns": ("setns", -1, 0),
        "unshare(CLONE_NEWUSER)": ("unshare", _CLONE_NEWUSER | _CLONE_SETTLS),  # EINVAL for the kernel
        "clone(CLONE_NEWUSER)": ("clone", _CLONE_NEWUSER | _CLONE_FS),  # EINVAL for the kernel
        # Another process (ESRCH for the kernel), or a `which` the kernel rejects (EINVAL).
        "prlimit64(another pid)": ("prlimit64", _NO_SUCH_PID, 0, None, None),
        "sched_setaffinity(another pid)": ("sched_setaffinity", _NO_SUCH_PID, 0, None),
        "sched_setscheduler(another pid)": ("sched_setscheduler", _NO_SUCH_PID, 0, None),
        "sched_setparam(another pid)": ("sched_setparam", _NO_SUCH_PID, None),
        "sched_setattr(another pid)": ("sched_setattr", _NO_SUCH_PID, None, 0),
        "setpriority(not the caller)": ("setpriority", 99, 0, 0),
        "ioprio_set(not the caller)": ("ioprio_set", 99, 0, 0),
        # A bad fd or address (EBADF, EINVAL for the kernel).
        "fcntl(F_SETLEASE)": ("fcntl", -1, _F_SETLEASE, 0), "fcntl(F_NOTIFY)": ("fcntl", -1, _F_NOTIFY, 0),
        "fcntl(F_SETPIPE_SZ)": ("fcntl", -1, _F_SETPIPE_SZ, 0), "fcntl(F_SETLK)": ("fcntl", -1, 6, None),
        "fcntl(F_OFD_SETLK)": ("fcntl", -1, 37, None), "flock": ("flock", -1, 0),
        "fadvise64(DONTNEED)": ("fadvise64", -1, 0, 0, _POSIX_FADV_DONTNEED),
        "madvise(MADV_PAGEOUT)": ("madvise", 1, 0, _MADV_PAGEOUT), "mincore": ("mincore", 1, 0, None),
        "cachestat": ("cachestat", -1, None, None, 0), "socket(AF_VSOCK)": ("socket", _AF_VSOCK, -1, 0),
        "io_setup": ("io_setup", 0, None), "process_madvise": ("process_madvise", -1, None, 0, _MADV_PAGEOUT, 0),
        "preadv2(RWF_NOWAIT)": ("preadv2", -1, None, 0, 0, 0, _RWF_NOWAIT),
        "pwritev2(RWF_NOWAIT)": ("pwritev2", -1, None, 0, 0, 0, _RWF_NOWAIT), "sysinfo": ("sysinfo", None),
        "mmap(MAP_HUGETLB)": ("mmap", None, 0, 0, _MAP_HUGETLB, -1, 0),  # length 0: EINVAL for the kernel
        "memfd_create(MFD_HUGETLB)": ("memfd_create", None, _MFD_HUGETLB),
    }
    if not without_namespaces:  # the Landlock tier denies shmget altogether (below)
        calls["shmget(SHM_HUGETLB)"] = ("shmget", 0, 0, _SHM_HUGETLB)  # size 0: EINVAL for the kernel
    if "inotify_init" in numbers:
        calls["inotify_init"] = ("inotify_init",)
    if without_namespaces:  # the kernel's own answers: EAFNOSUPPORT, EBADF, EFAULT, EINVAL for a bad id or fd
        calls.update({
            "socket": ("socket", -1, 0, 0), "connect": ("connect", -1, None, 0),
            "socketpair(SOCK_DGRAM)": ("socketpair", _AF_UNIX, 2, 0, None),
            "shmget": ("shmget", 0, 0, 0), "semget": ("semget", 0, -1, 0), "msgget": ("msgget", 0x7FFFFFFF, 0),
            "shmat": ("shmat", -1, None, 0), "shmctl": ("shmctl", -1, 0, None), "semop": ("semop", -1, None, 0),
            "semctl": ("semctl", -1, 0, 0), "semtimedop": ("semtimedop", -1, None, 0, None),
            "msgsnd": ("msgsnd", -1, None, 0, 0), "msgrcv": ("msgrcv", -1, None, 0, 0, 0),
            "msgctl": ("msgctl", -1, 0, None), "mq_open": ("mq_open", None, 0, 0, None),
            "mq_unlink": ("mq_unlink", None), "mq_timedsend": ("mq_timedsend", -1, None, 0, 0, None),
            "mq_timedreceive": ("mq_timedreceive", -1, None, 0, None, None), "mq_notify": ("mq_notify", -1, None),
            "mq_getsetattr": ("mq_getsetattr", -1, None, None), "statfs": ("statfs", None, None),
            "fstatfs": ("fstatfs", -1, None)})
        # A bad fd (EBADF) or a NULL path (EFAULT) for the kernel.
        calls.update({name: (name, *(-1 if name.startswith("f") or name.endswith("at") else None, None, 0, 0))
                      for name in ATTRIBUTE_CHANGES if name in numbers})
    denied = {label: _answer(*call) == errno.EPERM for label, call in calls.items()}
    denied["clone3"] = _answer("clone3", None, 0) == errno.ENOSYS  # EINVAL for the kernel
    return denied
