"""The step loop: prompt batch -> score every member (perturb / roll out / restore, or one batched EGGROLL
forward) -> fitness -> one update; held-out evaluations, checkpoints, metrics. What to build comes from
`copes.config.components`, what the run leaves behind is `copes.run.record.RunRecord`; the loop (`Trainer.train`)
fits on one screen.
"""

from __future__ import annotations

import functools
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from copes.config.components import (
    GivenParts,
    batch_indices,
    build_agent,
    build_strategy,
    build_tools,
    eval_examples,
    rollout_lora,
    split_given,
    task_from_config,
    tools_on,
    warn_at_start,
)
from copes.config.options import TrainConfig, build_config, config_with_preset
from copes.errors import ConfigError, UserError
from copes.es.strategies.base import WHOLE_POPULATION, StepStats
from copes.extras import engine_fallback_hint
from copes.failpoints import failpoint
from copes.modeling import release_free_heap, resolve_model_path
from copes.plan.memory import check_plan
from copes.rewards.functions import RewardSet, RewardStepStats
from copes.rollout.engine import engine_for, load_rollout_model
from copes.run.budget import Budget, BudgetSpent
from copes.run.distributed import (
    barrier,
    broadcast_value,
    check_in_sync,
    gather_member_rewards,
    gather_values,
    init_distributed,
    members_for_rank,
)
from copes.run.evaluation import evaluate, merge_results
from copes.run.metrics import import_wandb, peak_memory_bytes, progress_bar, zero_update_warning
from copes.run.record import RunRecord, claim_output_dir
from copes.run.replay import replay_member, replays_members
from copes.run.scoring import MemberScoring, roll_out, rollouts
from copes.tasks import Example
from copes.tasks.loading import recording_data_files
from copes.timing import PhaseTimer


def reward_set_of(task: Any) -> RewardSet | None:
    """The reward functions scoring `task` (`--reward`, a file task), or None for a task's own scoring."""
    rewards = getattr(task, "rewards", None)
    return rewards if isinstance(rewards, RewardSet) else None


