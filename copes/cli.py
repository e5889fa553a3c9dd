"""Command line: copes-run (train), copes-eval (benchmark a model), copes-bench (time one step by phase),
copes-replay (rebuild a step's weights from a run's journal), copes-export (a checkpoint as GGUF), copes-fetch (a
pretrained model by name, into this machine's cache).

A user's mistake prints one sentence and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import yaml

from copes.config.options import FIELD_NAMES, ConfigError, TrainConfig, build_config, config_with_preset, read_yaml
from copes.downloads import DOWNLOADABLE_MODELS
from copes.errors import Interrupted, UserError

USER_ERROR_STATUS = 2
COMMAND_SETTINGS = {"help_option_names": ["-h", "--help"], "show_default": True}


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the errors a user can fix into `error: <sentence>` and exit status 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, debug: bool = False, **kwargs: Any) -> Any:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard load/save bars would drown the run's own progress

        try:
            return command(*args, **kwargs)
        except (UserError, FileNotFoundError) as error:
            if debug:
                raise
            click.echo(f"error: {error}", err=True)
            sys.exit(USER_ERROR_STATUS)

    return click.option("--debug", is_flag=True, help="show the full traceback on errors")(wrapper)


def _parse_mapping(option: str, items: tuple[str, ...]) -> dict[str, Any] | None:
    """`KEY=VALUE` items of a mapping option; values are read as YAML scalars (5 -> int, em -> str)."""
    if not items:
        return None
    mapping = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--{option} takes KEY=VALUE, got {item!r}")
        mapping[key] = yaml.safe_load(value)
    return mapping


def config_options(
    *names: str, defaults: dict[str, Any] | None = None, field_defaults: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Click options generated from TrainConfig's fields (all, or `names`): flag, type, choices and help come from
    the field. Unset options reach the command as None, so the preset and --config layers below them still count;
    the help shows the dataclass default. `defaults` (the command's own) and `field_defaults=True` (the fields'
    defaults, for a command without config layers) become real click defaults."""
    chosen = [f for f in dataclasses.fields(TrainConfig) if not names or f.name in names]
    if field_defaults:
        defaults = {f.name: f.default for f in chosen if f.default is not dataclasses.MISSING} | (defaults or {})
    defaults = defaults or {}

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for f in reversed(chosen):
            flag, annotation = "--" + f.name.replace("_", "-"), str(f.type)
            default = defaults.get(f.name)
            shown = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f.metadata["help"] + ("" if f.name in defaults or shown in (None, [], {})
                                              else f" [default: {shown}]")
            kwargs: dict[str, Any] = {"default": default, "help": help_text}
            if annotation in ("bool", "bool | None"):
                flag = f"{flag}/--no-{flag[2:]}"
            elif annotation.startswith("list"):
                kwargs.update(multiple=True, default=None, help=f"{help_text} (repeatable)")
            elif annotation.startswith("dict"):
                kwargs.update(multiple=True, default=None, metavar="KEY=VALUE", help=f"{help_text} (repeatable)",
                              callback=lambda ctx, param, items: _parse_mapping(param.name.replace("_", "-"), items))
            elif f.metadata["choices"]:
                kwargs["type"] = click.Choice(f.metadata["choices"])
            else:
                kwargs["type"] = {"int": int, "float": float}.get(annotation.split(" |")[0], str)
            command = click.option(flag, f.name, **kwargs)(command)
        return command

    return decorate


def _config(config_file: str | None, flags: dict[str, Any]) -> TrainConfig:
    """The run's config: the model's preset < --config file < flags (empty repeatables are unset); options the user
    set that its algorithm does not use are named on stderr."""
    flag_layer = {k: (None if v == () else v) for k, v in flags.items()}
    file_layer = read_yaml(config_file) if config_file else {}
    cfg = config_with_preset(file_layer, flag_layer)
    user_set = {k for layer in (file_layer, flag_layer) for k, v in layer.items() if v is not None}
    for name in cfg.ignored_options(user_set):
        click.echo(f"warning: --{name.replace('_', '-')} does not apply to --algorithm {cfg.algorithm}; ignored",
                   err=True)
    return cfg


