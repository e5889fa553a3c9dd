"""The sandbox where users run it: a virtualenv under /tmp, an interpreter behind a symlinked path, the system
Python (Debian's /lib64 link), a non-root caller, and a simulated default container (no CAP_SYS_ADMIN, namespace
creation denied by seccomp). Each is contained, with the tier the run names, or refused with the real reason.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from copes.tools import PythonSandbox, SandboxResult, SandboxUnavailable

from helpers.paths import REPO
from helpers.sandbox_users import SETPRIV, SYSTEM_PYTHON, delegated_cgroups, landlock_python, package_for_any_user

# What the code prints: where its interpreter thinks it lives, and whether the prefix's other files are there.
PROBE = (
    "import json, os, sys\n"
    "print(json.dumps({'prefix': sys.prefix, 'site': [p for p in sys.path if p.endswith('-packages')],\n"
    "                  'pip_conf': os.path.exists(os.path.join(sys.prefix, 'pip.conf')),\n"
    "                  'bin': sorted(os.listdir(os.path.join(sys.prefix, 'bin'))) if os.path.isdir(\n"
    "                      os.path.join(sys.prefix, 'bin')) else []}))\n"
)


def _assert_contained(result: SandboxResult) -> dict:
    assert result.exit_status == 0, result.stderr[-1000:]
    missing = [name for name, status in result.isolation.items() if not status.startswith("yes")]
    assert not missing and result.tier == "namespaces", result.isolation
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def venv_under_tmp() -> Path:
    """A virtualenv in /tmp (as `python -m venv` makes it) with a site pip.conf the code must not read."""
    path = Path("/tmp") / f"copes-sandbox-venv-{uuid.uuid4().hex[:8]}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    (path / "pip.conf").write_text("[global]\nindex-url = https://token@private.invalid/simple\n")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("unsafe", [False, True])
def test_a_virtualenv_under_tmp_is_contained(venv_under_tmp: Path, unsafe: bool) -> None:
    seen = _assert_contained(PythonSandbox(python=str(venv_under_tmp / "bin" / "python"), unsafe=unsafe).run(PROBE))
    assert seen["prefix"] == str(venv_under_tmp)
    assert seen["site"] == [str(venv_under_tmp / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
                                / "site-packages")]
    assert not seen["pip_conf"], "only what the interpreter needs is bound, never the prefix's other files"
    assert set(seen["bin"]) <= {"python", "python3", f"python3.{sys.version_info[1]}"}, seen["bin"]


def test_an_interpreter_behind_a_symlinked_directory_is_contained(venv_under_tmp: Path, tmp_path: Path) -> None:
    link = tmp_path / "linked-venv"
    link.symlink_to(venv_under_tmp, target_is_directory=True)
    seen = _assert_contained(PythonSandbox(python=str(link / "bin" / "python3")).run(PROBE))
    assert seen["prefix"] == str(link) and not seen["pip_conf"]


def test_the_interpreters_prefix_shows_only_the_interpreter() -> None:
    """The trainer's own interpreter: its prefix's scripts (pip, ...) and headers are not there."""
    seen = _assert_contained(PythonSandbox().run(PROBE))
    assert all(name.startswith("python") for name in seen["bin"]), seen["bin"]


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="this image has no system Python at /usr/bin/python3")
def test_the_system_python_with_its_lib64_link_is_contained() -> None:
    result = PythonSandbox(python=SYSTEM_PYTHON).run(PROBE + "print(os.path.realpath('/lib64'))")
    assert result.exit_status == 0, result.stderr[-1000:]
    probe, lib64 = result.stdout.splitlines()
    assert json.loads(probe)["prefix"] == "/usr"
    if os.path.islink("/lib64"):
        assert lib64 == os.path.realpath("/lib64"), "the ELF loader's /lib64 link must be in the new root"


def _trainer(prefix: list[str], python: str, script: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, python, "-c", script], capture_output=True, text=True, timeout=180,
                          env=env or dict(os.environ, PYTHONPATH=str(REPO)), cwd="/")


_RUN_AND_REPORT = (
    "import json, sys\nfrom copes.tools import PythonSandbox, SandboxUnavailable\n"
    "try:\n    result = PythonSandbox(python={python!r}).run({code!r})\n"
    "except SandboxUnavailable as error:\n    print('UNAVAILABLE', error)\n    sys.exit(3)\n"
    "print(json.dumps({{'stdout': result.stdout, 'tier': result.tier, 'isolation': result.isolation}}))\n"
)


@pytest.mark.skipif(SETPRIV is None or SYSTEM_PYTHON is None, reason="needs setpriv and a system Python")
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to a non-root user needs root")
def test_a_non_root_caller_is_contained(tmp_path: Path) -> None:
    """uid 4242 with a delegated cgroup (as systemd gives a user): contained in the namespaces tier, its own
    0600 files out of the code's sight."""
    uid = 4242
    secret = tmp_path / "token"
    secret.write_text("hf_secret")
    os.chown(secret, uid, uid)
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    code = f"try:\n    open({str(secret)!r}).read()\n    print('reached')\nexcept OSError as error:\n" \
           "    print(error.errno)\n"
    script = _RUN_AND_REPORT.format(python=SYSTEM_PYTHON, code=code)
    with delegated_cgroups(uid) as as_user:
        completed = subprocess.run([*as_user, SYSTEM_PYTHON, "-c", script], capture_output=True, text=True,
                                   timeout=180, env=dict(os.environ, PYTHONPATH=package_for_any_user()), cwd="/")
    assert completed.returncode == 0, completed.stdout + completed.stderr[-2000:]
    report = json.loads(completed.stdout.splitlines()[-1])
    assert report["stdout"].strip() == str(errno.ENOENT) and report["tier"] == "namespaces"
    assert report["isolation"]["user"].startswith("yes: uid 1000 of its own user namespace, mapped to the "
                                                  f"caller's uid {uid}")
    assert all(status.startswith("yes") for status in report["isolation"].values()), report["isolation"]


