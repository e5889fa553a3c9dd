"""The run journal: every scored member and every applied update, appended and fsynced as it happens.

ES weights after step t are a pure function of the base weights, the seeds and the rewards of steps 1..t, so
this file (kilobytes per run) is enough to rebuild any step (`copes.run.replay`) and to resume after SIGKILL losing
at most the member in flight. `<output_dir>/journal` holds one record per line, `<crc32 hex> <json>\\n`:

    {"kind": "header", ...}                                    first: everything that fixes the trajectory, with
                                                               the sha256 of the user's data and modules
    {"kind": "eval", "step": 0, "record": {...}}               the held-out evaluation before training
    {"kind": "member", "step": s, "member": i, "rewards": r}   one per scored member (steps count from 1)
    {"kind": "update", "step": s, "record": {...}}             step s's metrics record, once its update is applied

Each record is one write() followed by fsync. SIGKILL mid-write can only leave a prefix of the last line, which
has no newline: that torn tail is dropped on read and cut off before the next append. Any complete line whose
checksum fails, a record out of order or a step missing a member is an error naming the line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from copes.config.options import FIELD_NAMES, RESUME_KEYS, ConfigError, TrainConfig, absolute_paths, build_config
from copes.es.selection import tensor_id_for
from copes.es.strategies.base import Strategy
from copes.failpoints import failpoint
from copes.tasks.plugins import changed_source, user_sources
from copes.user_code import sha256_of

JOURNAL_NAME = "journal"
FORMAT_VERSION = 1


# ---------------------------------------------------------------- identity of a run


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every state_dict entry's name, dtype, shape and bytes: any changed weight changes it."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy())  # the buffer itself: .tobytes() copied each tensor (1.2 GiB
        # transient for Qwen3.5-4B's embedding, the dress rehearsal's peak over its plan)
    return digest.hexdigest()


def strategy_identity(strategy: Strategy) -> dict[str, Any]:
    """The strategy's trajectory-fixing settings (its state_dict's `config`, JSON round-tripped so a header read
    back compares equal) and the noise id of every trainable tensor."""
    config = json.loads(json.dumps(strategy.state_dict()["config"]))
    names = config.get("parameters") or config.get("matrices") or {}
    return {"strategy": config, "tensor_ids": {name: tensor_id_for(name) for name in names}}


def copes_version() -> str:
    """The installed copes distribution's version, read from its metadata (this layer never imports the package's
    face); a source checkout used through PYTHONPATH alone has no metadata and says so."""
    try:
        return importlib.metadata.version("copes")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_header(cfg: TrainConfig, model: torch.nn.Module, strategy: Strategy, model_path: str, *,
                 run_id: str, data_files: Sequence[Path] = ()) -> dict[str, Any]:
    """The journal's first record; `model` must still hold the base weights; `data_files` the local data files
    copes' own task read (`copes.tasks.loading.recording_data_files`)."""
    import transformers

    return {
        "kind": "header", "format": FORMAT_VERSION, "run_id": run_id,
        "versions": {"copes": copes_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "config": cfg.to_dict(),
        "user_sources": user_sources(cfg.task, cfg.task_options, cfg.reward),
        "data_files": {str(path): sha256_of(path) for path in data_files},  # copes' own tasks' local data
        "model": {"name": cfg.model, "path": model_path, "fingerprint": model_fingerprint(model),
                  # A single-file model (a GGUF) by its bytes: a resume checks it before loading anything.
                  "sha256": sha256_of(Path(model_path)) if Path(model_path).is_file() else None},
        **strategy_identity(strategy),
    }


def check_same_run(run_dir: str | Path, header: dict[str, Any], cfg: TrainConfig) -> None:
    """The first RESUME_KEYS difference between the journaled run and `cfg`, as one sentence."""
    # A key an older journal lacks is an option added since; that run had its default.
    theirs = {**asdict(TrainConfig()), **header["config"]}
    for key in RESUME_KEYS:
        if getattr(cfg, key) != theirs[key]:
            raise ConfigError(f"--resume {run_dir} belongs to a different run: {key}={theirs[key]!r} there, "
                              f"{getattr(cfg, key)!r} here")
    changed = changed_source(header.get("user_sources", {}), user_sources(cfg.task, cfg.task_options, cfg.reward))
    if changed:
        raise ConfigError(f"--resume {run_dir} refused: {changed}; the journaled rewards came from the old one")
    model_file, digest = Path(header["model"]["path"]), header["model"].get("sha256")
    if digest and not model_file.is_file():
        raise ConfigError(f"--resume {run_dir} refused: the model file {model_file} cannot be found any more")
    if digest and (now := sha256_of(model_file)) != digest:
        raise ConfigError(f"--resume {run_dir} refused: the model file {model_file} changed since the run started "
                          f"(sha256 {digest[:12]} there, {now[:12]} here); the journaled rewards came from the old one")


def check_same_data(run_dir: str | Path, header: dict[str, Any]) -> None:
    """Refuse a resume once a local data file of copes' own task, read by now, is gone or changed (hashed at start;
    a user's data file is among the user_sources, checked before anything loads)."""
    for path, digest in header.get("data_files", {}).items():
        if not Path(path).is_file():
            raise ConfigError(f"--resume {run_dir} refused: the data file {path} cannot be found any more")
        if (now := sha256_of(Path(path))) != digest:
            raise ConfigError(f"--resume {run_dir} refused: the data file {path} changed since the run started "
                              f"(sha256 {digest[:12]} there, {now[:12]} here)")


def check_same_model(run_dir: str | Path, header: dict[str, Any], model: torch.nn.Module, strategy: Strategy) -> None:
    """Refuse a base model whose weights or trainable tensors are not the ones the run started from."""
    fingerprint = model_fingerprint(model)
    if fingerprint != header["model"]["fingerprint"]:
        raise ConfigError(f"{run_dir}: the base model {header['model']['name']} changed since the run started "
                          f"(weights fingerprint {header['model']['fingerprint'][:12]} there, {fingerprint[:12]} here)")
    identity = strategy_identity(strategy)
    for key in ("strategy", "tensor_ids"):
        if identity[key] != header[key]:
            differing = sorted(k for k in identity[key].keys() | header[key].keys()
                               if identity[key].get(k) != header[key].get(k))
            raise ConfigError(f"{run_dir}: the trainable parameters or strategy settings differ from the run's "
                              f"({', '.join(map(str, differing[:3]))})")


def resume_config(run_dir: str | Path, file_layer: dict[str, Any], flags: dict[str, Any]) -> TrainConfig:
    """The journaled run's own settings, under --config and flags; a trajectory-fixing value that differs is
    refused in one sentence, and the run continues in its own directory."""
    header = read_header(run_dir)
    saved = {k: v for k, v in header["config"].items() if k in FIELD_NAMES}
    flags = {k: v for k, v in flags.items() if v != ()}  # a repeatable option left empty is unset, not []
    flags = {**absolute_paths(flags), "output_dir": flags.get("output_dir") or str(run_dir)}
    cfg = build_config(saved, absolute_paths(file_layer), flags)
    check_same_run(run_dir, header, cfg)
    if Path(cfg.output_dir).resolve() != Path(run_dir).resolve():
        raise ConfigError(f"--resume {run_dir} continues that run in its own directory; --output-dir "
                          f"{cfg.output_dir} names another one")
    return cfg


# ---------------------------------------------------------------- records on disk


def encode(record: dict[str, Any]) -> bytes:
    """One line: the CRC-32 of the JSON payload, a space, the payload (floats round-trip exactly through repr)."""
    payload = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def _decode(line: bytes, number: int, path: Path) -> dict[str, Any]:
    checksum, _, payload = line.partition(b" ")
    try:
        intact = int(checksum, 16) == zlib.crc32(payload)
    except ValueError:
        intact = False
    if not intact:
        raise ConfigError(f"{path}:{number}: record is corrupt (checksum mismatch)")
    return json.loads(payload)


def rewards_tensor(value: Any) -> torch.Tensor:
    """A journaled reward value (a float or per-question floats) as the float64 tensor the strategy scored."""
    return torch.tensor(value, dtype=torch.float64)


@dataclass
class JournalContents:
    """A journal read and checked: the records grouped by step."""

    path: Path
    header: dict[str, Any]
    eval_before: dict[str, Any] | None = None
    updates: list[dict[str, Any]] = field(default_factory=list)  # step s's metrics record at index s - 1
    members: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # step -> member -> rewards
    valid_bytes: int = 0  # where the intact records end (a torn tail starts there)
    torn: bool = False

    @property
    def population(self) -> int:
        return int(self.header["config"]["population"])

    @property
    def steps_done(self) -> int:
        return len(self.updates)

    def rewards_of(self, step: int) -> torch.Tensor:
        """[N] or [N, Q] rewards of a completed step, stacked in member order as the trainer applied them."""
        return torch.stack([self.members[step][m] for m in range(self.population)])

    def evals(self, through_step: int) -> list[dict[str, Any]]:
        """The held-out evaluations recorded up to a step, the one before training first."""
        during = [u["eval"] for u in self.updates[:through_step] if "eval" in u]
        return ([self.eval_before] if self.eval_before else []) + during

    def _add(self, record: dict[str, Any], where: str) -> None:
        kind, step = record.get("kind"), record.get("step")
        current = self.steps_done + 1
        if kind == "eval" and step == 0 and self.eval_before is None:
            self.eval_before = record["record"]
        elif kind == "member" and step == current and 0 <= record["member"] < self.population:
            members = self.members.setdefault(step, {})
            if record["member"] in members:
                raise ConfigError(f"{where}: member {record['member']} of step {step} is recorded twice")
            members[record["member"]] = rewards_tensor(record["rewards"])
        elif kind == "update" and step == current:
            missing = sorted(set(range(self.population)) - set(self.members.get(step, {})))
            if missing:
                raise ConfigError(f"{where}: the journal has a gap: step {step} was updated without members {missing}")
            self.updates.append(record["record"])
        else:
            raise ConfigError(f"{where}: the journal has a gap: a {kind} record of step {step} where step {current} "
                              "was expected")


def journal_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / JOURNAL_NAME


def _lines(path: Path) -> tuple[list[bytes], bool]:
    """Complete lines and whether a torn (newline-less) tail followed them."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path.parent} is not a checkpoint or run directory: it has no {JOURNAL_NAME}") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None
    lines = data.split(b"\n")
    return lines[:-1], lines[-1] != b""


def read_header(run_dir: str | Path) -> dict[str, Any]:
    path = journal_path(run_dir)
    return _header(_lines(path)[0], path)


def _header(lines: list[bytes], path: Path) -> dict[str, Any]:
    header = _decode(lines[0], 1, path) if lines else None
    if not header or header.get("kind") != "header":
        raise ConfigError(f"{path}:1: the journal does not start with a header")
    if header.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{path}: journal format {header.get('format')} is not {FORMAT_VERSION}, "
                          "the one this copes reads")
    return header


def read_journal(run_dir: str | Path) -> JournalContents:
    """Every intact record, checked for order and gaps; a torn last record is dropped."""
    path = journal_path(run_dir)
    lines, torn = _lines(path)
    contents = JournalContents(path=path, header=_header(lines, path), torn=torn, valid_bytes=len(lines[0]) + 1)
    for number, line in enumerate(lines[1:], start=2):
        contents._add(_decode(line, number, path), f"{path}:{number}")
        contents.valid_bytes += len(line) + 1
    return contents


class JournalWriter:
    """Appends records durably: each is one write() and an fsync before the call returns."""

    def __init__(self, path: Path, *, keep_bytes: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.ftruncate(self._fd, keep_bytes)  # cut a torn tail off before appending after it

    @classmethod
    def create(cls, path: Path, header: dict[str, Any]) -> JournalWriter:
        """A new journal holding only `header`, swapped in atomically (a previous run's journal is replaced)."""
        line = encode(header)
        staging = path.with_name(f".{path.name}.tmp")
        with staging.open("wb") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return cls(path, keep_bytes=len(line))

    def append(self, record: dict[str, Any]) -> None:
        view = memoryview(encode(record))
        while view:
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)
        failpoint("journal")  # crash tests: die right after a record became durable

    def close(self) -> None:
        os.close(self._fd)


class RunJournal:
    """The trainer's view of its journal: what is already recorded for the step in progress, and the appends.

    Every rank keeps the in-memory view (ranks other than 0 need to know which members are done); only the
    process given a writer (rank 0) touches the file.
    """

    def __init__(self, run_id: str, writer: JournalWriter | None,
                 recorded: dict[int, dict[int, torch.Tensor]] | None = None):
        self.run_id, self.writer = run_id, writer
        self._recorded = recorded or {}

    def recorded(self, step: int) -> dict[int, torch.Tensor]:
        return self._recorded.setdefault(step, {})

    def record_members(self, step: int, rewards: dict[int, torch.Tensor]) -> None:
        """Append the members of `step` not recorded yet, in member order."""
        known = self.recorded(step)
        for member in sorted(set(rewards) - set(known)):
            value = rewards[member].to(torch.float64)
            self._append({"kind": "member", "step": step, "member": member, "rewards": value.tolist()})
            known[member] = value

    def record_update(self, step: int, record: dict[str, Any]) -> None:
        self._append({"kind": "update", "step": step, "record": record})
        self._recorded.pop(step, None)

    def record_eval_before(self, record: dict[str, Any]) -> None:
        self._append({"kind": "eval", "step": 0, "record": record})

    def _append(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.append(record)