def _run_as_workers(cfg: TrainConfig, resume: str | None, quiet: bool) -> int:
    """This copes-run again as `cfg.workers` local ranks, each reading the settings resolved here; returns the exit
    status (a failed rank's: its own stderr says why)."""
    import torch

    from copes.modeling import resolve_device
    from copes.run.distributed import launch_local_ranks

    if resolve_device(cfg.device).type == "cuda" and torch.cuda.device_count() < cfg.workers:
        raise ConfigError(f"--workers {cfg.workers} needs one GPU each; this machine has {torch.cuda.device_count()}")
    used = set(FIELD_NAMES) - set(cfg.ignored_options(FIELD_NAMES))  # unused ones would warn again in every rank
    settings = {name: value for name, value in cfg.to_dict().items() if name in used}
    with tempfile.TemporaryDirectory(prefix="copes-workers-") as folder:
        config_file = Path(folder) / "config.yaml"
        config_file.write_text(yaml.safe_dump(settings), encoding="utf-8")
        args = ["--config", str(config_file), *(["--resume", resume] if resume else []),
                *(["--quiet"] if quiet else [])]
        return launch_local_ranks(cfg.workers, ["-c", "from copes.cli import run_command; run_command()", *args])


@click.command(context_settings=COMMAND_SETTINGS)
@config_options()
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="YAML file of options (flags override it)")
@click.option("--resume", type=click.Path(),
              help="continue a run dir bit-exactly with its own settings (from its journal)")
@click.option("--quiet", is_flag=True, help="no progress bars")
@user_errors
def run_command(config_file: str | None, resume: str | None, quiet: bool, **flags: Any) -> None:
    """Post-train a causal LM with evolution strategies. With no arguments: the embedded tiny model on the
    synthetic arithmetic task with CoPES, on the CPU, in a few minutes."""
    if resume:
        from copes.run.journal import resume_config

        cfg = resume_config(resume, read_yaml(config_file) if config_file else {}, flags)
    else:
        cfg = _config(config_file, flags)
    if cfg.plan:  # config.json only: works on any machine, for any --device
        from copes.plan.grpo import grpo_plan
        from copes.plan.memory import plan_for

        plan = plan_for(cfg)
        click.echo(plan.table())
        click.echo(grpo_plan(cfg, plan).table())  # full-parameter GRPO for the same model and context
        return
    from copes.run.distributed import launched_by_copes_run, launched_distributed, leave_distributed
    from copes.run.record import claim_output_dir

    if not (launched_distributed() and launched_by_copes_run()):  # --workers ranks write where the parent claimed
        cfg = claim_output_dir(cfg, resuming=bool(resume), may_move=not launched_distributed())
    if cfg.workers > 1 and launched_distributed() and not launched_by_copes_run():
        raise ConfigError("--workers starts its own ranks; under torchrun leave it at 1")
    # One process speaks for the run: copes-run itself, or rank 0 of a torchrun.
    speaks = not (launched_distributed() and launched_by_copes_run()) and os.environ.get("RANK", "0") == "0"
    with _resumable(cfg.output_dir, speaks=speaks):
        if cfg.workers > 1 and not launched_distributed():
            sys.exit(_run_as_workers(cfg, resume, quiet))
        _train(cfg, resume, quiet)
        leave_distributed()


def _train(cfg: TrainConfig, resume: str | None, quiet: bool) -> None:
    from copes.run.trainer import Trainer

    trainer = Trainer(cfg, progress=not quiet)
    if resume:
        trainer.resume(resume)
    say = click.echo if trainer.is_main else (lambda *_: None)  # under torchrun, rank 0 speaks for all
    summary_file = Path(cfg.output_dir) / "summary.json"
    if resume and trainer.start_step >= cfg.steps and summary_file.is_file():  # nothing left, not even the final eval
        say(f"{resume} already finished its {trainer.start_step} steps (summary: {summary_file}); to train it "
            f"further, resume with --steps N, N > {trainer.start_step}")
        return
    budget = f" budget={cfg.budget_hours * 60:g}min" if cfg.budget_hours else ""  # the tiny models' presets set one
    say(f"{cfg.method} on {cfg.task_label}: N={cfg.population} K={cfg.num_subspaces} sigma={cfg.sigma} "
        f"lr={cfg.lr} model={cfg.model} device={trainer.device}{budget} -> {cfg.output_dir}")
    summary = trainer.train()
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    if before is None or after is None:
        say(f"{summary['steps']} steps in {summary['wall_seconds']:.0f}s (no held-out evaluation); "
            f"summary: {Path(cfg.output_dir) / 'summary.json'}")
        return
    say(f"held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points) "
               f"after {summary['steps']} steps in {summary['wall_seconds']:.0f}s; "
               f"summary: {Path(cfg.output_dir) / 'summary.json'}")


def _interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


# A disk full, a quota, a read-only or failing file system: the run stops, and resumes once the disk is fixed.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}


