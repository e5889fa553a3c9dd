"""Round 4 (issue #56): kernel quotas no cgroup partitions, what Landlock does not hook, limits a run used to
inherit, and channels between runs, judged from outside the run. A stand-in trainer (root, or uid 4242 with
delegated cgroups) started with real-time and nice rlimits, a low pending-signal limit and a small hugetlb pool,
holds what a real one would (a shm segment it locks, a file of its own in /tmp, a cached interpreter file), runs one
battery of attacks through `PythonSandbox` in each tier, and meanwhile, from another thread, keeps checking its own
calls and the kernel's counters; each test reads what it saw.

Each class escaped at least one tier or caller on the code before #56 (see each test's docstring).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers.sandbox_users import (
    ATTEMPTS,
    TRAINER_CONFIGURATIONS,
    landlock_python,
    stand_in_battery,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="the attacks use x86_64 syscall numbers"),
]

# What the run tries; each outcome is "reached" or the errno's name. It then holds what it took for a while, so the
# trainer's sampling thread sees it.
_ATTACKS = ATTEMPTS + r'''
import mmap, signal, time
held = []

def aio_contexts():  # every AIO context of the host (fs.aio-max-nr)
    taken = 0
    while taken < 10000:
        context = ctypes.c_ulong(0)
        if libc.syscall(206, 4096, ctypes.byref(context)) != 0:
            check(-1 if taken == 0 else 0)
            return
        taken += 1

def queue_signals():  # the uid's pending-signal quota (kill() never fails for want of it: sigqueue does)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
    queued = 0
    try:
        while queued < 100000:
            check(libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)))
            queued += 1
    finally:
        seen["signals_queued"] = queued

def lock_shm():  # the uid's locked-memory quota, through a System V segment
    segment = check(libc.shmget(0, 8 << 20, 0o1600))
    check(libc.shmctl(segment, 11, None))  # SHM_LOCK

def hugetlb_mapping():
    held.append(mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000))  # MAP_HUGETLB
    held[-1][0], held[-1][2 << 20] = 1, 1

def page_out():  # evict a shared file's page cache with process_madvise, madvise's denied advice by another call
    mapping = mmap.mmap(os.open(BOUND, os.O_RDONLY), 0, access=mmap.ACCESS_COPY)
    size = len(mapping)
    for offset in range(0, size, 4096):
        mapping[offset]
    held.append(mapping)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    vector = (ctypes.c_size_t * 2)(address, size)
    check(libc.syscall(440, os.pidfd_open(os.getpid()), vector, 1, 21, 0))  # MADV_PAGEOUT

def global_counters():  # host-wide thread counts: sysinfo(), /proc/loadavg, /proc/stat
    check(libc.sysinfo(ctypes.create_string_buffer(128)))

def proc_counters():
    text = open("/proc/loadavg").read() + open("/proc/stat").read()
    if not text:
        raise OSError(errno.ENODATA, "")

attempt("aio", aio_contexts)
attempt("signals", queue_signals)
attempt("shm_lock", lock_shm)
attempt("hugetlb_mmap", hugetlb_mapping)
attempt("hugetlb_memfd", lambda: os.memfd_create("huge", 4))  # MFD_HUGETLB
attempt("hugetlb_shm", lambda: check(libc.shmget(0, 2 << 20, 0o1600 | 0o4000)))  # SHM_HUGETLB
attempt("rtprio", lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)))
attempt("nice", lambda: os.setpriority(os.PRIO_PROCESS, 0, -10))
attempt("chmod", lambda: os.chmod(VICTIM, 0o4777))
attempt("utime", lambda: os.utime(VICTIM))
attempt("setxattr", lambda: os.setxattr(VICTIM, "user.copes", b"run"))
attempt("pageout", page_out)
attempt("nowait_read", lambda: os.preadv(os.open(BOUND, os.O_RDONLY), [bytearray(4096)], 0, os.RWF_NOWAIT))
attempt("sysinfo", global_counters)
attempt("proc_counters", proc_counters)
attempt("statvfs", lambda: os.statvfs("."))
print(json.dumps(seen), flush=True)
time.sleep(HOLD_S)
'''

# The stand-in trainer: argv[1] is the tier, argv[2] the attacks; prints one JSON line.
_TRAINER = r'''
import ctypes, json, mmap, os, resource, signal, sys, tempfile, threading, time
from copes.tools import PythonSandbox
libc = ctypes.CDLL(None, use_errno=True)
tier, attacks = sys.argv[1], sys.argv[2]
me = os.getpid()
resource.setrlimit(resource.RLIMIT_SIGPENDING, (2048, resource.getrlimit(resource.RLIMIT_SIGPENDING)[1]))
signal.signal(signal.SIGRTMIN + 1, lambda *_: None)
own_segment = libc.shmget(0, 1 << 20, 0o1600)
folder = tempfile.mkdtemp()
os.chmod(folder, 0o755)
victim = os.path.join(folder, "victim")
open(victim, "w").close()
os.chmod(victim, 0o666)  # any uid may write it: times set to "now" need no more
os.utime(victim, (1_000_000_000, 1_000_000_000))
try:
    os.setxattr(victim, "user.copes", b"trainer")
except OSError:
    pass  # a /tmp without user xattrs: modes and times are still judged
bound = os.path.join(os.path.dirname(os.__file__), "pydoc_data", "topics.py")

def resident_pages(path):
    """Pages of `path` in the page cache (mincore over a private mapping that touches none of them)."""
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    vector = (ctypes.c_ubyte * ((len(mapping) + 4095) // 4096))()
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mapping)), vector)
    return sum(byte & 1 for byte in vector)

def hugepages_free():
    for line in open("/proc/meminfo"):
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0

def code_processes():
    """The run's processes that run the code (the bootstrap takes a moment to drop what it inherited)."""
    found, pending = [], [me]
    while pending:
        pid = pending.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                children = [int(child) for child in open(f"/proc/{pid}/task/{task}/children").read().split()]
                found += children
                pending += children
        except OSError:
            pass
    return [pid for pid in found if b"main.py" in open_or_empty(f"/proc/{pid}/cmdline")]

