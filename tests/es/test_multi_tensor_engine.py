"""Multi-tensor launches through the public `copes.CoPES` API on the Triton backend (CPU: Triton's interpreter):
a member and an update cost the same launches and host syncs for 35 tensors as for 156, a member reads nothing back
from the device, and the weights are bit for bit those of the per-tensor path."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import copes

from helpers.tiny_models import tiny_qwen3

# Reads of device data on the host. `.numpy()` is left out: it refuses CUDA tensors, so it is never a sync.
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu")
# The code that touches the weights' device: the strategy's plan lives on the host by construction.
ENGINE_DIRS = tuple(str(Path(module.__file__).parent) for module in (copes, __import__("copes_kernels")))
ENGINE_FILES = (str(Path(copes.__file__).parent / "params.py"),)
POPULATION, SUBSPACES = 8, 4
LAYERS = {35: 3, 156: 14}  # trainable tensors (2 + 11 per Qwen3 layer, tied embeddings) -> layers


def _in_engine(frame) -> bool:
    filename = frame.f_code.co_filename
    return filename in ENGINE_FILES or filename.startswith(ENGINE_DIRS[1])


class _AtenOps(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["aten ops"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Counts Triton launches, aten ops and host syncs made by the engine (params.py and copes_kernels)."""
    from triton.runtime.interpreter import GridExecutor

    counts: Counter = Counter()
    with monkeypatch.context() as patch:
        launch = GridExecutor.__call__

        def counted_launch(self, *args, **kwargs):
            counts["launches"] += 1
            return launch(self, *args, **kwargs)

        patch.setattr(GridExecutor, "__call__", counted_launch)
        for name in SYNC_METHODS:
            method = getattr(torch.Tensor, name)

            def counted(self, *args, _method=method, _name=name, **kwargs):
                if _in_engine(sys._getframe(1)):
                    counts[f"sync {_name}"] += 1
                    counts["syncs"] += 1
                return _method(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        nonzero = torch.nonzero

        def counted_nonzero(*args, **kwargs):
            if _in_engine(sys._getframe(1)):
                counts["sync torch.nonzero"] += 1
                counts["syncs"] += 1
            return nonzero(*args, **kwargs)

        patch.setattr(torch, "nonzero", counted_nonzero)
        with _AtenOps(counts):
            yield counts


def _fitness(model: torch.nn.Module) -> float:
    tokens = torch.arange(12).view(2, 6) % model.config.vocab_size
    return -float(model(tokens, labels=tokens).loss)


def _strategy(tensors: int, *, multi_tensor: bool = True, **options: object) -> copes.CoPES:
    model = tiny_qwen3(seed=3, dtype=torch.bfloat16, num_hidden_layers=LAYERS[tensors])
    es = copes.CoPES(model, population=POPULATION, num_subspaces=SUBSPACES, sigma=0.05, lr=0.01, seed=11, **options)
    es.space.multi_tensor = multi_tensor
    assert len(es.space.parameters) == tensors
    return es


def _member_and_update_counts(es: copes.CoPES, monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, Counter]:
    """Counts for one steady-state member (its subspace's table already built) and for the update."""
    rewards = [es.evaluate_member(m, _fitness) for m in range(SUBSPACES)]  # builds the step's tables
    with counting(monkeypatch) as member:
        rewards.append(es.evaluate_member(SUBSPACES, _fitness))
    rewards += [es.evaluate_member(m, _fitness) for m in range(SUBSPACES + 1, POPULATION)]
    with counting(monkeypatch) as update:
        es.apply_update(torch.stack(rewards))
    return member, update


@pytest.mark.slow
def test_member_and_update_launches_and_syncs_do_not_grow_with_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COPES_BACKEND", "triton")
    with torch.no_grad():
        counts = {tensors: _member_and_update_counts(_strategy(tensors), monkeypatch) for tensors in LAYERS}
    (member_small, update_small), (member_large, update_large) = counts[35], counts[156]
    assert member_small["launches"] == member_large["launches"] == 2  # one perturb+backup, one restore
    assert member_small["syncs"] == member_large["syncs"] == 0, member_large
    assert update_small["launches"] == update_large["launches"] == 1
    assert update_small["syncs"] == update_large["syncs"], (update_small, update_large)
    assert update_large["aten ops"] == update_small["aten ops"], (update_small, update_large)

    # The counters see what the per-tensor path does: it launches per tensor of the member's subspace (here each
    # tensor is one chunk, so about a quarter of them) and syncs per tensor.
    monkeypatch.setenv("COPES_BACKEND", "triton")
    with torch.no_grad():
        per_tensor_member, per_tensor_update = _member_and_update_counts(_strategy(35, multi_tensor=False), monkeypatch)
    assert per_tensor_member["launches"] >= 35 // SUBSPACES and per_tensor_member["syncs"] >= 35, per_tensor_member
    assert per_tensor_update["launches"] >= 35 and per_tensor_update["syncs"] >= 35, per_tensor_update


@pytest.mark.parametrize(
    "options", [{}, pytest.param(dict(restore="subtract", stream_elements=1000), marks=pytest.mark.slow)],
    ids=["whole", "sliced"],
)
def test_multi_tensor_weights_match_the_per_tensor_path_bit_for_bit(
    options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "sliced": with stream_elements the per-tensor path works slice by slice; the fused path serves a subtracting
    # restore and the update whole (they hold no transient buffers for slicing to bound).
    monkeypatch.setenv("COPES_BACKEND", "triton")
    fused, per_tensor = _strategy(35, **options), _strategy(35, multi_tensor=False, **options)
    assert fused.space._fused() and fused.space._fused(update=True)
    for _ in range(2):
        fused_stats, per_tensor_stats = fused.step(_fitness), per_tensor.step(_fitness)
        assert fused_stats.mean_reward == per_tensor_stats.mean_reward
        assert fused_stats.update_norm == pytest.approx(per_tensor_stats.update_norm, rel=1e-5)
    fused_state, per_tensor_state = fused.model.state_dict(), per_tensor.model.state_dict()
    for name, tensor in fused_state.items():
        assert torch.equal(tensor.view(torch.int16), per_tensor_state[name].view(torch.int16)), name


def test_eggroll_population_forward_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """member_of_row is validated once per row_members block, so lowrank_linear itself makes no host sync."""
    monkeypatch.setenv("COPES_BACKEND", "triton")
    model = tiny_qwen3(seed=3, num_hidden_layers=2)
    es = copes.EGGROLL(model, population=4, sigma=0.05, lr=0.01, rank=1, seed=11)
    tokens = torch.arange(4 * 5).view(4, 5) % model.config.vocab_size
    counted: list[Counter] = []

    def fitness(model: torch.nn.Module, row_members) -> torch.Tensor:
        with row_members(torch.arange(4)):
            with counting(monkeypatch) as counts:
                logits = model(tokens).logits
            counted.append(counts)
        return -logits.float().square().mean(dim=(1, 2))

    es.step(fitness)
    assert counted[0]["launches"] >= 7 and counted[0]["syncs"] == 0, counted[0]  # 7 linears per layer, 2 layers