@contextlib.contextmanager
def _resumable(output_dir: str, *, speaks: bool) -> Iterator[None]:
    """SIGTERM and SIGINT, a rank of this run that died and a write the disk refused stop the run with one line
    saying how to resume it (the journal holds every member scored so far) and no traceback; status 128 + the
    signal, or 1. `speaks` is false in the ranks --workers started, whose parent says it once; an error only
    rank 0 met (a failed write, a failed collective) rank 0 says."""
    from copes.run.distributed import DistributedError, RankDied

    handlers = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    resume = f"continue this run with: copes-run --resume {Path(output_dir).resolve()}"
    first_rank = os.environ.get("RANK", "0") == "0"
    stopping = True
    try:
        yield
        stopping = False
    except (Interrupted, KeyboardInterrupt) as stop:
        if speaks:
            click.echo(f"\ninterrupted; {resume}", err=True)
        sys.exit(128 + getattr(stop, "signum", signal.SIGINT))
    except RankDied as failure:
        click.echo(f"error: {failure}; {resume}", err=True)
        sys.exit(1)
    except DistributedError as failure:  # under --workers, the parent then names the rank that died
        if first_rank:
            click.echo(f"error: {failure}" + (f"; {resume}" if speaks else ""), err=True)
        sys.exit(1)
    except OSError as failure:
        if failure.errno not in WRITE_ERRNOS:
            raise
        if first_rank:
            where = f" writing {failure.filename}" if failure.filename else f" writing into {output_dir}"
            click.echo(f"error: {failure.strerror}{where}; once it can be written, {resume}", err=True)
        sys.exit(1)
    finally:  # the caller's handlers again after a run (the command also runs inside other processes); while
        # stopping, a second signal (the launcher ending its ranks) ends the process without a word
        for signum, handler in handlers.items():
            signal.signal(signum, signal.SIG_DFL if stopping else handler)


@click.command(context_settings=COMMAND_SETTINGS)
@config_options("model", "tools", "unsafe_sandbox", "max_new_tokens", "device", "dtype", "cpu_threads",
                "rollout_engine", "vllm_kv_cache_gib", "vllm_cpu_weights", "data_dir", "task_options", "reward",
                field_defaults=True)
@click.option("--task", "tasks", multiple=True, default=["arithmetic"],
              help="task to evaluate (repeatable): a name, a dataset file, hf:OWNER/NAME or MODULE:FACTORY")
@click.option("--split", default="test", help="split to evaluate")
@click.option("--limit", type=int, help="first N questions only")
@click.option("--samples", type=int, default=1, help="samples per question (paper: 32 for GSM8K/MATH, 256 for AIME)")
@click.option("--temperature", type=float, default=0.3, help="sampling temperature when samples > 1")
@click.option("--k", "ks", type=int, multiple=True, default=[1], help="pass@k to report (repeatable)")
@click.option("--batch-size", type=int, default=64, help="rows per generate call")
@click.option("--output", type=click.Path(dir_okay=False), help="write the results as JSON here")
@click.option("--seed", type=int, default=0, help="sampling seed")
@user_errors
def eval_command(model: str, tasks: tuple[str, ...], split: str, limit: int | None, samples: int, temperature: float,
                 ks: tuple[int, ...], tools: bool, unsafe_sandbox: bool, max_new_tokens: int, batch_size: int,
                 device: str, dtype: str, cpu_threads: int, rollout_engine: str, vllm_kv_cache_gib: float,
                 vllm_cpu_weights: str, data_dir: str | None, task_options: dict[str, Any] | None,
                 reward: tuple[str, ...], output: str | None, seed: int) -> None:
    """Evaluate a model: greedy accuracy, or pass@k with the unbiased estimator over several samples."""
    from copes.config.components import build_tools
    from copes.rollout import AgentConfig
    from copes.rollout.engine import load_rollout_model
    from copes.run.evaluation import evaluate, format_table
    from copes.tasks.plugins import build_task
    from copes.timing import PhaseTimer

    if samples < 1 or any(k < 1 or k > samples for k in ks):
        raise ConfigError(f"every --k must be between 1 and --samples ({samples}), got {list(ks)}")
    engine = build_config({"rollout_engine": rollout_engine, "vllm_kv_cache_gib": vllm_kv_cache_gib,
                           "vllm_cpu_weights": vllm_cpu_weights, "cpu_threads": cpu_threads})  # copes-run's checks
    lm, tokenizer, _ = load_rollout_model(model, engine=engine.rollout_engine, device=device, dtype=dtype,
                                          cpu_threads=engine.cpu_threads, kv_cache_gib=engine.vllm_kv_cache_gib,
                                          vllm_cpu_weights=engine.vllm_cpu_weights)
    results = {}
    for name in tasks:
        task = build_task(name, task_options or {}, rewards=reward, data_dir=data_dir)
        examples = task.examples(split, limit=limit)
        limits = dict(max_new_tokens=max_new_tokens, batch_size=batch_size)
        agent = AgentConfig.for_task(task, **limits)
        task_tools = build_tools(task, enabled=tools, corpus=None, retriever_url=None, timer=PhaseTimer(),
                                 corpus_dir=Path(tempfile.mkdtemp(prefix="copes-corpus-")),
                                 unsafe_sandbox=unsafe_sandbox)
        results[name] = evaluate(lm, tokenizer, task, examples, n_samples=samples, temperature=temperature, ks=ks,
                                 tools=task_tools, agent_config=agent, seed=seed)
    click.echo(format_table(results))
    if output:
        Path(output).write_text(json.dumps({k: r.to_dict() for k, r in results.items()}, indent=1), encoding="utf-8")


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML file of options")
@config_options("model", "algorithm", "population", "subspaces", "steps", "device", "output_dir",
                defaults={"steps": 3, "output_dir": "runs/bench"})