@dataclass
class Trainer:
    cfg: TrainConfig
    progress: bool = True
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    given: GivenParts = field(default_factory=GivenParts)  # a Task object or reward callables from copes.train

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.dist = init_distributed(cfg.device, timeout_s=cfg.dist_timeout_s)
        self.is_main = self.dist is None or self.dist.is_main  # only rank 0 writes logs and checkpoints
        # Under torchrun / --workers each rank builds its own engine on its own device (vLLM's external-launcher mode:
        # copes.rollout.vllm.engine), all ranks at once, as vLLM's engine start is collective over the world.
        device = str(self.dist.device) if self.dist else cfg.device
        if self.is_main and (hint := engine_fallback_hint(cfg.rollout_engine, device)):
            print(hint, file=sys.stderr)
        self.cfg = cfg = cfg.with_engine_for(device)  # the journal records the engine the run used
        if cfg.wandb and self.is_main:
            import_wandb()  # a missing package is said before anything loads
        self.record = RunRecord(cfg, writer=self.is_main)
        self.task = task_from_config(cfg, self.given)
        with recording_data_files() as data_files:  # copes' own task's local files, hashed into the journal
            self.train_set = self.task.examples("train")
            if not self.train_set:
                raise ConfigError(f"task {cfg.task} has no training examples")
            self.eval_set = eval_examples(self.task, cfg, warn=self.is_main)
        self.data_files = list(data_files)
        # Refuses what cannot fit before anything loads; its one-line summary is said when training starts, so a
        # mistake found before then (a journal, a resume, an output option) is still the only line on stderr.
        self.plan = check_plan(cfg, device=device, uses_tools=tools_on(cfg.tools, self.task), say=lambda line: None)
        self.model, self.tokenizer, self.device = load_rollout_model(
            cfg.model, engine=cfg.rollout_engine, device=device, dtype=cfg.dtype, cpu_threads=cfg.cpu_threads,
            kv_cache_gib=self.plan.vllm_kv_cache_gib, max_context_tokens=cfg.max_context_tokens,
            vllm_cpu_weights=cfg.vllm_cpu_weights,
            lora=rollout_lora(cfg, self.dist.world_size if self.dist else 1))
        if self.is_main:
            warn_at_start(self.task, self.train_set, self.tokenizer, self.model)
        self.tools = build_tools(self.task, enabled=cfg.tools, corpus=cfg.search_corpus,
                                 retriever_url=cfg.retriever_url, timer=self.timer, corpus_dir=self.record.out,
                                 unsafe_sandbox=cfg.unsafe_sandbox)
        self.agent = build_agent(cfg, self.task, rows=cfg.rollout_batch or self.plan.batch_size,
                                 context_limit=getattr(engine_for(self.model), "max_model_len", None))
        self.strategy = build_strategy(cfg, self.model)
        self.start_step, self.budget = 0, Budget(cfg.budget_hours)  # the budget restarts with train()
        self.invalid_streaks: dict[str, int] = {}  # reward label -> steps in a row invalid for every row
        self.last_reward_errors: dict[str, str | None] = {}

    # ---- one step ------------------------------------------------------------------------------------------
    def population_step(self, step: int, examples: list[Example]) -> StepStats:
        """One ES step (steps count from 0 here, from 1 in the journal). This rank scores its share of the members
        (all of them in one process), the rewards are gathered, and every rank applies the same update."""
        if self.record.journal is None:  # a caller driving steps itself (bench/step_overhead.py) journals them too
            self.record.start_journal(self.model, self.strategy, resolve_model_path(self.cfg.model), self.share,
                                      data_files=self.data_files)
        if (rewards := reward_set_of(self.task)) is not None:
            rewards.new_step()  # this step's per-reward statistics; abandoned (hung) rewards are called again
        mine = members_for_rank(self.cfg.population, *((self.dist.rank, self.dist.world_size) if self.dist else (0, 1)))
        sampling = self.record.samples is not None and self.record.samples.due(step + 1)
        rewards = self.score_members(step + 1, mine, examples, sampling)
        gathered = (gather_member_rewards(rewards, self.cfg.population, step) if self.dist
                    else [rewards[m] for m in mine])
        self.record.journal.record_members(step + 1, dict(enumerate(gathered)))  # rank 0: the other ranks' members
        if sampling:
            self.sample_members_scored_before_a_resume(gathered)
            if self.dist:  # every rank's best and worst reach rank 0, which writes the step's overall ones
                for transcripts in gather_values(self.record.samples.extremes(gathered), step):
                    self.record.samples.add_transcripts(transcripts)
            self.record.write_samples(step + 1, gathered)
        return self.strategy.apply_update(torch.stack(gathered))

    def score_members(self, step: int, mine: list[int], examples: list[Example],
                      sampling: bool) -> dict[int, torch.Tensor]:
        """{member: float64 rewards} of this rank's members, each journaled as it is scored; members journaled
        before a crash are not rolled out again (their perturbation is replayed where the restore mode needs it)."""
        journal = self.record.journal
        scored = dict(journal.recorded(step))
        # EGGROLL family: one batched call for all of this rank's members
        if self.strategy.evaluation == WHOLE_POPULATION:
            if any(member not in scored for member in mine):  # the same call as uninterrupted, for the same numerics
                def population_fitness(model: Any, rows: Any) -> list[list[float]]:
                    if sampling:
                        self.sample_rollouts(model, mine, rows)
                    return self.rewards_for(model, examples, rows, mine)

                fresh = self.strategy.evaluate(population_fitness, members=mine)
                scored = {**{m: r.to(torch.float64) for m, r in zip(mine, fresh)}, **scored}
                journal.record_members(step, {m: scored[m] for m in mine})
            return {m: scored[m] for m in mine}
        def journaled(member: int, rewards: torch.Tensor) -> None:
            scored[member] = rewards.to(torch.float64)
            journal.record_members(step, {member: scored[member]})

        self.strategy.plan()
        # --overlap-scoring: a member is scored (and journaled) on a background thread while the next one generates.
        with (MemberScoring(self.task, examples, journaled, self.timer) if self.cfg.overlap_scoring
              else nullcontext()) as scoring:
            for member in progress_bar(mine, desc=f"step {step} members", leave=False, nested=True,
                                       enabled=self.progress and self.is_main):
                if member not in scored:
                    if self.dist is None:  # ranks hold different members: under torchrun, steps are the stop points
                        self.budget.check()
                    rewards = self.evaluate_member(member, examples, sampling=sampling, scoring=scoring)
                    if scoring is None:
                        journaled(member, rewards)
                elif replays_members(self.cfg):
                    replay_member(self.strategy, member, scored[member])
        return {m: scored[m] for m in mine}

    def evaluate_member(self, member: int, examples: list[Example], *, sampling: bool = False,
                        scoring: MemberScoring | None = None) -> torch.Tensor:
        """Rewards of one perturbed member; out of memory is retried with half the rollout batch when allowed.
        At a sampling step the member also answers the sample questions (copes.run.samples). With `scoring`, the
        member's trajectories are handed to it and the rewards returned here are placeholders (zeros)."""
        def fitness(model: Any) -> list[float]:
            failpoint("rollout")  # crash tests: die as the rollout starts; counted to find recomputed members
            if sampling:
                self.sample_rollouts(model, [member])
            if scoring is None:
                rewards = self.rewards_for(model, examples)
            else:
                scoring.submit(member, roll_out(model, self.tokenizer, self.task, examples, tools=self.tools,
                                                agent=self.agent, timer=self.timer))
                rewards = [0.0] * len(examples)
            failpoint("member")  # crash tests: die while this member's perturbation is in the weights
            if self.device.type == "cpu":
                release_free_heap()  # the rollout's freed transients, before the next member's
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
                tqdm.write(f"out of memory on member {member} at {rows} rows per generate call; "
                           f"retrying with {rows // 2}")

    def rewards_for(self, model: Any, examples: list[Example], row_members: Any = None,
                    members: list[int] | None = None) -> list[float] | list[list[float]]:
        """Per-question rewards [Q], or [len(members)][Q] for a batched population (`members` and `row_members`)."""
        if row_members is not None and members is None:
            members = list(range(self.cfg.population))
        per_member = rollouts(model, self.tokenizer, self.task, examples, tools=self.tools, agent=self.agent,
                              timer=self.timer, members=members, row_members=row_members)
        rewards = [[score.reward for _, score in rows] for rows in per_member]
        return rewards[0] if members is None else rewards

    def sample_members_scored_before_a_resume(self, rewards: list[torch.Tensor]) -> None:
        """The sample transcripts of the step's best and worst members where their rewards came from the journal:
        each is perturbed again only to answer the sample questions (one process, per-member algorithms, an exact
        restore: the weights come back bit for bit)."""
        if self.dist is not None or self.strategy.evaluation == WHOLE_POPULATION or replays_members(self.cfg):
            return
        for member in self.record.samples.without_transcript(rewards):
            self.strategy.evaluate_member(member, lambda model, member=member: self.sample_rollouts(model, [member])
                                          or [0.0])

    def sample_rollouts(self, model: Any, members: list[int], row_members: Any = None) -> None:
        """The sample questions' transcripts for `members` (under their perturbation, or routed rows)."""
        per_member = rollouts(model, self.tokenizer, self.task, self.record.samples.examples, tools=self.tools,
                              agent=self.agent, timer=self.timer, members=members, row_members=row_members)
        self.record.samples.add(members, per_member)

    def reward_means(self, step: int) -> dict[str, float | None]:
        """`rewards/<label>/mean` of each reward function over this step's rows (valid values only; None when none
        was valid), as TRL logs them. Counts the steps in a row where a function was invalid for every row."""
        rewards = reward_set_of(self.task)
        if rewards is None:
            return {}
        per_rank = gather_values(rewards.step_stats, step) if self.dist else [rewards.step_stats]
        merged = {label: functools.reduce(RewardStepStats.merged, (stats[label] for stats in per_rank))
                  for label in rewards.labels}
        for label, stats in merged.items():
            all_invalid = stats.rows > 0 and not stats.valid
            self.invalid_streaks[label] = self.invalid_streaks.get(label, 0) + 1 if all_invalid else 0
            self.last_reward_errors[label] = stats.last_error
        return {f"rewards/{label}/mean": stats.mean for label, stats in merged.items()}

    def stop_on_invalid_rewards(self) -> None:
        """One line and a non-zero exit once a reward was invalid for every row `invalid_reward_steps` steps running
        (the steps so far are journaled: the run can be resumed once the reward is fixed)."""
        limit = self.cfg.invalid_reward_steps
        for label, streak in self.invalid_streaks.items():
            if limit and streak >= limit:
                raise UserError(f"reward {label} was invalid for every row in {streak} consecutive steps (last: "
                                f"{self.last_reward_errors[label]}); stopping (--invalid-reward-steps 0 never stops)")

    # ---- around the steps ------------------------------------------------------------------------------------
    def held_out(self, step: int, final: bool = False) -> dict[str, Any]:
        """The held-out evaluation, each rank rolling out its contiguous share of the questions (merged in rank
        order: the result one process gets, greedy tokens up to batch-composition rounding). Past the steps' budget
        only the `final` one runs, in the time kept for it (past the whole budget: its first batch only)."""
        if not self.eval_set or (not final and self.share(self.budget.spent(), step)):
            return {"step": step, "accuracy": None, "reward": None}
        rank, world = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
        questions = [self.eval_set[i] for i in members_for_rank(len(self.eval_set), rank, world)]
        with self.timer("held_out"):
            result = evaluate(self.model, self.tokenizer, self.task, questions, tools=self.tools,
                              agent_config=self.agent, progress=False,
                              deadline=self.budget.deadline) if questions else None
            if self.dist:
                result = merge_results(gather_values(result, step))
        record = {"step": step, "accuracy": result.accuracy, "reward": result.mean_reward,
                  "questions": result.n_examples}
        self.record.evals.append(record)
        return record

    def share(self, value: Any, step: int = 0) -> Any:
        """Rank 0's value on every rank (the identity in one process)."""
        return broadcast_value(value, step) if self.dist else value

    def save(self, step: int) -> None:
        with self.timer("checkpoint"):
            self.record.save(step, self.model, self.tokenizer, self.strategy)
            if self.dist:
                barrier(step)  # nobody races ahead of a checkpoint it might have to resume from

    def resume(self, path: str) -> None:
        """Continue the run journaled in `path`; members already scored in the step in progress are not rolled out
        again."""
        self.start_step = self.record.resume(path, self.model, self.strategy, save=self.save, share=self.share,
                                             progress=self.progress and self.is_main and sys.stderr.isatty())

    # ---- the loop --------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, record = self.cfg, self.record
        self.timer.add("compile", self.strategy.space.warm_up())  # a fresh install's numba compile, on its own
        started, self.budget = time.perf_counter(), Budget(cfg.budget_hours)
        self.peaks_at_start = peak_memory_bytes(self.device)  # loading's high-water mark (~0.5 GiB on CPU)
        if record.journal is None:
            record.start_journal(self.model, self.strategy, resolve_model_path(cfg.model), self.share,
                                 data_files=self.data_files)
        record.open_logs(self.start_step, (self.eval_set or self.train_set)[: cfg.sample_prompts])
        if self.is_main:
            tqdm.write(self.plan.summary(), file=sys.stderr)
        if record.eval_before is None:
            with self.budget.reserve_as_long_as():
                record.record_eval_before(self.held_out(step=0))
            if self.is_main and record.eval_before["accuracy"] is not None:  # said now, not only with the result
                tqdm.write(f"held-out accuracy before training: {100 * record.eval_before['accuracy']:.1f}% "
                           f"({record.eval_before['questions']} questions)", file=sys.stderr)
        stopped_by, step = "steps", self.start_step
        bar = progress_bar(range(self.start_step, cfg.steps), desc=f"{cfg.algorithm} on {cfg.task_label}",
                           initial=self.start_step, total=cfg.steps, enabled=self.progress and self.is_main)
        for step in bar:
            examples = [self.train_set[i] for i in batch_indices(step, cfg.prompt_batch, len(self.train_set), cfg.seed)]
            phase_before = dict(self.timer.seconds)
            try:
                stats = self.population_step(step, examples)
            except BudgetSpent:  # between members: the journal holds those scored, --resume continues the step
                stopped_by, step = "budget", step - 1  # `step` steps are complete
                break
            if stats.zero_update and self.is_main and not any(r.get("zero_update") for r in record.metrics.records):
                tqdm.write(f"warning: {zero_update_warning(step + 1, stats)}", file=sys.stderr)
            for phase, seconds in stats.phase_seconds().items():  # rollout includes generate, tools and score
                self.timer.add(phase, seconds)
            metrics = {"step": step + 1,
                       **{k: v for k, v in asdict(stats).items() if not k.endswith("_seconds") and k != "step"},
                       **self.reward_means(step + 1),
                       "time": {k: round(v - phase_before.get(k, 0.0), 4) for k, v in self.timer.seconds.items()}}
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                metrics["eval"] = self.held_out(step + 1)
            record.record_step(step + 1, metrics)
            self.stop_on_invalid_rewards()  # every rank holds the same gathered statistics: all stop together
            bar.set_postfix(reward=f"{stats.mean_reward:.3f}", best=f"{stats.max_reward:.3f}")
            if self.dist and (step + 1) % cfg.dist_check_every == 0:
                check_in_sync(self.model, step + 1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                self.save(step + 1)
            if self.after_step(step + 1, metrics):
                stopped_by = "callback"
                break
            if self.share(self.budget.spent(), step + 1):
                stopped_by = "budget"  # rank 0's clock decides for everyone
                break
        completed = step + 1 if cfg.steps > self.start_step else self.start_step
        eval_after = self.held_out(step=completed, final=True)
        if record.saved_step != completed:
            self.save(completed)
        return self.summary(eval_after, completed, stopped_by, time.perf_counter() - started)

    def after_step(self, step: int, metrics: dict[str, Any]) -> bool:
        """Called on every rank once step `step` is journaled (and checkpointed when due); True stops the run there,
        cleanly: the held-out evaluation and checkpoint of the end follow, and --resume continues it. A subclass
        (copes.ESTrainer's callbacks) decides; the plain run never stops here."""
        return False

    def summary(self, eval_after: dict, steps: int, stopped_by: str, wall: float) -> dict[str, Any]:
        peaks = peak_memory_bytes(self.device)
        peak, peak_at_start = (peaks_of.get("device", peaks_of["host"]) for peaks_of in (peaks, self.peaks_at_start))
        summary = {
            "eval_before": self.record.eval_before, "eval_after": eval_after, "steps": steps, "stopped_by": stopped_by,
            "wall_seconds": round(wall, 2), "peak_memory_bytes": peak, "peak_host_memory_bytes": peaks["host"],
            "training_peak_memory_growth_bytes": peak - peak_at_start, "phase_seconds": self.timer.snapshot(),
            "gpu_hours": round(wall / 3600 * (self.device.type == "cuda"), 4), "config": self.cfg.to_dict(),
        }
        if self.is_main:
            title = f"{self.cfg.method} on {self.cfg.task_label} ({Path(self.cfg.model).name})"
            self.record.write_summary(summary, title)
        return summary


def train(config: TrainConfig | dict[str, Any], *, task: Any = None, reward: Any = None, resume: str | None = None,
          progress: bool = False) -> dict[str, Any]:
    """A whole run from Python, as `copes-run` does it: `config` is a TrainConfig (every field set) or a mapping of
    its fields, laid over the model's preset and the defaults as copes-run lays its flags (an unknown key is a
    ConfigError); `task` a Task object and `reward` reward functions (callables or specs), also accepted as the
    mapping's "task" and "reward"; `resume` a run dir or checkpoint. Returns the summary (also in summary.json)."""
    layer = {**(config.to_dict() if isinstance(config, TrainConfig) else config),
             **({"task": task} if task is not None else {}), **({"reward": reward} if reward is not None else {})}
    plain, given = split_given(layer)
    cfg = build_config(plain) if isinstance(config, TrainConfig) else config_with_preset(plain)
    trainer = Trainer(claim_output_dir(cfg, resuming=bool(resume)), progress=progress, given=given)
    if resume:
        trainer.resume(resume)
    return trainer.train()