def open_or_empty(path):
    try:
        return open(path, "rb").read()
    except OSError:
        return b""

saw = {"aio_nr_peak": 0, "own_aio_failed": 0, "own_signal_failed": 0, "own_shm_lock_failed": 0,
       "hugepages_free_start": hugepages_free(), "hugepages_free_low": hugepages_free(),
       "realtime_descendants": 0, "negative_nice_descendants": 0,
       "shm_peak_bytes": 0, "samples": 0}
shm_before = os.statvfs("/dev/shm")
shm_used = lambda: (shm_before.f_bfree - os.statvfs("/dev/shm").f_bfree) * shm_before.f_frsize
aio_before = int(open("/proc/sys/fs/aio-nr").read())

def sample(stop):
    while not stop.is_set():
        saw["samples"] += 1
        saw["aio_nr_peak"] = max(saw["aio_nr_peak"], int(open("/proc/sys/fs/aio-nr").read()) - aio_before)
        context = ctypes.c_ulong(0)
        if libc.syscall(206, 1, ctypes.byref(context)) == 0:
            libc.syscall(207, context)  # io_destroy
        else:
            saw["own_aio_failed"] += 1
        if libc.sigqueue(me, signal.SIGRTMIN + 1, ctypes.c_void_p(0)) != 0:
            saw["own_signal_failed"] += 1
        if libc.shmctl(own_segment, 11, None) == 0:  # SHM_LOCK, then SHM_UNLOCK
            libc.shmctl(own_segment, 12, None)
        else:
            saw["own_shm_lock_failed"] += 1
        saw["hugepages_free_low"] = min(saw["hugepages_free_low"], hugepages_free())
        for pid in code_processes():
            try:
                saw["realtime_descendants"] += os.sched_getscheduler(pid) != os.SCHED_OTHER
                saw["negative_nice_descendants"] += os.getpriority(os.PRIO_PROCESS, pid) < 0
            except OSError:
                pass
        saw["shm_peak_bytes"] = max(saw["shm_peak_bytes"], shm_used())
        time.sleep(0.02)

def run_watched(sandbox, code):
    stop = threading.Event()
    watcher = threading.Thread(target=sample, args=(stop,))
    watcher.start()
    try:
        return sandbox.run(code)
    finally:
        stop.set()
        watcher.join()

open(bound, "rb").read()  # the trainer has it cached, as an interpreter file every run reads
resident_before = resident_pages(bound)
code = f"VICTIM, BOUND, HOLD_S = {victim!r}, {bound!r}, 1.5\n" + attacks
try:  # a trainer running real-time (root: CAP_SYS_NICE) while it waits for the run; its threads inherit it
    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
