"""Command line: copes-run (train), copes-eval (benchmark a model), copes-bench (time one step by phase),
copes-replay (rebuild a step's weights from a run's journal).

A user's mistake prints one sentence and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from copes.config import ALGORITHMS, ConfigError, build_config, read_yaml

USER_ERROR_STATUS = 2


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the errors a user can fix into `error: <sentence>` and exit status 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, debug: bool = False, **kwargs: Any) -> Any:
        from transformers.utils import logging as hf_logging

        from copes.tasks.loading import DatasetError

        hf_logging.disable_progress_bar()  # per-shard load/save bars would drown the run's own progress

        try:
            return command(*args, **kwargs)
        except (ConfigError, DatasetError, FileNotFoundError) as error:
            if debug:
                raise
            click.echo(f"error: {error}", err=True)
            sys.exit(USER_ERROR_STATUS)

    return click.option("--debug", is_flag=True, help="show the full traceback on errors")(wrapper)


def _layers(config_file: str | None, flags: dict[str, Any]) -> list[dict[str, Any]]:
    """Config layers in precedence order: model preset < --config file < flags."""
    from copes.modeling import read_preset

    file_layer = read_yaml(config_file) if config_file else {}
    model = flags.get("model") or file_layer.get("model") or "tiny"
    preset = read_preset(model)
    return [read_yaml(preset) if preset else {}, file_layer, flags]


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", help="model folder or hub id (default: the embedded tiny model)")
@click.option("--task", help="gsm8k | math | math500 | aime24 | aime25 | hotpotqa | 2wiki | musique | arithmetic")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), help="copes (default) | es | eggroll | copes-lowrank")
@click.option("--population", type=int, help="N perturbed members per step (paper: 40)")
@click.option("--subspaces", type=int, help="K random parameter subspaces (paper: 4)")
@click.option("--sigma", type=float, help="noise scale (paper: 1e-3)")
@click.option("--lr", type=float, help="learning rate (paper: 5e-4)")
@click.option("--rank", type=int, help="EGGROLL perturbation rank")
@click.option("--steps", type=int, help="ES steps")
@click.option("--prompt-batch", type=int, help="questions per step (paper: 64)")
@click.option("--max-new-tokens", type=int, help="tokens generated per turn")
@click.option("--tools/--no-tools", default=None, help="let the agent use the Python sandbox and search")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), help="weights dtype")
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--restore", type=click.Choice(["device", "host", "subtract"]), help="how perturbations are undone")
@click.option("--seed", type=int, help="seed of data order, noise and partitions")
@click.option("--output-dir", help="where metrics, plots, summary and checkpoints go")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML file of options (flags override it)")
@click.option("--resume", type=click.Path(), help="continue a run dir bit-exactly with its own settings (from its journal)")
@click.option("--chunk-size", type=int, help="elements per partition chunk")
@click.option("--fitness", help="joint | per_subspace | centered_rank | per_question")
@click.option("--eval-size", type=int, help="held-out questions evaluated before and after")
@click.option("--eval-every", type=int, help="steps between held-out evaluations (0: before/after only)")
@click.option("--checkpoint-every", type=int, help="steps between checkpoints")
@click.option("--budget-hours", type=float, help="stop cleanly after this much wall time")
@click.option("--data-dir", help="local dataset folder")
@click.option("--rollout-batch", type=int, help="rows per generate call (default: the whole prompt batch)")
@click.option("--oom-retry/--no-oom-retry", default=None, help="retry a member with half the rollout batch on OOM")
@click.option("--cpu-threads", type=int, help="torch threads on CPU (0: torch's default)")
@click.option("--quiet", is_flag=True, help="no progress bars")
@user_errors
def run_command(config_file: str | None, resume: str | None, quiet: bool, **flags: Any) -> None:
    """Post-train a causal LM with evolution strategies. With no arguments: the embedded tiny model on the
    synthetic arithmetic task with CoPES, on the CPU, in a few minutes."""
    from copes.trainer import Trainer

    if resume:
        from copes.journal import resume_config

        cfg = resume_config(resume, read_yaml(config_file) if config_file else {}, flags)
    else:
        cfg = build_config(*_layers(config_file, flags))
    trainer = Trainer(cfg, progress=not quiet)
    if resume:
        trainer.resume(resume)
    say = click.echo if trainer.is_main else (lambda *_: None)  # under torchrun, rank 0 speaks for all
    say(f"{cfg.algorithm} on {cfg.task}: N={cfg.population} K={cfg.num_subspaces} sigma={cfg.sigma} "
               f"lr={cfg.lr} model={cfg.model} device={trainer.device} -> {cfg.output_dir}")
    summary = trainer.train()
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    if before is None or after is None:
        say(f"{summary['steps']} steps in {summary['wall_seconds']:.0f}s (no held-out evaluation); summary: {Path(cfg.output_dir) / 'summary.json'}")
        return
    say(f"held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points) "
               f"after {summary['steps']} steps in {summary['wall_seconds']:.0f}s; "
               f"summary: {Path(cfg.output_dir) / 'summary.json'}")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default="tiny", help="model folder or hub id")
@click.option("--task", "tasks", multiple=True, default=["arithmetic"], help="task to evaluate (repeatable)")
@click.option("--split", default="test", help="split to evaluate")
@click.option("--limit", type=int, help="first N questions only")
@click.option("--samples", type=int, default=1, help="samples per question (paper: 32 for GSM8K/MATH, 256 for AIME)")
@click.option("--temperature", type=float, default=0.3, help="sampling temperature when samples > 1")
@click.option("--k", "ks", type=int, multiple=True, default=[1], help="pass@k to report (repeatable)")
@click.option("--tools/--no-tools", default=True, help="let the agent use tools")
@click.option("--max-new-tokens", type=int, default=1024, help="tokens generated per turn")
@click.option("--batch-size", type=int, default=64, help="rows per generate call")
@click.option("--device", default="auto", help="auto | cpu | cuda | cuda:N")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--data-dir", help="local dataset folder")
@click.option("--output", type=click.Path(dir_okay=False), help="write the results as JSON here")
@click.option("--seed", type=int, default=0, help="sampling seed")
@user_errors
def eval_command(model: str, tasks: tuple[str, ...], split: str, limit: int | None, samples: int, temperature: float,
                 ks: tuple[int, ...], tools: bool, max_new_tokens: int, batch_size: int, device: str, dtype: str,
                 data_dir: str | None, output: str | None, seed: int) -> None:
    """Evaluate a model: greedy accuracy, or pass@k with the unbiased estimator over several samples."""
    from copes.components import build_tools
    from copes.evaluation import evaluate, format_table
    from copes.metrics import PhaseTimer
    from copes.modeling import load_model
    from copes.rollout import AgentConfig
    from copes.tasks import get_task

    if samples < 1 or any(k < 1 or k > samples for k in ks):
        raise ConfigError(f"every --k must be between 1 and --samples ({samples}), got {list(ks)}")
    lm, tokenizer, _ = load_model(model, device=device, dtype=dtype)
    results = {}
    for name in tasks:
        task = get_task(name, **({"data_dir": data_dir} if data_dir else {}))
        examples = task.examples(split, limit=limit)
        limits = dict(max_new_tokens=max_new_tokens, batch_size=batch_size)
        agent = AgentConfig.for_kind(task.kind, **limits) if task.kind in ("math", "qa") else AgentConfig(**limits)
        task_tools = build_tools(task, enabled=tools, corpus=None, retriever_url=None, timer=PhaseTimer(), corpus_dir=Path(tempfile.mkdtemp(prefix="copes-corpus-")))
        results[name] = evaluate(lm, tokenizer, task, examples, n_samples=samples, temperature=temperature, ks=ks,
                                 tools=task_tools, agent_config=agent, seed=seed)
    click.echo(format_table(results))
    if output:
        Path(output).write_text(json.dumps({k: r.to_dict() for k, r in results.items()}, indent=1), encoding="utf-8")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML file of options")
@click.option("--model", help="model folder or hub id (default: the embedded tiny model)")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), help="strategy to time")
@click.option("--population", type=int, help="N members")
@click.option("--subspaces", type=int, help="K subspaces")
@click.option("--steps", type=int, default=3, help="steps to time")
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--output-dir", default="runs/bench", help="scratch run directory")
@user_errors
def bench_command(config_file: str | None, steps: int, **flags: Any) -> None:
    """Time ES steps by phase and report the engine's overhead (perturb + restore + update) as a fraction."""
    from copes.trainer import Trainer

    overrides = {**flags, "steps": steps, "eval_size": 0, "checkpoint_every": 0}
    trainer = Trainer(build_config(*_layers(config_file, overrides)), progress=True)
    summary = trainer.train()
    phases = summary["phase_seconds"]
    step_phases = {k: v for k, v in phases.items() if k not in ("evaluate", "checkpoint")}
    total = sum(step_phases.values()) or 1.0
    engine = sum(step_phases.get(k, 0.0) for k in ("perturb", "restore", "update"))
    click.echo(f"{'phase':<10} {'seconds':>9} {'share':>7}")
    for phase, seconds in sorted(step_phases.items(), key=lambda item: -item[1]):
        click.echo(f"{phase:<10} {seconds:9.3f} {100 * seconds / total:6.1f}%")
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
    from copes.replay import replay_run

    steps, seconds = replay_run(run_dir, output, step=step, device=device, progress=not quiet)
    click.echo(f"replayed {steps} steps in {seconds:.2f}s ({steps / max(seconds, 1e-9):.1f} steps/s) -> {output}")
