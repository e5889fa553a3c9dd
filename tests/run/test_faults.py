"""Faults driven into real `copes-run` processes from outside (issue #54): a second process on a live run's folder,
SIGTERM, corrupt checkpoints and one a crash cut short, a torn journal, a full disk, no inode left, a read-only
folder, SIGTERM and a dead rank under --workers. Each ends in at most two lines and no traceback, and the run then
resumes to the weights and metrics of an uninterrupted run, bit for bit. docs/durable-run.md lists what the user sees
for each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from safetensors.torch import load_file

from helpers.cli_runs import (
    assert_same_weights,
    copes_run,
    copes_run_in_background,
    final_weights,
    finished_run,
    metrics_without_time,
    run_in_process,
)

T = TypeVar("T")
STEPS = ["--steps", "3", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory, *STEPS)


def assert_resumes_to(uninterrupted: Path, run: Path, *flags: str) -> subprocess.CompletedProcess:
    resumed = copes_run(*STEPS, *flags, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_weights(final_weights(run), final_weights(uninterrupted))
    assert metrics_without_time(run) == metrics_without_time(uninterrupted)
    return resumed


# What a run says on stderr as it starts, before any fault.
START_LINES = ("memory plan ", "held-out accuracy before training")


def assert_said_in_a_line_or_two(output: str) -> list[str]:
    """The lines said, past a run's start lines: one or two, no traceback."""
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith(START_LINES)]
    assert 1 <= len(lines) <= 2 and "Traceback" not in output, output
    return lines


def wait_until_stopped(pid: int, timeout: float = 240) -> None:
    """Until the process stopped itself (a COPES_FAILPOINT ending in :SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while (state := Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "T":
        assert state != "Z" and time.monotonic() < deadline, f"process {pid} never reached its failpoint"
        time.sleep(0.2)


def fault_in_step_2(run: Path, flags: Sequence[str], fault: Callable[[], T]) -> tuple[str, T]:
    """A run stopped inside step 2 (its member 6), `fault()` done to it there, then let go: the one line it ends
    with (a status below 128, no traceback) and what `fault` returned."""
    holder = copes_run_in_background(*flags, "--output-dir", str(run), env={"COPES_FAILPOINT": "member@6:SIGSTOP"})
    try:
        wait_until_stopped(holder.pid)
        done = fault()
        holder.send_signal(signal.SIGCONT)
        _, stderr = holder.communicate(timeout=120)
    finally:
        holder.kill()
    assert 0 < holder.returncode < 128, stderr
    [line] = assert_said_in_a_line_or_two(stderr)
    return line, done


@pytest.mark.integration
def test_a_live_runs_folder_is_refused_and_sigterm_says_how_to_resume(uninterrupted, tmp_path):
    """A second --resume and an --overwrite of a live (here stopped) run's folder refuse in one line naming the
    holder and delete nothing; SIGTERM then ends the holder with the resume command, and the resume is bitwise."""
    run = tmp_path / "run"
    holder = copes_run_in_background(*STEPS, "--output-dir", str(run), env={"COPES_FAILPOINT": "member@6:SIGSTOP"})
    try:
        wait_until_stopped(holder.pid)
        journal = (run / "journal").read_bytes()
        for flags in (["--resume", str(run)], ["--output-dir", str(run), "--overwrite", *STEPS]):
            refused = run_in_process(*flags)
            assert refused.exit_code == 2, refused.output
            [line] = assert_said_in_a_line_or_two(refused.output)
            assert f"pid {holder.pid}" in line and "in use" in line
        assert (run / "journal").read_bytes() == journal and (run / "checkpoints" / "step-000001").is_dir()
        holder.send_signal(signal.SIGTERM)
        holder.send_signal(signal.SIGCONT)
        _, stderr = holder.communicate(timeout=60)
    finally:
        holder.kill()
    assert holder.returncode == 128 + signal.SIGTERM, stderr
    assert f"copes-run --resume {run}" in stderr.splitlines()[-1] and "Traceback" not in stderr
    assert_resumes_to(uninterrupted, run)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def assert_every_checkpoint_as_uninterrupted(uninterrupted: Path, run: Path) -> None:
    """checkpoints/ holds each step's checkpoint, intact, with the weights the uninterrupted run saved there."""
    from copes.run.checkpoint import verify_checkpoint

    names = sorted(folder.name for folder in (uninterrupted / "checkpoints").glob("step-*"))
    assert sorted(folder.name for folder in (run / "checkpoints").glob("step-*")) == names
    for name in names:
        verify_checkpoint(run / "checkpoints" / name)
        assert_same_weights(load_file(str(run / "checkpoints" / name / "model.safetensors")),
                            load_file(str(uninterrupted / "checkpoints" / name / "model.safetensors")))
    assert (run / "checkpoints" / "latest").read_text() == (uninterrupted / "checkpoints" / "latest").read_text()


