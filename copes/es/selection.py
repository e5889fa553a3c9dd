"""Which tensors ES moves: parameter selection by name patterns, each tensor's noise id, and the 16-bit tensors
on which noise rounds away (sub-ulp). `copes.es.params.ParameterSpace` builds on it and owns every write.

Selection: parameter names (as `model.named_parameters()` spells them) are matched with shell-style `fnmatch`
patterns, case-sensitive, where `*` also crosses dots (`"*.mlp.*"`, `"model.layers.1[0-5].*"`). A parameter is
trainable when it matches some `include` pattern (all do when include is None) and no `exclude` pattern.
`names` instead selects exactly the listed parameters (a strategy that narrows a pattern selection, e.g. to
linear weights, passes the names it kept). `requires_grad` is ignored: ES needs no autograd, and inference code
often switches it off. Tied weights (embedding == lm_head) are one Parameter object and appear once, under their
first name.

Noise ids: `tensor_id = zlib.crc32(name)`, stable across processes and runs (unlike Python's `hash`); two
selected names with the same id are rejected, since they would receive identical noise.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
import zlib
from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tensor_id_for(name: str) -> int:
    """The 32-bit noise id of a parameter name (CRC-32 of its UTF-8 bytes)."""
    return zlib.crc32(name.encode("utf-8"))


def _as_patterns(name: str, patterns: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        return (patterns,)
    result = tuple(patterns)
    if not all(isinstance(p, str) for p in result):
        raise ValueError(f"{name} must be a pattern string or a sequence of them, got {patterns!r}")
    return result


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def select_parameters(
    model: torch.nn.Module,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    names: Sequence[str] | None = None,
) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, Parameter) pairs ES may move, in model order: by patterns, or exactly `names`.

    Rejects unsupported dtypes, non-contiguous tensors and tensor-id collisions among the selected names.
    """
    include_patterns, exclude_patterns = _as_patterns("include", include), _as_patterns("exclude", exclude)
    wanted = None if names is None else set(names)
    selected: list[tuple[str, torch.nn.Parameter]] = []
    names_by_id: dict[int, str] = {}
    for name, param in model.named_parameters():  # remove_duplicate=True: a tied weight appears once
        if wanted is not None:
            if name not in wanted:
                continue
        elif (include_patterns is not None and not _matches(name, include_patterns)) or (
            exclude_patterns and _matches(name, exclude_patterns)
        ):
            continue
        if param.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"parameter {name!r} is {param.dtype}; ES supports {SUPPORTED_DTYPES} (exclude it)")
        if not param.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous; make it contiguous or exclude it")
        tensor_id = tensor_id_for(name)
        if tensor_id in names_by_id:
            raise ValueError(
                f"parameters {names_by_id[tensor_id]!r} and {name!r} share tensor_id {tensor_id:#010x} "
                "(CRC-32 collision) and would receive identical noise: exclude or rename one of them"
            )
        names_by_id[tensor_id] = name
        selected.append((name, param))
    if wanted is not None and len(selected) != len(wanted):
        missing = sorted(wanted - {name for name, _ in selected})
        raise ValueError(f"the model has no parameter named {', '.join(map(repr, missing))}")
    if not selected:
        raise ValueError(
            f"include={include_patterns!r} / exclude={exclude_patterns!r} select no parameter of the model")
    return selected


def _keep_probabilities(dtype: torch.dtype, sigma: float) -> torch.Tensor:
    """float64 [65536]: for each bit pattern of a 16-bit `dtype` (indexed by the pattern as an int16 + 32768), the
    probability that noise N(0, sigma^2) rounds the value back to itself: it keeps its value when the noise stays
    within half the gap to its neighbours above (u) and below (d), (erf(u / (2 sqrt(2) sigma)) + erf(d / (2 sqrt(2)
    sigma))) / 2. Non-finite patterns count 0."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    gaps = [(torch.nextafter(values, torch.full_like(values, bound)) - values).double().abs()
            for bound in (math.inf, -math.inf)]
    scale = 2 * math.sqrt(2) * sigma
    return ((torch.erf(gaps[0] / scale) + torch.erf(gaps[1] / scale)) / 2).nan_to_num(0.0)


def rounds_away_fraction(tensor: torch.Tensor, sigma: float, slice_elements: int = 1 << 24) -> float:
    """The expected fraction of a 16-bit `tensor`'s elements on which noise N(0, sigma^2) rounds back to the same
    value. A 16-bit value has 65,536 possible bit patterns: the elements are counted per pattern (sliced, so the
    temporaries stay small on a large embedding) and the counts weighted by each pattern's probability, a fraction
    of the cost of computing the gaps per element (4B parameters: seconds instead of half a minute at every start)."""
    if tensor.element_size() != 2:
        raise ValueError(f"rounds_away_fraction takes 16-bit tensors, not {tensor.dtype}")
    flat = tensor.detach().reshape(-1).view(torch.int16)
    counts = torch.zeros(65536, dtype=torch.int64)
    for start in range(0, flat.numel(), slice_elements):
        counts += torch.bincount(flat[start : start + slice_elements].to(torch.int32) + 32768, minlength=65536)
    return float(counts.double() @ _keep_probabilities(tensor.dtype, sigma)) / max(flat.numel(), 1)


def sub_ulp_names(selected: Sequence[tuple[str, torch.Tensor]], sigma: float) -> list[str]:
    """The 16-bit tensors on which perturbations of scale `sigma` round away on most elements (norm weights near 1,
    Qwen3.5's A_log and dt_bias in bf16 at sigma_k = 2e-3): ES sees nothing of their noise, so their update would
    be a random walk."""
    return [name for name, tensor in selected
            if tensor.element_size() == 2 and rounds_away_fraction(tensor, sigma) > 0.5]


def _name_groups(names: Sequence[str]) -> str:
    """'model.layers.*.input_layernorm.weight (32), model.norm.weight': the names with layer indices folded."""
    groups: dict[str, int] = {}
    for name in names:
        folded = re.sub(r"\.\d+\.", ".*.", name)
        groups[folded] = groups.get(folded, 0) + 1
    return ", ".join(f"{group} ({count})" if count > 1 else group for group, count in groups.items())


def without_sub_ulp(selected: list[tuple[str, torch.nn.Parameter]],
                    sigma: float) -> list[tuple[str, torch.nn.Parameter]]:
    """The default selection less its sub-ulp tensors, named in one notice (an `include` keeps them). Called from
    `ParameterSpace.__init__`: the notice points at the line that built the space."""
    dropped = set(sub_ulp_names(selected, sigma))
    if not dropped or len(dropped) == len(selected):
        return selected
    warnings.warn(f"not perturbing {len(dropped)} 16-bit tensors on which noise of scale {sigma:g} rounds away on "
                  f"most elements: {_name_groups([n for n, _ in selected if n in dropped])} (pass include "
                  "patterns to choose the tensors yourself)", stacklevel=3)
    return [(name, param) for name, param in selected if name not in dropped]
