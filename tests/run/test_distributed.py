"""Population sharding over torch.distributed (gloo on CPU): balanced splits, gathered rewards, the checksum guard,
timeouts, and — end to end through torchrun and the console script — weights bitwise equal to one process."""

import os
import shutil
import socket
import subprocess
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from copes.run.distributed import (
    DistributedError,
    check_in_sync,
    gather_member_rewards,
    leave_distributed,
    members_for_rank,
    weights_checksum,
)


@pytest.mark.parametrize("population, world", [(40, 2), (5, 2), (7, 3), (3, 4), (1, 1)])
def test_member_split_is_balanced_complete_and_deterministic(population, world):
    shares = [members_for_rank(population, rank, world) for rank in range(world)]
    assert sorted(m for share in shares for m in share) == list(range(population))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_checksum_sees_a_single_changed_element():
    model = torch.nn.Linear(8, 8)
    before = weights_checksum(model)
    with torch.no_grad():
        model.weight[3, 5] = torch.nextafter(model.weight[3, 5], torch.tensor(10.0))
    assert not torch.equal(before, weights_checksum(model))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, scenario: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=5))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        if scenario == "diverged" and rank == 1:
            with torch.no_grad():
                model.bias[0] += 1e-6
        if scenario == "hang" and rank == 1:
            return  # never joins the collective: rank 0 must time out with a message, not wait forever
        if scenario == "gather":
            mine = members_for_rank(5, rank, world)
            rewards = gather_member_rewards({m: torch.tensor([float(m), 10.0 * m]) for m in mine}, 5, step=1)
            results[rank] = torch.stack(rewards).tolist()
        else:
            check_in_sync(model, step=7)
            results[rank] = "in sync"
    except DistributedError as error:
        results[rank] = str(error)
    finally:
        if scenario != "hang" or rank == 0:
            leave_distributed()


def _run(scenario: str, world: int = 2) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, _free_port(), scenario, results), nprocs=world, join=True)
    return dict(results)


HELD_OUT = {"steps": 0, "population": 4, "subspaces": 2, "eval_size": 7, "max_new_tokens": 6, "device": "cpu",
            "sample_every": 0, "cpu_threads": 1}


def _held_out_rank(rank: int, world: int, port: int, out: str, results) -> None:
    """One rank of a real Trainer's held-out evaluation: which questions this rank rolled out, and the result."""
    import copes.run.trainer as trainer_module
    from copes.config.options import build_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    trainer = trainer_module.Trainer(build_config({**HELD_OUT, "output_dir": out}), progress=False)
    seen, evaluate = [], trainer_module.evaluate

    def recording_evaluate(model, tokenizer, task, examples, **options):
        seen.append([example.id for example in examples])
        return evaluate(model, tokenizer, task, examples, **options)

    trainer_module.evaluate = recording_evaluate
    results[rank] = (seen, trainer.held_out(step=0))
    leave_distributed()


@pytest.mark.slow  # two spawned ranks and a third trainer: ~25 s on 2 cores
def test_held_out_evaluation_is_sharded_across_ranks_and_merged(tmp_path):
    """Each of 2 ranks rolls out its contiguous share of the 7 held-out questions (4 + 3), and every rank gets
    the merged result, the one a single process gets."""
    from copes.config.options import build_config
    from copes.run.trainer import Trainer

    results = mp.Manager().dict()
    mp.spawn(_held_out_rank, args=(2, _free_port(), str(tmp_path / "pair"), results), nprocs=2, join=True)
    single = Trainer(build_config({**HELD_OUT, "output_dir": str(tmp_path / "single")}), progress=False)
    everyone = [example.id for example in single.eval_set]
    (seen_0, record_0), (seen_1, record_1) = results[0], results[1]
    assert (seen_0, seen_1) == ([everyone[:4]], [everyone[4:]])
    assert record_0 == record_1 == single.held_out(step=0)
    assert record_0["questions"] == 7