@user_errors
def bench_command(config_file: str | None, steps: int, **flags: Any) -> None:
    """Time ES steps by phase and report the engine's overhead (perturb + restore + update) as a fraction."""
    from copes.run.trainer import Trainer

    # A timing run: each replaces the previous one in its folder.
    overrides = {**flags, "steps": steps, "eval_size": 0, "checkpoint_every": 0, "overwrite": True}
    trainer = Trainer(_config(config_file, overrides), progress=True)
    summary = trainer.train()
    phases = summary["phase_seconds"]
    from copes.es.strategies.base import STEP_PHASES

    step_phases = {phase: phases.get(phase, 0.0) for phase in STEP_PHASES}
    total = sum(step_phases.values()) or 1.0
    engine = sum(step_phases[k] for k in ("perturb", "restore", "update"))
    click.echo(f"{'phase':<10} {'seconds':>9} {'share':>7}")
    for phase, seconds in sorted(step_phases.items(), key=lambda item: -item[1]):
        click.echo(f"{phase:<10} {seconds:9.3f} {100 * seconds / total:6.1f}%")
    click.echo(f"(rollout = generate {phases.get('generate', 0.0):.3f}s + tools {phases.get('tools', 0.0):.3f}s "
               "+ scoring)")
    click.echo(f"engine overhead (perturb + restore + update): {100 * engine / total:.1f}% of step time")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--step", type=int, help="the step whose weights to rebuild (default: the journal's last)")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="save_pretrained folder to write")
@click.option("--device", help="auto | cpu | cuda | cuda:N (default: the run's own; replay on the backend it ran on)")
@click.option("--quiet", is_flag=True, help="no progress bar")
@user_errors
def replay_command(run_dir: str, step: int | None, output: str, device: str | None, quiet: bool) -> None:
    """Rebuild the weights of a run's step from its base model and journal alone (no generation) and write them
    as a folder AutoModelForCausalLM.from_pretrained loads."""
    from copes.run.replay import replay_run

    steps, seconds = replay_run(run_dir, output, step=step, device=device, progress=not quiet)
    click.echo(f"replayed {steps} steps in {seconds:.2f}s ({steps / max(seconds, 1e-9):.1f} steps/s) -> {output}")


@click.command(context_settings=COMMAND_SETTINGS)
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--output", required=True, type=click.Path(dir_okay=False), help="GGUF file to write")
@click.option("--type", "tensor_type", type=click.Choice(["f32", "f16", "bf16"]), default="f32",
              help="tensor type of the matrices (norms stay f32)")
@user_errors
def export_command(checkpoint: str, output: str, tensor_type: str) -> None:
    """Write a checkpoint (a run's folder, its checkpoints/ folder, one checkpoint, or any model folder) as a GGUF
    file that llama.cpp-based tools and transformers read."""
    from copes.gguf_io import export_gguf
    from copes.run.checkpoint import find_checkpoint

    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        folder = find_checkpoint(folder)
    written = export_gguf(folder, Path(output), tensor_type)
    click.echo(f"wrote {written.tensors} tensors ({tensor_type}) of {folder} -> {output}")
    if written.pre_tokenizer is None:
        click.echo("warning: llama.cpp has no pre-tokenizer that splits text as this model's tokenizer does, so its "
                   "tokens can differ from the model's (transformers reads the file as the model does)", err=True)


@click.command(context_settings=COMMAND_SETTINGS)
@click.argument("name", type=click.Choice(sorted(DOWNLOADABLE_MODELS)))
@user_errors
def fetch_command(name: str) -> None:
    """Fetch a pretrained model by name into this machine's cache (once), convert it to a dense folder there (once),
    and print the file's path; `--model NAME` then uses the cached copies."""
    from copes.downloads import fetch_model
    from copes.gguf_io import dense_folder

    path = fetch_model(name)
    dense_folder(path)
    click.echo(path)
