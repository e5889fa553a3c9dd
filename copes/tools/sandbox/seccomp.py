"""The sandbox's seccomp filter, built as classic BPF with struct and installed with prctl (standard library only:
the sandbox bootstrap loads this file by path before any isolation exists).

Denied with EPERM, in both tiers: io_uring, perf_event_open, userfaultfd, bpf, the keyring calls, inotify and
fanotify (a view of other runs' and the trainer's file activity), setns, and unshare / clone asking for any new
namespace. clone3 gets ENOSYS, because its flags sit behind a pointer the filter cannot read: glibc then falls back
to clone, whose flags it can. The Landlock tier (no namespaces) also denies `socket` (every address family; the
private network namespace's job there), System V IPC lookups and mq_open (the private IPC namespace's job). System
calls of a foreign ABI (i386 or x32 on x86_64) are denied as a whole.

`probe()` checks from inside that the filter answers: it makes each denied call with arguments the kernel itself
would reject differently (EINVAL, EFAULT, EBADF), so a working filter is told apart from a missing one and a probe
never creates anything.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000
SYSCALLS = {
    "x86_64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "perf_event_open": 298,
               "userfaultfd": 323, "bpf": 321, "add_key": 248, "request_key": 249, "keyctl": 250,
               "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300, "setns": 308, "unshare": 272,
               "clone": 56, "clone3": 435, "socket": 41, "shmget": 29, "semget": 64, "msgget": 68,
               "mq_open": 240, "landlock_create_ruleset": 444},
    "aarch64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "perf_event_open": 241,
                "userfaultfd": 282, "bpf": 280, "add_key": 217, "request_key": 218, "keyctl": 219,
                "inotify_init1": 26, "fanotify_init": 262, "setns": 268, "unshare": 97, "clone": 220,
                "clone3": 435, "socket": 198, "shmget": 194, "semget": 190, "msgget": 186,
                "mq_open": 180, "landlock_create_ruleset": 444},
}
DENIED = ("io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open", "userfaultfd", "bpf",
          "add_key", "request_key", "keyctl", "inotify_init", "inotify_init1", "fanotify_init", "setns")
# Without namespaces these stand in for the private network and IPC namespaces.
DENIED_WITHOUT_NAMESPACES = ("socket", "shmget", "semget", "msgget", "mq_open")
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_CLONE_FS, _CLONE_SETTLS, _CLONE_NEWUSER = 0x200, 0x80000, 0x10000000
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_NR_OFFSET, _ARCH_OFFSET, _ARG0_LOW_OFFSET = 0, 4, 16  # struct seccomp_data, little-endian
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2

libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _deny(errno_value: int) -> int:
    return _RET_ERRNO | errno_value


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
    for name in ("unshare", "clone"):  # both take their flags in the first argument
        ops += [_op(_JEQ_K, numbers[name], jf=4), _op(_LD_W_ABS, _ARG0_LOW_OFFSET),
                _op(_JSET_K, NAMESPACE_FLAGS, jf=1), _op(_RET_K, _deny(errno.EPERM)), _op(_RET_K, _RET_ALLOW)]
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
    }
    if "inotify_init" in numbers:
        calls["inotify_init"] = ("inotify_init",)
    if without_namespaces:  # the kernel's own answers: EAFNOSUPPORT, EINVAL, EINVAL, ENOENT, EFAULT
        calls.update({"socket": ("socket", -1, 0, 0), "shmget": ("shmget", 0, 0, 0), "semget": ("semget", 0, -1, 0),
                      "msgget": ("msgget", 0x7FFFFFFF, 0), "mq_open": ("mq_open", None, 0, 0, None)})
    denied = {label: _answer(*call) == errno.EPERM for label, call in calls.items()}
    denied["clone3"] = _answer("clone3", None, 0) == errno.ENOSYS  # EINVAL for the kernel
    return denied