except OSError:
    pass
result = run_watched(PythonSandbox(timeout_s=20.0, tier=tier), code)
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
resident_after = resident_pages(bound)
attributes = os.stat(victim)
try:
    xattr = os.getxattr(victim, "user.copes").decode()
except OSError:
    xattr = None
libc.shmctl(own_segment, 0, None)  # IPC_RMID
outside = dict(saw, resident_before=resident_before, resident_after=resident_after,
               victim_mode=attributes.st_mode & 0o7777, victim_mtime=attributes.st_mtime, victim_xattr=xattr)

# 320 MiB of files under a 32 MiB max_disk_bytes: in the Landlock tier they go to the host's /dev/shm.
fill = ("chunk = bytes(1 << 20)\nfor index in range(320):\n    with open(f'f{index}', 'wb') as file:\n"
        "        file.write(chunk)\n")
saw["shm_peak_bytes"] = 0
filled = run_watched(PythonSandbox(timeout_s=20.0, tier=tier, max_disk_bytes=32 << 20), fill)
outside.update(shm_peak_bytes=saw["shm_peak_bytes"], disk_quota_exceeded=getattr(filled, "disk_quota_exceeded", False))
print(json.dumps({"tier": result.tier, "isolation": result.isolation, "stderr": result.stderr[-2000:],
                  "attacks": json.loads(result.stdout.splitlines()[0]) if result.stdout else {},
                  "outside": outside}))