def test_a_finished_rank_leaves_its_group_and_a_plain_run_leaves_other_groups_alone(monkeypatch):
    """Every rank ends with `leave_distributed`: a gloo group left to the interpreter's exit aborted 14 of 80
    finished ranks here (status -6, "terminate called without an active exception"); torn down first, 0 of 80.
    Outside a distributed launch a group is another library's (vLLM starts a world of one in-process): it stays."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=5))
    try:
        leave_distributed()  # WORLD_SIZE unset: a plain run
        assert dist.is_initialized()
        monkeypatch.setenv("WORLD_SIZE", "2")  # as a rank of torchrun or --workers sees it
        leave_distributed()
        assert not dist.is_initialized()
        leave_distributed()  # leaving twice is harmless
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_rewards_of_an_uneven_split_are_gathered_in_member_order():
    results = _run("gather")
    expected = [[float(m), 10.0 * m] for m in range(5)]
    assert results == {0: expected, 1: expected}


def test_checksum_guard_passes_in_sync_and_fires_on_divergence():
    assert _run("in_sync") == {0: "in sync", 1: "in sync"}
    diverged = _run("diverged")
    assert all(message == "step 7: weights of rank(s) [1] diverged from rank 0's" for message in diverged.values())


def test_a_rank_that_never_answers_ends_in_a_clear_timeout():
    results = _run("hang")
    assert results[0].startswith("step 7: comparing weight checksums failed — another rank died, hung")


@pytest.mark.parametrize("algorithm, population, subspaces, launch", [
    ("copes", "6", "2", "torchrun"), ("es", "5", "1", "torchrun"), ("copes", "6", "2", "workers")])
@pytest.mark.integration
def test_two_processes_match_one_process_bitwise(algorithm, population, subspaces, launch, tmp_path):
    """The console script as 2 gloo ranks — under torchrun, or started by its own --workers 2 — ends with the
    single-process weights, metrics and samples (N=5: an uneven split)."""
    from helpers import cli_runs

    flags = ["--algorithm", algorithm, "--population", population, "--subspaces", subspaces, "--steps", "2",
             "--checkpoint-every", "0", "--eval-size", "8", "--sample-every", "1"]
    single = cli_runs.copes_run(*flags, "--output-dir", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr
    pair_flags = [*cli_runs.FAST_FLAGS, *flags, "--device", "cpu", "--output-dir", str(tmp_path / "pair")]
    if launch == "torchrun":
        command = [*cli_runs.TORCHRUN_PAIR, shutil.which("copes-run"), "--model", cli_runs.MODEL, *pair_flags]
    else:
        command = [shutil.which("copes-run"), "--model", cli_runs.MODEL, *pair_flags, "--workers", "2"]
    pair = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert pair.returncode == 0, pair.stderr[-3000:]
    cli_runs.assert_same_weights(cli_runs.final_weights(tmp_path / "pair"), cli_runs.final_weights(tmp_path / "single"))
    assert cli_runs.metrics_without_time(tmp_path / "pair") == cli_runs.metrics_without_time(tmp_path / "single")
    # the step's best and worst over both ranks' members (issue #54: rank 0's alone were sampled)
    assert (tmp_path / "pair" / "samples.jsonl").read_text() == (tmp_path / "single" / "samples.jsonl").read_text()
    if launch == "workers":  # rank 0 speaks for both, once
        assert pair.stdout.count("held-out accuracy") == 1, pair.stdout


@pytest.mark.integration
def test_workers_under_torchrun_is_refused_in_one_line(tmp_path):
    from helpers.cli_runs import FAST_FLAGS, MODEL, TORCHRUN_PAIR

    command = [*TORCHRUN_PAIR, shutil.which("copes-run"), "--model", MODEL, *FAST_FLAGS, "--steps", "1",
               "--workers", "2", "--device", "cpu", "--output-dir", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "error: --workers starts its own ranks; under torchrun leave it at 1" in result.stderr


def _reference_checksum(tensor: torch.Tensor) -> list[int]:
    """[sum b, sum b^2, sum (i + 1) b] of the raw bits b, in Python integers, modulo 2^64 as signed int64."""
    bits = tensor.detach().reshape(-1).view({2: torch.int16, 4: torch.int32}[tensor.element_size()]).tolist()
    sums = [sum(bits), sum(b * b for b in bits), sum((i + 1) * b for i, b in enumerate(bits))]
    return [(value + 2**63) % 2**64 - 2**63 for value in sums]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_is_exact_and_order_free(dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 70).to(dtype)
    expected = torch.tensor([_reference_checksum(p) for p in model.parameters()], dtype=torch.int64)
    for slice_elements in (1 << 20, 4096, 7):  # other slicings sum in other orders: the same integers
        assert torch.equal(weights_checksum(model, slice_elements=slice_elements), expected)


def test_checksum_temporaries_stay_within_a_few_slices():
    """The old checksum made three fp64 copies of each tensor (~15 GB for Qwen3.5-4B's embedding)."""
    from copes.run.distributed import CHECKSUM_SLICE_ELEMENTS

    from helpers.live_bytes import LiveBytes

    embedding = torch.nn.Embedding(1 << 14, 1 << 10, dtype=torch.bfloat16)  # 16M elements, 32 MiB
    with LiveBytes(embedding.parameters()) as live:
        weights_checksum(embedding)
    assert live.peak <= 4 * 8 * CHECKSUM_SLICE_ELEMENTS + (1 << 20) < 3 * 8 * embedding.weight.numel()
