"""Landlock for the sandbox's second tier, for machines where user namespaces cannot be had (standard library
only: the sandbox bootstrap loads this file by path, as it does seccomp.py).

`restrict(readable, writable, abi)` confines the calling process and everything it starts. It may read and execute
beneath `readable`, and do anything beneath `writable`. Nothing else in the filesystem is reachable, /proc included.
From ABI 4 it may neither bind nor connect TCP ports. From ABI 6 it may not reach abstract unix sockets or signal
processes outside its own Landlock domain. Needs no_new_privs (or CAP_SYS_ADMIN), no other privilege.
"""

from __future__ import annotations

import ctypes
import os
import struct

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same numbers on x86_64 and aarch64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
TRUNCATE, IOCTL_DEV = 1 << 14, 1 << 15
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only rights a rule on a file may hold
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2

libc = ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is missing or disabled."""
    version = libc.syscall(ctypes.c_long(_CREATE_RULESET), None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(version, 0)


def _check(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


def restrict(readable: list[str], writable: list[str], version: int, writes_only: bool = False) -> str:
    """Confine the calling process (see the module docstring); returns what is now enforced, in words.
    `writes_only`: leave reads, the network and signals alone (the namespaces tier, whose root and namespaces see
    to those) and deny every write outside `writable`, /proc/self/oom_score_adj included."""
    fs_rights = _FS_RIGHTS_BY_ABI.get(version, _FS_RIGHTS_BY_ABI[5])
    if writes_only:
        fs_rights &= ~(EXECUTE | READ_FILE | READ_DIR)
    net_rights = _NET_BIND_TCP | _NET_CONNECT_TCP if version >= 4 and not writes_only else 0
    scopes = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if version >= 6 and not writes_only else 0
    attr = struct.pack("<QQQ", fs_rights, net_rights, scopes)[: 8 if version < 4 else 16 if version < 6 else 24]
    ruleset = _check(libc.syscall(ctypes.c_long(_CREATE_RULESET), ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    try:
        rules = [(path, EXECUTE | READ_FILE | READ_DIR) for path in readable] + [(path, fs_rights) for path in writable]
        for path, rights in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                allowed = rights & fs_rights if os.path.isdir(path) else rights & fs_rights & _FILE_RIGHTS
                rule = struct.pack("<Qi", allowed, fd)
                _check(libc.syscall(ctypes.c_long(_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                    ctypes.c_char_p(rule), ctypes.c_uint32(0)), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        _check(libc.syscall(ctypes.c_long(_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
               "landlock_restrict_self")
    finally:
        os.close(ruleset)
    said = [f"Landlock ABI {version}: " + ("" if writes_only else f"read and execute only beneath the "
                                                                 f"{len(readable)} interpreter and library paths, ")
            + f"write only beneath {', '.join(writable)}"]
    said += ["no TCP bind or connect"] if net_rights else []
    said += ["no abstract unix sockets or signals outside the run"] if scopes else []
    return "; ".join(said)