'''

HUGE_PAGES = 2  # the pool the trainer's machine has (2 MiB pages), made where there is none


@pytest.fixture(scope="module", autouse=True)
def _hugetlb_pool() -> Iterator[None]:
    """A pool of HUGE_PAGES pages while the battery runs (root only; put back as it was afterwards)."""
    path = Path("/proc/sys/vm/nr_hugepages")
    before = path.read_text().strip()
    made = False
    if os.geteuid() == 0 and before == "0":
        with contextlib.suppress(OSError):
            path.write_text(str(HUGE_PAGES))
            made = True
    try:
        yield
    finally:
        if made:
            path.write_text(before)


def _privileged_scheduling() -> None:
    """What a trainer started by a generous service manager has: nice -5 and, where this root may raise hard
    limits (CAP_SYS_RESOURCE), real-time priority and nice -20 allowed by its rlimits."""
    with contextlib.suppress(OSError):  # CAP_SYS_NICE
        os.setpriority(os.PRIO_PROCESS, 0, -5)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_RTPRIO, (50, 50))
        resource.setrlimit(resource.RLIMIT_NICE, (40, 40))


def _battery(configuration: str) -> dict:
    return stand_in_battery(configuration, _TRAINER, (_ATTACKS,), preexec_fn=_privileged_scheduling)


configurations = pytest.mark.parametrize("configuration", list(TRAINER_CONFIGURATIONS))
DENIED = errno.errorcode[errno.EPERM]


@configurations
def test_every_protection_holds(configuration: str) -> None:
    battery = _battery(configuration)
    assert all(status.startswith("yes") for status in battery["isolation"].values()), battery["isolation"]
    assert battery["outside"]["samples"] >= 10, "the trainer must have watched the run while it held its gains"


@configurations
def test_no_aio_context_is_taken_from_the_host(configuration: str) -> None:
    """A run took every Linux AIO context of the host (fs.aio-max-nr): the trainer's own io_setup failed."""
    battery = _battery(configuration)
    assert battery["attacks"]["aio"] == DENIED
    assert battery["outside"]["aio_nr_peak"] == 0 and battery["outside"]["own_aio_failed"] == 0, battery["outside"]


@configurations
def test_the_hugetlb_pool_is_out_of_reach(configuration: str) -> None:
    """mmap(MAP_HUGETLB), memfd_create(MFD_HUGETLB) and shmget(SHM_HUGETLB) take pages of the host's pool, which no
    cgroup limit here counts."""
    battery = _battery(configuration)
    attacks = battery["attacks"]
    expected = dict.fromkeys(("hugetlb_mmap", "hugetlb_memfd", "hugetlb_shm"), DENIED)
    assert {name: attacks[name] for name in expected} == expected
    outside = battery["outside"]
    assert outside["hugepages_free_low"] == outside["hugepages_free_start"], outside


@configurations
def test_the_uids_pending_signals_are_partitioned(configuration: str) -> None:
    """A run queued real-time signals up to the uid's RLIMIT_SIGPENDING (inherited), and the trainer's own queued
    signals then failed with EAGAIN (a non-root caller shares its uid with the run)."""
    battery = _battery(configuration)
    assert battery["attacks"]["signals_queued"] <= 64, battery["attacks"]
    assert battery["outside"]["own_signal_failed"] == 0, battery["outside"]


@configurations
def test_the_uids_locked_memory_is_not_taken(configuration: str) -> None:
    """SHM_LOCK of an 8 MiB System V segment charged the uid's RLIMIT_MEMLOCK (inherited): a non-root trainer's
    own SHM_LOCK then failed."""
    battery = _battery(configuration)
    assert battery["attacks"]["shm_lock"] == DENIED, battery["attacks"]
    assert battery["outside"]["own_shm_lock_failed"] == 0, battery["outside"]


@configurations
def test_no_real_time_scheduling_or_negative_nice(configuration: str) -> None:
    """A caller started with nonzero RLIMIT_RTPRIO and RLIMIT_NICE handed them to the run (SCHED_FIFO, nice -10),
    and one running real-time or at a negative nice its own policy and nice. (Where root lacks CAP_SYS_RESOURCE, as
    on this project's machine, the trainer keeps RLIMIT_RTPRIO and RLIMIT_NICE at 0: then its inherited nice -5
    and, as root, SCHED_RR are what is judged from outside.)"""
    battery = _battery(configuration)
    assert battery["attacks"]["rtprio"] == DENIED and battery["attacks"]["nice"] == errno.errorcode[errno.EACCES]
    outside = battery["outside"]
    assert outside["realtime_descendants"] == 0 and outside["negative_nice_descendants"] == 0, outside


@configurations
def test_a_trainer_file_keeps_its_mode_times_and_attributes(configuration: str) -> None:
    """Landlock does not hook chmod, utimes or setxattr: a Landlock-tier run as root made a root file 04777; any
    run set the times of a file it may write (utime(NULL)); a non-root caller's run chmods the caller's files."""
    battery = _battery(configuration)
    outside = battery["outside"]
    assert outside["victim_mode"] == 0o666 and outside["victim_mtime"] == 1_000_000_000, outside
    assert outside["victim_xattr"] in (None, "trainer"), outside
    refused = errno.errorcode[errno.ENOENT if battery["tier"] == "namespaces" else errno.EPERM]
    assert {battery["attacks"][name] for name in ("chmod", "utime", "setxattr")} == {refused}, battery["attacks"]


@configurations
def test_shared_page_cache_is_neither_evicted_nor_probed(configuration: str) -> None:
    """process_madvise(MADV_PAGEOUT) evicted a shared interpreter file's page cache where madvise is denied;
    preadv2(RWF_NOWAIT) told cached pages from uncached ones where mincore is denied."""
    battery = _battery(configuration)
    assert battery["attacks"]["pageout"] == DENIED and battery["attacks"]["nowait_read"] == DENIED
    outside = battery["outside"]
    assert outside["resident_after"] >= outside["resident_before"] > 0, outside


@configurations
def test_no_host_wide_thread_count(configuration: str) -> None:
    """sysinfo() (both tiers) and /proc/loadavg, /proc/stat (namespaces tier) show the host's thread and fork
    counts: a channel between concurrent runs."""
    attacks = _battery(configuration)["attacks"]
    assert attacks["sysinfo"] == DENIED
    assert attacks["proc_counters"] in (errno.errorcode[errno.ENODATA], errno.errorcode[errno.EACCES]), attacks


@configurations
def test_the_work_dir_is_bounded_while_the_run_lives(configuration: str) -> None:
    """A Landlock-tier run wrote 320 MiB to the host's /dev/shm under a 32 MiB max_disk_bytes; statvfs of its work
    dir showed concurrent runs' use of /dev/shm."""
    battery = _battery(configuration)
    outside = battery["outside"]
    assert outside["shm_peak_bytes"] < (32 + 48) << 20, outside
    if battery["tier"] == "landlock":
        assert outside["disk_quota_exceeded"] and battery["attacks"]["statvfs"] == DENIED, battery


def test_the_landlock_tier_admits_only_the_runs_dev_shm_can_hold() -> None:
    """The Landlock tier's work dirs share the host's /dev/shm, and it admitted runs whose max_disk_bytes together
    outgrew it: each run now reserves its quota until its work dir is removed, and a run /dev/shm cannot hold is
    refused in one line, before its code starts."""
    from copes.tools import PythonSandbox, SandboxUnavailable
    from copes.tools.sandbox import landlock
    from copes.tools.sandbox.runner import remove_later

    if landlock.abi() < 6:
        pytest.skip("this kernel has no Landlock tier (ABI 6+)")
    disk = os.statvfs("/dev/shm")
    most = disk.f_bavail * disk.f_frsize * 3 // 5  # two runs of this size cannot both fit
    python = landlock_python() if os.geteuid() == 0 else sys.executable
    holder = PythonSandbox(tier="landlock", python=python, max_disk_bytes=most, timeout_s=20.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(holder.run, "import time\nopen('started', 'w').close()\ntime.sleep(4)\n")
        deadline = time.monotonic() + 15
        while not any(name.startswith("copes_sandbox_") and os.path.exists(f"/dev/shm/{name}/started")
                      for name in os.listdir("/dev/shm")) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(SandboxUnavailable) as refused:
            holder.run("print('ran')")
        assert held.result().exit_status == 0
    (line,) = str(refused.value).splitlines()
    assert "disk (no: /dev/shm has" in line and "the caller's other runs may hold there" in line, line
    remove_later(tempfile.mkdtemp()).result()  # the holder's work dir was queued before: removed by now
    assert holder.run("print('ran')").stdout == "ran\n", "a removed work dir gives its room back"


# A non-root trainer whose RLIMIT_NPROC leaves it 40 tasks: a run that may fork 66 must not start (its processes
# would count against the trainer's uid); one with room for it runs its fork bomb, and the trainer's own forks, tried
# while each run lives, never fail.
_PROCESS_QUOTA_TRAINER = r'''
import json, os, resource, sys, threading, time
from copes.tools import PythonSandbox, SandboxUnavailable
tier = sys.argv[1]
bomb = ("import os, time\nchildren = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "            os._exit(0)\n        children += 1\nexcept OSError:\n    print(children, flush=True)\n"
        "time.sleep(1.5)\n")