@pytest.mark.integration
def test_a_corrupt_checkpoint_is_skipped_and_written_again_with_one_cut_short(uninterrupted, tmp_path):
    """Killed mid-way through writing checkpoint 2, with a byte of the older checkpoint 1 flipped: the resume warns
    once naming checkpoint 1, rebuilds from the journal, writes checkpoints 1 and 2 again on the way, and ends
    bitwise with every checkpoint the uninterrupted run has."""
    killed = copes_run(*STEPS, "--output-dir", str(tmp_path), env={"COPES_FAILPOINT": "checkpoint@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (tmp_path / ".copes-lock").is_file()  # left by the killed run: it must not block the resume
    flip_a_byte(tmp_path / "checkpoints" / "step-000001" / "model.safetensors")
    resumed = assert_resumes_to(uninterrupted, tmp_path)
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step-000001" in warnings[0] and "corrupt" in warnings[0], resumed.stderr
    assert_every_checkpoint_as_uninterrupted(uninterrupted, tmp_path)


@pytest.mark.integration
def test_an_older_corrupt_checkpoint_is_written_again_behind_a_newer_intact_one(uninterrupted, tmp_path):
    """Killed in step 3 with checkpoint 2 intact and a byte of checkpoint 1 flipped: the resume replays from the
    base model past checkpoint 1 to write it again, and `latest` stays at the newest."""
    killed = copes_run(*STEPS, "--output-dir", str(tmp_path), env={"COPES_FAILPOINT": "member@10"})  # step 3
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (tmp_path / "checkpoints" / "step-000003").exists()
    flip_a_byte(tmp_path / "checkpoints" / "step-000001" / "model.safetensors")
    resumed = assert_resumes_to(uninterrupted, tmp_path)
    assert sum(line.startswith("warning:") for line in resumed.stderr.splitlines()) == 1, resumed.stderr
    assert_every_checkpoint_as_uninterrupted(uninterrupted, tmp_path)


@pytest.mark.integration
def test_a_torn_last_journal_record_is_said_by_replay(uninterrupted, tmp_path):
    """A crash mid-append leaves the last record torn: replay uses the complete records and says so in one line."""
    from click.testing import CliRunner

    from copes.cli import replay_command

    run = tmp_path / "run"
    run.mkdir()
    journal = (uninterrupted / "journal").read_bytes()
    (run / "journal").write_bytes(journal[: len(journal) - 40])  # the last update record, cut mid-line
    result = CliRunner().invoke(replay_command, [str(run), "--output", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert_said_in_a_line_or_two(result.output)
    [note] = result.stderr.splitlines()
    assert str(run / "journal") in note and "cut short" in note and "(2 steps)" in note
    assert result.stdout.startswith("replayed 2 steps")


def mount(folder: Path, *options: str) -> None:
    """Mount a tmpfs (or with "--bind", the file or folder onto itself), or skip: needs root, as CI has."""
    if not folder.exists():
        folder.mkdir()
    command = ["mount", *options, str(folder), str(folder)] if "--bind" in options else \
        ["mount", "-t", "tmpfs", *options, "tmpfs", str(folder)]
    mounted = subprocess.run(command, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount here: {mounted.stderr.decode().strip()}")


@pytest.fixture
def own_disk(tmp_path):
    """A file system of its own (a tmpfs of the size and inodes the test gives), unmounted afterwards."""
    folder = tmp_path / "disk"
    yield lambda *options: mount(folder, *options) or folder
    subprocess.run(["umount", "-R", "-l", str(folder)], capture_output=True)


@pytest.fixture
def small_disk(own_disk):
    """A 4 MiB file system of its own."""
    return own_disk("-o", "size=4m")


def fill(disk: Path, leave_bytes: int) -> Path:
    """A file taking all of `disk`'s free space but `leave_bytes`."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with filler.open("ab") as handle:
        handle.write(b"\0" * max(free - leave_bytes, 0))
    return filler


@pytest.mark.integration
def test_a_full_disk_stops_the_run_in_one_line_and_resume_ends_bitwise(uninterrupted, small_disk):
    """The disk fills while step 2 runs: first with no byte left (a journal append fails), then, resumed, with room
    for the journal but not for checkpoint 2. Each stops in one line naming the resume; once space is freed the
    resume ends bitwise."""
    run = small_disk / "run"
    line, filler = fault_in_step_2(run, STEPS, lambda: fill(small_disk, leave_bytes=0))
    assert "No space left on device" in line and f"--resume {run}" in line
    filler.unlink()
    fill(small_disk, leave_bytes=64 << 10)  # the journal's records fit, checkpoint 2's 270 KB of weights do not
    cut = copes_run(*STEPS, "--resume", str(run))
    assert 0 < cut.returncode < 128, cut.stderr
    [line] = assert_said_in_a_line_or_two(cut.stderr)
    assert "No space left on device" in line and "step-000002" in line and f"--resume {run}" in line
    filler.unlink()
    assert_resumes_to(uninterrupted, run)


def stopped_ranks(parent: subprocess.Popen, count: int = 2, timeout: float = 240) -> dict[int, int]:
    """{rank: pid} of the ranks copes-run --workers started, once each stopped itself at its failpoint."""
    deadline = time.monotonic() + timeout
    while True:
        children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        ranks = {}
        for pid in map(int, children):
            try:
                environ = Path(f"/proc/{pid}/environ").read_text().split("\0")
            except OSError:  # a short-lived helper process, gone already
                continue
            rank = next((item[len("RANK="):] for item in environ if item.startswith("RANK=")), None)
            if rank is not None:
                ranks[int(rank)] = pid
        if len(ranks) == count:
            try:
                for pid in ranks.values():
                    wait_until_stopped(pid, timeout=max(deadline - time.monotonic(), 0.1))
                return ranks
            except AssertionError:
                pass
        assert time.monotonic() < deadline and parent.poll() is None, "the ranks never reached their failpoint"
        time.sleep(0.2)


def assert_gone(pids: list[int], within: float = 30) -> None:
    deadline = time.monotonic() + within
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"a rank outlived its run by {within} s"
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.slow  # two --workers 2 runs (six processes) and a resume: ~40 s on 2 cores
def test_sigint_and_a_dead_rank_under_workers_say_how_to_resume(uninterrupted, tmp_path):
    """SIGINT to copes-run --workers 2, then a rank killed in its resume: each ends in at most two lines with the
    resume command, no traceback from any rank, every rank gone; the run then resumes (in one process) bitwise."""
    run = tmp_path / "run"
    workers = ["--workers", "2"]
    parent = copes_run_in_background(*STEPS, *workers, "--output-dir", str(run),
                                     env={"COPES_FAILPOINT": "member@3:SIGSTOP"})  # each rank, in step 2
    try:
        ranks = stopped_ranks(parent)
        parent.send_signal(signal.SIGINT)
        for pid in ranks.values():
            os.kill(pid, signal.SIGCONT)
        _, stderr = parent.communicate(timeout=120)
    finally:
        parent.kill()
    assert parent.returncode == 128 + signal.SIGINT, stderr
    assert f"copes-run --resume {run}" in stderr.splitlines()[-1] and "Traceback" not in stderr, stderr
    assert_gone(list(ranks.values()))

    parent = copes_run_in_background(*STEPS, *workers, "--resume", str(run),
                                     env={"COPES_FAILPOINT": "member@1:SIGSTOP"})
    try:
        ranks = stopped_ranks(parent)
        os.kill(ranks[1], signal.SIGKILL)
        os.kill(ranks[0], signal.SIGCONT)
        _, stderr = parent.communicate(timeout=120)
    finally:
        parent.kill()
    assert 0 < parent.returncode < 128, stderr
    lines = assert_said_in_a_line_or_two(stderr)
    assert f"copes-run --resume {run}" in lines[-1] and "rank 1" in lines[-1], stderr
    assert_gone(list(ranks.values()))
    assert_resumes_to(uninterrupted, run)


def fill_inodes(disk: Path) -> list[Path]:
    """Empty files in `disk` until it has no inode left (its bytes stay free)."""
    made = []
    while True:
        try:
            (path := disk / f"inode-{len(made)}").touch()
        except OSError:
            return made
        made.append(path)


@pytest.mark.integration
def test_no_inode_left_stops_the_run_in_one_line_and_resume_ends_bitwise(uninterrupted, own_disk):
    """Out of inodes while step 2 runs, with bytes to spare: the journal, metrics and samples appends still work,
    creating checkpoint 2 fails. That stops in one line naming the resume; a resume while no inode is free refuses
    in one line; once they are freed it ends bitwise, with step 2's samples written once."""
    disk = own_disk("-o", "size=64m,nr_inodes=400")
    run = disk / "run"
    flags = [*STEPS, "--sample-every", "2"]
    line, fillers = fault_in_step_2(run, flags, lambda: fill_inodes(disk))
    assert "No space left on device" in line and "step-000002" in line and f"--resume {run}" in line
    refused = copes_run(*flags, "--resume", str(run))
    assert 0 < refused.returncode < 128, refused.stderr
    [line] = assert_said_in_a_line_or_two(refused.stderr)
    assert "No space left on device" in line and str(run) in line
    for filler in fillers:
        filler.unlink()
    assert_resumes_to(uninterrupted, run, "--sample-every", "2")
    samples = (run / "samples.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in samples} == {2} and len(set(samples)) == len(samples)


def made_read_only_while_stopped(process: subprocess.Popen, path: Path) -> str:
    """Let `process`, stopped at its failpoint, go on with `path` (a file or folder of its run) on a read-only bind
    mount (root is refused too); its stderr once it ended, the mount removed."""
    try:
        wait_until_stopped(process.pid)
        mount(path, "--bind")
        mount(path, "-o", "remount,bind,ro")
        process.send_signal(signal.SIGCONT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
        subprocess.run(["umount", str(path)], capture_output=True)
    return stderr


@pytest.mark.integration
def test_a_read_only_folder_stops_the_run_in_one_line_and_resume_ends_bitwise(uninterrupted, own_disk):
    """metrics.jsonl turns read-only while step 2 runs, then checkpoints/ while the resume runs step 3, then the
    whole file system: each write stops the run in one line naming the file and the resume, a resume refuses in one
    line, and once the file system is writable again the resume ends bitwise, with checkpoint 2 written after all."""
    disk = own_disk("-o", "size=64m")
    run = disk / "run"
    for flags, stop_at, path, file in [(["--output-dir", str(run)], "member@6", run / "metrics.jsonl", "metrics.jsonl"),
                                       (["--resume", str(run)], "member@2", run / "checkpoints", "step-000003")]:
        process = copes_run_in_background(*STEPS, *flags, env={"COPES_FAILPOINT": f"{stop_at}:SIGSTOP"})
        stderr = made_read_only_while_stopped(process, path)
        assert 0 < process.returncode < 128, stderr
        [line] = assert_said_in_a_line_or_two(stderr)
        assert "Read-only file system" in line and file in line and f"--resume {run}" in line
    mount(disk, "-o", "remount,ro")
    refused = copes_run(*STEPS, "--resume", str(run))
    assert 0 < refused.returncode < 128, refused.stderr
    [line] = assert_said_in_a_line_or_two(refused.stderr)
    assert "Read-only file system" in line and str(run) in line
    mount(disk, "-o", "remount,rw")
    assert_resumes_to(uninterrupted, run)
    assert_every_checkpoint_as_uninterrupted(uninterrupted, run)
