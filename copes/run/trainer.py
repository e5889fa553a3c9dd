"""The step loop: prompt batch -> evaluate every member (perturb / roll out / restore, or one batched EGGROLL
forward) -> fitness -> one update; held-out evaluation, checkpoints, metrics. The details live in the modules it
calls; this file should read on one screen.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from copes.run import checkpoint as ckpt
from copes.run.components import build_strategy, build_tools, task_from_config
from copes.run.config import ConfigError, TrainConfig, build_config
from copes.run.distributed import (barrier, broadcast_value, check_in_sync, gather_member_rewards, init_distributed,
                               members_for_rank)
from copes.run.evaluation import evaluate
from copes.failpoints import failpoint
from copes.run.journal import JournalWriter, RunJournal, build_header, journal_path
from copes.run.budget import Budget, BudgetSpent
from copes.run.plan import check_plan
from copes.run.metrics import MetricsLog, PhaseTimer, log_table, peak_memory_bytes, plot_curves, start_wandb
from copes.modeling import resolve_model_path
from copes.run.replay import replay_member, replays_members, resume_run
from copes.rollout import AgentConfig
from copes.rollout.engine import load_rollout_model
from copes.run.samples import SAMPLES_FILE, RolloutSamples
from copes.run.scoring import rollouts
from copes.es.strategies.base import WHOLE_POPULATION
from copes.tasks import Example


def batch_indices(step: int, batch: int, dataset_size: int, seed: int) -> list[int]:
    """Questions of `step`: a fresh permutation per epoch, a pure function of (seed, step) so resume needs no state."""
    positions = range(step * batch, (step + 1) * batch)
    permutations: dict[int, np.ndarray] = {}
    picked = []
    for position in positions:
        epoch = position // dataset_size
        if epoch not in permutations:
            permutations[epoch] = np.random.default_rng([seed, epoch]).permutation(dataset_size)
        picked.append(int(permutations[epoch][position % dataset_size]))
    return picked


@dataclass
class Trainer:
    cfg: TrainConfig
    progress: bool = True
    timer: PhaseTimer = field(default_factory=PhaseTimer)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.dist = init_distributed(cfg.device, timeout_s=cfg.dist_timeout_s)
        self.is_main = self.dist is None or self.dist.is_main  # only rank 0 writes logs and checkpoints
        self.out = Path(cfg.output_dir)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            probe = self.out / f".write_test.{os.getpid()}"  # per process: torchrun ranks probe at once
            probe.write_text("ok")
            probe.unlink()
        except OSError as error:
            raise ConfigError(f"output dir {self.out} is not writable: {error.strerror or error}") from None
        self.task = task_from_config(cfg)
        self.train_set = self.task.examples("train")
        if not self.train_set:
            raise ConfigError(f"task {cfg.task} has no training examples")
        self.eval_set = self._eval_examples()
        if self.dist and cfg.rollout_engine == "vllm":  # vLLM's in-process engine would join torchrun's world group
            raise ConfigError("--rollout-engine vllm runs in one process; under torchrun use --rollout-engine hf")
        device = str(self.dist.device) if self.dist else cfg.device
        self.plan = check_plan(cfg, device=device, uses_tools=cfg.tools and self.task.chat,
                               say=lambda line: self.is_main and tqdm.write(line, file=sys.stderr))
        self.model, self.tokenizer, self.device = load_rollout_model(
            cfg.model, engine=cfg.rollout_engine, device=device, dtype=cfg.dtype, cpu_threads=cfg.cpu_threads,
            kv_cache_gib=cfg.vllm_kv_cache_gib, max_context_tokens=cfg.max_context_tokens,
            vllm_cpu_weights=cfg.vllm_cpu_weights)
        self.tools = build_tools(self.task, enabled=cfg.tools, corpus=cfg.search_corpus, retriever_url=cfg.retriever_url, timer=self.timer, corpus_dir=self.out,
                                 unsafe_sandbox=cfg.unsafe_sandbox)
        limits = dict(max_new_tokens=cfg.max_new_tokens, max_turns=cfg.max_turns, max_context_tokens=cfg.max_context_tokens,
                      greedy=True, batch_size=cfg.rollout_batch or self.plan.batch_size, tool_format=cfg.tool_format,
                      template_kwargs=cfg.template_kwargs, max_observation_tokens=cfg.max_observation_tokens)
        self.agent = AgentConfig.for_task(self.task, **limits, **({"budgets": cfg.tool_budgets} if cfg.tool_budgets else {}))
        self.strategy = build_strategy(cfg, self.model)
        self.start_step, self.evals, self.eval_before = 0, [], None
        self.samples: RolloutSamples | None = None  # opened by train(); a caller driving steps itself samples none
        self.wandb_run: Any = None
        self.journal: RunJournal | None = None  # opened by resume(), or started fresh by train()
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk
        self.budget = Budget(cfg.budget_hours)  # restarted by train()

    def _eval_examples(self) -> list[Example]:
        if self.cfg.eval_size == 0:
            return []
        for split in dict.fromkeys((self.cfg.eval_split, "validation", "test")):
            try:
                examples = self.task.examples(split, limit=self.cfg.eval_size)
            except ValueError:
                continue
            if examples:
                if len(examples) < self.cfg.eval_size and self.is_main:
                    tqdm.write(f"warning: eval_size={self.cfg.eval_size} but the {split} split of {self.cfg.task} has "
                               f"{len(examples)} questions; evaluating on all {len(examples)}", file=sys.stderr)
                return examples
        raise ConfigError(f"task {self.cfg.task} has no held-out split to evaluate on")

    # ---- the pieces the loop calls -------------------------------------------------------------------------
    def rewards_for(self, model: Any, examples: list[Example], row_members: Any = None,
                    members: list[int] | None = None) -> list[float] | list[list[float]]:
        """Per-question rewards [Q], or [len(members)][Q] for a batched population (`members` and `row_members`)."""
        if row_members is not None and members is None:
            members = list(range(self.cfg.population))
        per_member = rollouts(model, self.tokenizer, self.task, examples, tools=self.tools, agent=self.agent,
                              timer=self.timer, members=members, row_members=row_members)
        rewards = [[score.reward for _, score in rows] for rows in per_member]
        return rewards[0] if members is None else rewards

    def population_step(self, step: int, examples: list[Example]) -> Any:
        """One ES step. This rank evaluates its share of the members (all of them without torchrun), the rewards
        are gathered, and every rank applies the same update."""
        world = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
        mine = members_for_rank(self.cfg.population, *world)
        sampling = self.samples is not None and self.samples.due(step + 1)
        if self.journal is None:  # a caller driving steps itself (bench/step_overhead.py) journals them too
            self.start_journal()
        known = self.journal.recorded(step + 1)  # members scored before a crash are not rolled out again
        if self.strategy.evaluation == WHOLE_POPULATION:  # EGGROLL family: one batched call for all of this rank's members
            if any(member not in known for member in mine):  # the same call as uninterrupted, for the same numerics
                def population_fitness(model: Any, rows: Any) -> list[list[float]]:
                    if sampling:
                        self.sample_rollouts(model, mine, rows)
                    return self.rewards_for(model, examples, rows, mine)

                rewards = self.strategy.evaluate(population_fitness, members=mine)
                self.journal.record_members(step + 1, dict(zip(mine, rewards)))
        else:
            self.strategy.plan()
            members = tqdm(mine, desc=f"step {step + 1} members", leave=False, disable=not (self.progress and self.is_main))
            for member in members:
                if member not in known:
                    if self.dist is None:  # ranks hold different members: under torchrun, steps are the checkpoints
                        self.budget.check()
                    rewards = self.evaluate_member(member, examples, sampling=sampling)
                    self.journal.record_members(step + 1, {member: rewards})
                elif replays_members(self.cfg):
                    replay_member(self.strategy, member, known[member])
        local = {member: known[member] for member in mine}
        gathered = gather_member_rewards(local, self.cfg.population, step) if self.dist else [local[m] for m in mine]
        self.journal.record_members(step + 1, dict(enumerate(gathered)))  # rank 0: the other ranks' members
        if sampling and (written := self.samples.write(step + 1, gathered)) and self.wandb_run is not None:
            log_table(self.wandb_run, "samples", written, step + 1)
        return self.strategy.apply_update(torch.stack(gathered))

    def evaluate_member(self, member: int, examples: list[Example], *, sampling: bool = False) -> torch.Tensor:
        """Rewards of one perturbed member; out of memory is retried with half the rollout batch when allowed.
        At a sampling step the member also answers the sample questions (copes.run.samples)."""
        def fitness(model: Any) -> list[float]:
            failpoint("rollout")  # crash tests: die as the rollout starts; counted to find recomputed members
            if sampling:
                self.sample_rollouts(model, [member])
            rewards = self.rewards_for(model, examples)
            failpoint("member")  # crash tests: die while this member's perturbation is in the weights
            return rewards

        while True:
            try:
                return self.strategy.evaluate_member(member, fitness)
            except (torch.OutOfMemoryError, MemoryError):
                rows = self.agent.batch_size or len(examples)
                if not self.cfg.oom_retry or rows == 1:
                    raise ConfigError(f"out of memory evaluating member {member} with {rows} rows per generate call; "
                                      "lower --prompt-batch or --rollout-batch, or pass --oom-retry") from None
                self.agent.batch_size = rows // 2
                tqdm.write(f"out of memory on member {member} at {rows} rows per generate call; retrying with {rows // 2}")

    def sample_rollouts(self, model: Any, members: list[int], row_members: Any = None) -> None:
        """The sample questions' transcripts for `members` (under their perturbation, or routed rows)."""
        per_member = rollouts(model, self.tokenizer, self.task, self.samples.examples, tools=self.tools, agent=self.agent,
                              timer=self.timer, members=members, row_members=row_members)
        self.samples.add(members, per_member)

    def held_out(self, step: int) -> dict[str, Any]:
        if not self.eval_set or self.budget.spent():
            return {"step": step, "accuracy": None, "reward": None}
        with self.timer("held_out"):
            result = evaluate(self.model, self.tokenizer, self.task, self.eval_set, tools=self.tools,
                              agent_config=self.agent, progress=False, deadline=self.budget.deadline)
        record = {"step": step, "accuracy": result.accuracy, "reward": result.mean_reward, "questions": result.n_examples}
        self.evals.append(record)
        return record

    def save(self, step: int) -> None:
        with self.timer("checkpoint"):
            if self.is_main:
                state = {"step": step, "config": self.cfg.to_dict(), "eval_before": self.eval_before, "evals": self.evals,
                         "run_id": self.journal.run_id}
                ckpt.save_checkpoint(self.out / "checkpoints", step, model=self.model, tokenizer=self.tokenizer,
                                     es_state=self.strategy.state_dict(), trainer_state=state)
            if self.dist:
                barrier(step)  # nobody races ahead of a checkpoint it might have to resume from
        self.saved_step = step

    def over_budget(self, step: int) -> bool:
        over = self.budget.spent()
        return broadcast_value(over, step) if self.dist else over  # rank 0's clock decides for everyone

    def resume(self, path: str) -> None:
        """Continue the run journaled in `path`: its newest checkpoint (or the base model) plus a replay of every
        journaled update after it; members already scored in the step in progress are not rolled out again."""
        resumed = resume_run(path, self.cfg, self.model, self.strategy, writer=self.is_main,
                             progress=self.progress and self.is_main)
        self.journal, self.start_step = resumed.journal, resumed.contents.steps_done
        self.eval_before, self.saved_step = resumed.contents.eval_before, resumed.checkpoint_step
        self.evals = resumed.contents.evals(self.start_step)
        if self.is_main:  # the journal holds every finished step's metrics record, whatever metrics.jsonl kept
            records = resumed.contents.updates
            ckpt.write_text_atomic(self.out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))

    def start_journal(self) -> None:
        """A fresh journal for a new run (rank 0 writes it; the other ranks only keep the in-memory view)."""
        run_id = uuid.uuid4().hex
        if self.dist:
            run_id = broadcast_value(run_id, step=0)
        writer = None
        if self.is_main:
            header = build_header(self.cfg, self.model, self.strategy, resolve_model_path(self.cfg.model), run_id=run_id)
            writer = JournalWriter.create(journal_path(self.out), header)
        self.journal = RunJournal(run_id, writer)

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, started = self.cfg, time.perf_counter()
        self.budget = Budget(cfg.budget_hours)
        # The high-water mark of loading (Python, torch, the model); on CPU it is ~0.5 GiB before any training.
        self.peaks_at_start = peak_memory_bytes(self.device)
        if cfg.wandb and self.is_main:
            self.wandb_run = start_wandb(cfg.wandb_project, self.out, cfg.to_dict())
        metrics = MetricsLog(self.out / "metrics.jsonl" if self.is_main else None, keep_through_step=self.start_step,
                             tensorboard=cfg.tensorboard, wandb_run=self.wandb_run)
        if self.journal is None:
            self.start_journal()
        sample_questions = (self.eval_set or self.train_set)[: cfg.sample_prompts]
        self.samples = RolloutSamples(self.out / SAMPLES_FILE if self.is_main else None, sample_questions,
                                      cfg.sample_every, keep_through_step=self.start_step)
        if self.eval_before is None:
            self.eval_before = self.held_out(step=0)
            self.journal.record_eval_before(self.eval_before)
        stopped_by, step = "steps", self.start_step
        bar = tqdm(range(self.start_step, cfg.steps), desc=f"{cfg.algorithm} on {cfg.task}", initial=self.start_step,
                   total=cfg.steps, disable=not (self.progress and self.is_main))
        for step in bar:
            examples = [self.train_set[i] for i in batch_indices(step, cfg.prompt_batch, len(self.train_set), cfg.seed)]
            phase_before = dict(self.timer.seconds)
            try:
                stats = self.population_step(step, examples)
            except BudgetSpent:  # between members: the journal holds those scored, --resume continues the step
                stopped_by, step = "budget", step - 1  # `step` steps are complete
                break
            for phase, seconds in stats.phase_seconds().items():  # rollout includes generate and tools
                self.timer.add(phase, seconds)
            record = {"step": step + 1, **{k: v for k, v in asdict(stats).items() if not k.endswith("_seconds") and k != "step"},
                      "time": {k: round(v - phase_before.get(k, 0.0), 4) for k, v in self.timer.seconds.items()}}
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                record["eval"] = self.held_out(step + 1)
            self.journal.record_update(step + 1, record)
            metrics.append(record)
            bar.set_postfix(reward=f"{stats.mean_reward:.3f}", best=f"{stats.max_reward:.3f}")
            if self.dist and (step + 1) % cfg.dist_check_every == 0:
                check_in_sync(self.model, step + 1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                self.save(step + 1)
            if self.over_budget(step + 1):
                stopped_by = "budget"
                break
        completed = step + 1 if cfg.steps > self.start_step else self.start_step
        eval_after = self.held_out(step=completed)
        if self.saved_step != completed:
            self.save(completed)
        return self.finish(metrics, eval_after, completed, stopped_by, time.perf_counter() - started)

    def finish(self, metrics: MetricsLog, eval_after: dict, steps: int, stopped_by: str, wall: float) -> dict[str, Any]:
        peaks = peak_memory_bytes(self.device)
        peak, peak_at_start = (peaks_of.get("device", peaks_of["host"]) for peaks_of in (peaks, self.peaks_at_start))
        summary = {
            "eval_before": self.eval_before, "eval_after": eval_after, "steps": steps, "stopped_by": stopped_by,
            "wall_seconds": round(wall, 2), "peak_memory_bytes": peak, "peak_host_memory_bytes": peaks["host"],
            "training_peak_memory_growth_bytes": peak - peak_at_start, "phase_seconds": self.timer.snapshot(),
            "gpu_hours": round(wall / 3600 * (self.device.type == "cuda"), 4), "config": self.cfg.to_dict(),
        }
        if not self.is_main:
            return summary
        ckpt.write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=1))
        plot_curves(metrics.records, self.evals, self.out / "curve.png",
                    f"{self.cfg.method} on {self.cfg.task} ({Path(self.cfg.model).name})")
        if self.wandb_run is not None:
            self.wandb_run.summary.update({"eval_before_accuracy": self.eval_before["accuracy"],
                                           "eval_after_accuracy": eval_after["accuracy"], "steps": steps})
            self.wandb_run.finish()
        return summary


def train(config: TrainConfig | dict[str, Any], *, resume: str | None = None, progress: bool = False) -> dict[str, Any]:
    """A whole run from Python, as `copes-run` does it: `config` is a TrainConfig or a mapping of its fields
    (validated onto the defaults; the model's preset is not read); `resume` a run dir or checkpoint. Returns the
    summary (also written to summary.json)."""
    cfg = config if isinstance(config, TrainConfig) else build_config(config)
    trainer = Trainer(cfg.validate(), progress=progress)
    if resume:
        trainer.resume(resume)
    return trainer.train()