def tasks_of_my_uid():
    tasks = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == os.getuid():
                tasks += int(open(f"/proc/{entry.name}/stat").read().rsplit(")", 1)[1].split()[17])
        except (OSError, ValueError):
            pass
    return tasks

failed_forks = 0

def fork_now_and_then(stop):
    global failed_forks
    while not stop.is_set():
        try:
            pid = os.fork()
        except OSError:
            failed_forks += 1
        else:
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        time.sleep(0.02)

outcomes = {}
for label, room in (("tight", 40), ("roomy", 200)):
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks_of_my_uid() + room, hard))
    stop = threading.Event()
    forker = threading.Thread(target=fork_now_and_then, args=(stop,))
    forker.start()
    try:
        result = PythonSandbox(timeout_s=20.0, tier=tier, max_processes=64).run(bomb)
        outcomes[label] = {"tier": result.tier, "stdout": result.stdout, "stderr": result.stderr[-500:]}
    except SandboxUnavailable as error:
        outcomes[label] = {"refused": str(error)}
    finally:
        stop.set()
        forker.join()
    resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
print(json.dumps({"tier": outcomes["roomy"].get("tier"), "attacks": outcomes, "failed_forks": failed_forks}))
'''


@pytest.mark.parametrize("configuration", [name for name in TRAINER_CONFIGURATIONS if name.startswith("non-root")])
def test_a_run_never_takes_the_callers_last_processes(configuration: str) -> None:
    """A non-root caller's run counts against the caller's own RLIMIT_NPROC (its uid's tasks): 59 children of a run
    left the trainer's next fork with EAGAIN (round 3's open class). A run that could do that is now refused."""
    battery = stand_in_battery(configuration, _PROCESS_QUOTA_TRAINER)
    tight, roomy = battery["attacks"]["tight"], battery["attacks"]["roomy"]
    assert battery["failed_forks"] == 0, battery
    assert "process_limit (no: the caller's uid" in tight.get("refused", ""), tight
    assert int(roomy["stdout"].split()[0]) >= 60, roomy  # the bomb really ran where there was room
