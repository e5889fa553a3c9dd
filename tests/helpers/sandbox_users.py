"""Running a sandbox caller as a non-root user, as systemd would start one: a uid of its own, with the memory,
pids and cpuacct cgroups delegated to it (the sandbox needs a whole-run cgroup it can write)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.paths import REPO

SETPRIV = shutil.which("setpriv")
# A system interpreter other uids can reach (the trainer's own may live under a 0700 /root).
SYSTEM_PYTHON = next((path for path in ("/usr/bin/python3", "/usr/bin/python3.11") if os.path.exists(path)), None)
NON_ROOT_UID = 4242


@functools.cache
def package_for_any_user() -> str:
    """A PYTHONPATH folder holding a world-readable copy of the copes package, for a process run as another uid:
    the checkout may sit under a home only its owner can enter (issue #37). Made once per session, removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="copes-package-"))
    folder.chmod(0o755)
    shutil.copytree(REPO / "copes", folder / "copes", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return str(folder)


@contextlib.contextmanager
def delegated_cgroups(uid: int = NON_ROOT_UID) -> Iterator[list[str]]:
    """Fresh v1 memory, pids and cpuacct cgroups under ours, owned by `uid`; yields the prefix of a command that
    enters them and then runs the rest of its arguments as `uid`. Removed afterwards, nested ones first."""
    delegated = []
    try:
        for controller in ("memory", "pids", "cpuacct"):
            mine = open("/proc/self/cgroup").read().split(f":{controller}:")[1].split("\n")[0]
            directory = Path(f"/sys/fs/cgroup/{controller}{mine}") / f"copes-test-user-{uuid.uuid4().hex[:8]}"
            directory.mkdir()
            delegated.append(directory)
            for entry in [directory, *directory.iterdir()]:
                os.chown(entry, uid, uid)
        join = " ".join(f"echo $$ > {directory}/cgroup.procs;" for directory in delegated)
        yield ["sh", "-c", f'{join} exec "$@"', "sh", SETPRIV, "--reuid", str(uid), "--regid", str(uid),
               "--clear-groups"]
    finally:
        for directory in delegated:
            for nested in sorted(directory.rglob("*"), reverse=True):
                if nested.is_dir():
                    nested.rmdir()
            directory.rmdir()


def reachable_by_other_uids(path: str) -> bool:
    """Whether every directory above `path` lets other uids through (a pyenv under a 0700 /root does not)."""
    return all(parent.stat().st_mode & 0o001 for parent in Path(path).parents)


def landlock_python() -> str | None:
    """An interpreter a root caller's Landlock tier accepts: one a per-run uid can reach (that tier refuses to run
    code as uid 0), this one where it can, else the system Python."""
    return sys.executable if reachable_by_other_uids(sys.executable) else SYSTEM_PYTHON


# The start of an attack script the sandbox runs: `attempt(name, action)` records in `seen` "reached" or the name of
# the errno that stopped it; `check` turns a raw call's failure (-1, or MAP_FAILED) into that errno.
ATTEMPTS = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
seen = {}

def check(result):
    if result in (-1, 0xFFFFFFFFFFFFFFFF):
        raise OSError(ctypes.get_errno(), "")
    return result

def attempt(name, action):
    try:
        action()
        seen[name] = "reached"
    except OSError as error:
        seen[name] = errno.errorcode.get(error.errno, str(error.errno))
'''

# The callers a stand-in trainer runs as: name -> (non-root, tier).
TRAINER_CONFIGURATIONS = {
    "root, namespaces tier": (False, "auto"),
    "root, Landlock tier": (False, "landlock"),
    "non-root, namespaces tier": (True, "auto"),
    "non-root, Landlock tier": (True, "landlock"),
}


def stand_in_battery(configuration: str, script: str, arguments: tuple[str, ...] = (),
                     preexec_fn: Callable[[], None] | None = None) -> dict:
    """What a stand-in trainer saw: `script` run once per configuration and arguments (seconds each; a failed run
    fails every test that asks for it without running again). Skips where the configuration cannot be had."""
    outcome = _run_stand_in_trainer(configuration, script, arguments, preexec_fn)
    if isinstance(outcome, str):
        pytest.fail(outcome)
    return outcome


@functools.cache
def _run_stand_in_trainer(configuration: str, script: str, arguments: tuple[str, ...],
                          preexec_fn: Callable[[], None] | None) -> dict | str:
    """Run `script` (`python -c script TIER *arguments`) as the configuration's caller, in delegated cgroups when
    not root; returns the JSON of its last line (with "tier" and "attacks"), or why it failed."""
    from copes.tools.sandbox import landlock

    non_root, tier = TRAINER_CONFIGURATIONS[configuration]
    if tier == "landlock" and landlock.abi() < 6:
        pytest.skip(f"this kernel's Landlock ABI {landlock.abi()} cannot scope signals (6+): no Landlock tier")
    if non_root and (os.geteuid() != 0 or SETPRIV is None or SYSTEM_PYTHON is None):
        pytest.skip("a non-root caller needs root to switch to it, setpriv and a system Python")
    python = SYSTEM_PYTHON if non_root else landlock_python() if tier == "landlock" else sys.executable
    env = dict(os.environ, PYTHONPATH=package_for_any_user() if non_root else str(REPO))
    with contextlib.ExitStack() as stack:
        prefix = stack.enter_context(delegated_cgroups()) if non_root else []
        completed = subprocess.run([*prefix, python, "-c", script, tier, *arguments], capture_output=True,
                                   text=True, timeout=300, env=env, cwd="/", preexec_fn=preexec_fn)
    if completed.returncode != 0:
        return f"the stand-in trainer failed: {completed.stdout[-2000:]}{completed.stderr[-3000:]}"
    battery = json.loads(completed.stdout.splitlines()[-1])
    if battery["tier"] != ("landlock" if tier == "landlock" else "namespaces") or not battery["attacks"]:
        return f"the attacks did not run in the {tier} tier: {battery}"
    return battery