_DEFAULT_CONTAINER = (
    "import ctypes, importlib.util, socket\n"
    "spec = importlib.util.spec_from_file_location('seccomp', {seccomp!r})\n"
    "seccomp = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(seccomp)\n"
    "ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # no_new_privs, as Docker sets it\n"
    "# Namespace-creating unshare/clone denied, as by Docker's default profile (and Landlock too, where asked).\n"
    "seccomp.install(False, also_deny={also_deny!r})\n"
    "listener = socket.socket()\nlistener.bind(('127.0.0.1', 0))\nlistener.listen()\nlistener.setblocking(False)\n"
    "PORT = listener.getsockname()[1]\n"
)
# Escapes tried from inside; in the Landlock tier each must fail (EACCES from Landlock, EPERM from seccomp or
# Landlock's signal scoping), the work dir must be usable, and the daemon must die with the run.
_ESCAPES = (
    "import os, socket, time\n"
    "def attempt(what, action):\n"
    "    try:\n        action()\n        print(what, 'reached')\n"
    "    except OSError as error:\n        print(what, error.errno)\n"
    "attempt('passwd', lambda: open('/etc/passwd').read())\n"
    "attempt('checkout', lambda: os.listdir({repo!r}))\n"
    "attempt('tmp', lambda: open('/tmp/{marker}', 'w').write('x'))\n"
    "attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {{PORT}}), timeout=1))\n"
    "attempt('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))\n"
    "attempt('signal', lambda: os.kill({{TRAINER}}, 0))\n"
    "attempt('proc', lambda: os.listdir('/proc'))\n"
    "attempt('workdir', lambda: open('scratch', 'w').write('ok'))\n"
    "if os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
)
_RUN_ESCAPES = (
    "import json, os, sys, time\nfrom copes.tools import PythonSandbox, SandboxUnavailable\n"
    "code = {escapes!r}.replace('{{PORT}}', str(PORT)).replace('{{TRAINER}}', str(os.getpid()))\n"
    "started = time.monotonic()\n"
    "try:\n    result = PythonSandbox(timeout_s=10).run(code)\n"
    "except SandboxUnavailable as error:\n    print('UNAVAILABLE', error)\n    sys.exit(3)\n"
    "try:\n    listener.accept()\n    accepted = True\nexcept BlockingIOError:\n    accepted = False\n"
    "print(json.dumps({{'stdout': result.stdout, 'stderr': result.stderr, 'tier': result.tier,\n"
    "                  'isolation': result.isolation, 'accepted': accepted,\n"
    "                  'seconds': time.monotonic() - started}}))\n"
)


def _in_default_container(also_deny: tuple[str, ...]) -> subprocess.CompletedProcess:
    from copes.tools.sandbox import seccomp

    marker = f"copes-escape-{uuid.uuid4().hex[:8]}"
    escapes = _ESCAPES.format(repo=str(REPO), marker=marker)
    script = _DEFAULT_CONTAINER.format(seccomp=seccomp.__file__, also_deny=also_deny) + _RUN_ESCAPES.format(
        escapes=escapes)
    # Root's Landlock tier runs the code as a per-run uid, so it needs an interpreter that uid can reach.
    completed = _trainer([SETPRIV, "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"], landlock_python(),
                         script)
    assert not os.path.exists(f"/tmp/{marker}")
    return completed


