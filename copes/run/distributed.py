"""Population sharding with torch.distributed: only scalars cross the wire.

Every rank holds the whole model and evaluates its share of the members (a balanced, deterministic split); the
rewards are all-gathered; every rank applies the identical update from the seeds. Launch with
`torchrun --nproc-per-node P $(which copes-run) ...` — NCCL on GPUs, gloo on CPU. A cheap checksum of the weights
is compared across ranks every few steps, so a silent divergence becomes a clear error naming the step, and every
collective has a timeout, so a dead or hung rank ends the run with a message instead of a hang.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0


class DistributedError(RuntimeError):
    """Ranks disagree or one of them stopped answering."""


class RankDied(RuntimeError):
    """A rank that copes-run --workers started was killed by a signal."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Set for the ranks copes-run's --workers starts, so they know torchrun's world is theirs.
WORKERS_ENV = "COPES_WORKERS"


def launched_distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def launched_by_copes_run() -> bool:
    return os.environ.get(WORKERS_ENV) == os.environ.get("WORLD_SIZE")


def launch_local_ranks(ranks: int, python_args: list[str]) -> int:
    """`python *python_args` as `ranks` ranks on this machine (torch's elastic launcher, rendezvous on localhost, no
    restarts). Returns the exit status: 0, or that of the first rank that failed (which said why); raises RankDied
    when that rank was killed by a signal, and Interrupted when this process got SIGTERM or SIGINT (the launcher
    passes it on to every rank, which then ends quietly)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from copes.errors import Interrupted

    for name in list(logging.root.manager.loggerDict):  # its shutdown notes (each module's logger has a level of
        if name.startswith("torch.distributed.elastic"):  # its own): copes-run says what happened in one line
            logging.getLogger(name).setLevel(logging.CRITICAL)

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    os.environ[WORKERS_ENV] = str(ranks)  # the ranks inherit it
    try:
        elastic_launch(config, entrypoint=sys.executable)(*python_args)
    except ChildFailedError as error:
        _, failure = error.get_first_failure()
        if failure.exitcode < 0:  # killed by that signal
            raise RankDied(f"rank {failure.local_rank} of this run was killed by "
                           f"{signal.Signals(-failure.exitcode).name}") from None
        return failure.exitcode
    except SignalException as stop:
        raise Interrupted(stop.sigval) from None
    finally:
        os.environ.pop(WORKERS_ENV, None)
    return 0


def init_distributed(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext | None:
    """Join the process group torchrun set up; None for a plain single-process launch."""
    if not launched_distributed():
        return None
    _die_with_launcher()
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
    else:
        local = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=local)


def leave_distributed() -> None:
    """Tear this rank's process group down before the interpreter exits: a gloo group left to the exit can abort a
    rank that finished its run ("terminate called without an active exception", status -6). A no-op outside a
    distributed launch, where a process group is another library's (vLLM's world of one, which it goes on using)."""
    if launched_distributed() and dist.is_initialized():
        dist.destroy_process_group()


def _die_with_launcher() -> None:
    """If the launcher (torchrun's agent, or copes-run --workers) is killed, this rank goes too rather than train
    on as an orphan beside a resumed run writing the same journal. Linux only; elsewhere a collective's timeout
    ends it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <sys/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def members_for_rank(population: int, rank: int, world_size: int) -> list[int]:
    """Contiguous shares whose sizes differ by at most one (the first `population % world_size` ranks get one more)."""
    base, extra = divmod(population, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def _collective(what: str, step: int, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except (RuntimeError, dist.DistBackendError) as error:
        raise DistributedError(
            f"step {step}: {what} failed — another rank died, hung past the timeout or diverged "
            f"({str(error).splitlines()[0]})"
        ) from None


def gather_member_rewards(local: dict[int, torch.Tensor], population: int, step: int) -> list[torch.Tensor]:
    """Every rank's {member: rewards} merged into the full population list, in member order, on every rank."""
    shares: list[dict[int, torch.Tensor] | None] = [None] * dist.get_world_size()
    _collective("gathering rewards", step,
                lambda: dist.all_gather_object(shares, {m: r.cpu() for m, r in local.items()}))
    merged = {member: rewards for share in shares for member, rewards in (share or {}).items()}
    missing = sorted(set(range(population)) - set(merged))
    if missing:
        raise DistributedError(f"step {step}: no rewards arrived for members {missing}")
    return [merged[member] for member in range(population)]


CHECKSUM_SLICE_ELEMENTS = 1 << 20  # bounds the checksum's temporaries to a few int64 slices (8 MiB each)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_checksum(model: torch.nn.Module, slice_elements: int = CHECKSUM_SLICE_ELEMENTS) -> torch.Tensor:
    """Per parameter, int64 [sum of b, sum of b^2, sum of (position + 1) * b] over each element's raw bits b,
    wrapping modulo 2^64. Integer sums are exact and do not depend on the order of summation (slice size, device
    reduction), so equal weights give equal checksums on every rank; any changed bit changes the first sum.
    Works slice by slice: the largest temporaries are a few int64 slices, never a copy of the tensor."""
    rows = []
    for parameter in model.parameters():
        flat = parameter.detach().reshape(-1)
        bits = flat.view(_BITS[flat.element_size()])
        total = torch.zeros(3, dtype=torch.int64, device=flat.device)
        for start in range(0, bits.numel(), slice_elements):
            values = bits[start : start + slice_elements].to(torch.int64)
            positions = torch.arange(start + 1, start + 1 + values.numel(), dtype=torch.int64, device=flat.device)
            total += torch.stack((values.sum(), (values * values).sum(), (values * positions).sum()))
        rows.append(total)
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 3, dtype=torch.int64)


def check_in_sync(model: torch.nn.Module, step: int) -> None:
    """Raise DistributedError on every rank when any rank's weights differ from rank 0's."""
    mine = weights_checksum(model)
    everyone: list[torch.Tensor | None] = [None] * dist.get_world_size()
    _collective("comparing weight checksums", step, lambda: dist.all_gather_object(everyone, mine))
    diverged = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
    if diverged:
        raise DistributedError(f"step {step}: weights of rank(s) {diverged} diverged from rank 0's")


def gather_values(value: Any, step: int) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (e.g. each rank's share of a held-out evaluation)."""
    values: list[Any] = [None] * dist.get_world_size()
    _collective("gathering from every rank", step, lambda: dist.all_gather_object(values, value))
    return values


def barrier(step: int) -> None:
    _collective("waiting for the other ranks", step, dist.barrier)


def broadcast_value(value: Any, step: int) -> Any:
    """Rank 0's value on every rank (e.g. whether to stop on the time budget)."""
    box = [value]
    _collective("broadcasting from rank 0", step, lambda: dist.broadcast_object_list(box, src=0))
    return box[0]