needs_root_and_setpriv = pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0,
                                            reason="needs setpriv (util-linux), and root to drop CAP_SYS_ADMIN")


@needs_root_and_setpriv
def test_a_default_container_is_contained_in_the_landlock_tier() -> None:
    """Root without CAP_SYS_ADMIN, namespace creation denied by seccomp: the Landlock tier, every protection
    verified, every escape refused; or, on a kernel without Landlock, refused naming both missing features."""
    from copes.tools.sandbox import landlock

    completed = _in_default_container(())
    if not landlock.abi():
        assert completed.returncode == 3 and "and no Landlock" in completed.stdout, completed.stdout
        return
    assert completed.returncode == 0, completed.stdout + completed.stderr[-2000:]
    report = json.loads(completed.stdout.splitlines()[-1])
    assert report["tier"] == "landlock", report
    assert all(status.startswith("yes") for status in report["isolation"].values()), report["isolation"]
    seen = dict(line.split() for line in report["stdout"].splitlines())
    assert seen == {"passwd": str(errno.EACCES), "checkout": str(errno.EACCES), "tmp": str(errno.EACCES),
                    "tcp": str(errno.EPERM), "udp": str(errno.EPERM), "signal": str(errno.EPERM),
                    "proc": str(errno.EACCES), "workdir": "reached"}, report["stderr"][-1000:]
    assert not report["accepted"] and report["seconds"] < 8, "the daemon must die with the run"


@needs_root_and_setpriv
def test_without_user_namespaces_and_landlock_it_refuses_naming_both() -> None:
    completed = _in_default_container(("landlock_create_ruleset",))
    assert completed.returncode == 3, completed.stderr[-2000:]
    (line,) = completed.stdout.strip().splitlines()
    assert line.startswith("UNAVAILABLE the Python sandbox cannot isolate code on this machine: user (no: "
                           "[Errno 1] unshare(user): Operation not permitted"), line
    assert "and no Landlock, the tier without namespaces" in line and "--unsafe-sandbox" in line


def test_the_landlock_tier_can_be_asked_for_and_keeps_the_process_limit() -> None:
    from copes.tools.sandbox import landlock

    if not landlock.abi():
        pytest.skip("this kernel has no Landlock")
    code = (
        "import os, time\nchildren = 0\n"
        "try:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
        "        children += 1\nexcept OSError as error:\n    print(children, error.errno)\n"
    )
    python = landlock_python() if os.geteuid() == 0 else sys.executable
    result = PythonSandbox(timeout_s=10.0, max_processes=8, tier="landlock", python=python).run(code)
    assert result.tier == "landlock" and result.stdout == f"7 {errno.EAGAIN}\n", (result.stdout, result.stderr)
    assert not result.timed_out, "the sleeping children die with the run"
    with pytest.raises(ValueError, match="tier"):
        PythonSandbox(tier="chroot")


@pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None, reason="needs root and a system Python")
def test_root_gets_a_per_run_uid_in_the_landlock_tier_where_the_interpreter_allows() -> None:
    """Guards #40 and #56: the Landlock tier kept root's uid 0, so everything the kernel authorises by uid alone
    (prlimit, scheduling, System V IPC, leases, file modes and times, per-uid quotas) treated every root process and
    file as the run's own. An interpreter other uids can reach runs as a per-run uid; one under a 0700 directory is
    refused in one line naming the namespaces tier."""
    from copes.tools.sandbox import landlock

    if landlock.abi() < 6:
        pytest.skip("this kernel's Landlock cannot scope signals (ABI 6+)")
    code = "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
    result = PythonSandbox(tier="landlock", python=SYSTEM_PYTHON).run(code)
    uid, gid, groups = result.stdout.split(" ", 2)
    assert result.tier == "landlock" and int(uid) >= 1_000_000_000 and gid == uid and groups.strip() == "[]"
    assert result.isolation["user"].startswith(f"yes: per-run uid {uid}, its signals and ptrace"), result.isolation
    hidden = next((parent for parent in Path(sys.executable).parents
                   if parent != Path("/") and not parent.stat().st_mode & 0o001), None)
    if hidden is not None:
        with pytest.raises(SandboxUnavailable) as refused:
            PythonSandbox(tier="landlock").run(code)
        (line,) = str(refused.value).splitlines()
        assert f"user (no: the code would keep uid 0 (the interpreter lies under {hidden}, which other uids " \
               "cannot search); the Landlock tier never runs code as root: use the namespaces tier" in line, line
