"""`ESTrainer`: TRL's `GRPOTrainer` surface over copes' `Trainer`.

It takes GRPOTrainer's keyword arguments (model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
callbacks, tools, environment_factory), turns them into a `TrainConfig` (through `ESConfig`) and a `DatasetTask`
(copes.trl.task), and runs the very `Trainer` copes-run runs: the journal, kill-anywhere resume, copes-replay,
the memory plan, `workers` and every algorithm come with it. Callbacks are transformers' `TrainerCallback`s, driven
with a `TrainerState` / `TrainerControl`; `control.should_training_stop` ends the run after the step in progress,
journaled and resumable. Logged keys reuse GRPO's names (`reward`, `reward_std`, `frac_reward_zero_std`,
`completions/mean_length`, `rewards/<name>/mean`) beside ES's own.

Arguments only a gradient trainer uses are refused in one line each (`REFUSED`). User code that another process
cannot import again (a lambda, a closure, a function of the script being run) is said at start: under `workers > 1`
it is an error (the other ranks rebuild every function by import and never import the user's `__main__`), in one
process a notice (its code is not hashed into the journal, so a resume cannot check it is unchanged).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from copes.config.components import GivenParts
from copes.errors import ConfigError
from copes.rewards.functions import callable_label
from copes.run.checkpoint import views_on_their_own_storage
from copes.run.distributed import WORKERS_ENV, gather_values, launched_distributed, leave_distributed
from copes.run.trainer import Trainer
from copes.trl.config import ESConfig
from copes.trl.task import (
    DatasetTask,
    Environments,
    FunctionTool,
    TRLRewards,
    dataset_rows,
    function_name,
    resolve_reward_functions,
    step_log,
)

# GRPOTrainer arguments ES has no use for: why, and what to do instead.
REFUSED = {
    "reward_processing_classes": "ES scores with reward functions, not reward models; wrap a reward model in a "
                                 "function that returns one float per completion",
    "optimizers": "ES estimates its update from rewards; choose optimizer='sgd' or 'adam' in ESConfig",
    "peft_config": "ES's low-rank subspace is EGGROLL's: set algorithm='eggroll' and rank=r in ESConfig instead of a "
                   "LoRA config",
    "rollout_func": "ES rolls out through copes' agent loop; give tools= or environment_factory= instead",
    "quantization_config": "ES perturbs the weights themselves, which a quantized model does not expose; load the "
                           "model in bfloat16 (bf16=True) instead",
}


def importable_label(value: Any) -> str | None:
    """`module:qualname` when importing it again gives back this very object; None for a lambda, a closure, a
    method or anything defined in the script being run (`__main__`, which other ranks never import)."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname or "." in qualname:
        return None
    try:
        return callable_label(value) if getattr(importlib.import_module(module), qualname, None) is value else None
    except ImportError:
        return None


def is_rank_zero() -> bool:
    """Whether this process speaks for the run: one process, or rank 0 of the workers."""
    return not launched_distributed() or os.environ.get("RANK", "0") == "0"


class _HookedTrainer(Trainer):
    """copes' Trainer with ESTrainer's callbacks at each journaled step, and the held-out scoring kept out of the
    training logs."""

    es: ESTrainer
    step_rewards: torch.Tensor | None = None  # [members, questions] of the step just done, as journaled
    step_seconds = 0.0

    def population_step(self, step: int, examples: list[Any]) -> Any:
        started = time.perf_counter()
        stats = super().population_step(step, examples)
        self.step_seconds = time.perf_counter() - started  # TRL's step_time: the step's rollouts, scoring, update
        recorded = self.record.journal.recorded(step + 1)  # every rank's members, gathered
        self.step_rewards = torch.stack([recorded[member] for member in sorted(recorded)])
        return stats

    def after_step(self, step: int, metrics: dict[str, Any]) -> bool:
        tally = self.task.drain_step_tally()  # this rank's members; rank 0 logs over every rank's
        logged = step_log(gather_values(tally, step) if self.dist else [tally], self.task.rewards.names,
                          self.cfg.max_new_tokens)
        stop = self.es.step_done(step, metrics, logged) if self.is_main else False
        return bool(self.share(stop, step))  # rank 0's callbacks decide for every rank

    def held_out(self, step: int, final: bool = False) -> dict[str, Any]:
        self.task.collecting = False
        try:
            return super().held_out(step, final)
        finally:
            self.task.collecting = True


class ESTrainer:
    """A drop-in for `trl.GRPOTrainer` that trains with CoPES, ES or EGGROLL (docs/from-trl.md)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: ESConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        **gradient_only: Any,
    ) -> None:
        for name, value in gradient_only.items():
            if name not in REFUSED:
                raise ConfigError(f"ESTrainer got an unexpected argument {name!r} (GRPOTrainer's arguments: "
                                  "docs/from-trl.md)")
            if value is not None and value != (None, None):
                raise ConfigError(f"ESTrainer refuses {name}: {REFUSED[name]}")
        self.args = args if args is not None else ESConfig()
        if not isinstance(self.args, ESConfig):
            raise ConfigError(f"args must be an ESConfig (from copes import ESConfig), got {type(self.args).__name__}")
        if isinstance(environment_factory, dict):
            raise ConfigError("environment_factory: ESTrainer takes one factory, not a dict of environments")
        if train_dataset is None and environment_factory is None:
            raise ConfigError("ESTrainer needs a train_dataset (TRL's prompt-only format: a 'prompt' column), or an "
                              "environment_factory whose reset() returns each prompt")
        for line in self.args.notices():
            print(f"notice: {line}", file=sys.stderr, flush=True)

        functions = resolve_reward_functions(reward_funcs) if reward_funcs is not None else []
        weights = list(self.args.reward_weights) or [1.0] * len(functions)
        if len(weights) != len(functions):
            raise ConfigError(f"reward_weights gives {len(weights)} weights for {len(functions)} reward_funcs")
        environments = Environments(environment_factory) if environment_factory is not None else None
        if environments is not None and environments.has_reward:  # TRL: the environment's reward, weight 1
            functions, weights = [*functions, environments.reward_function()], [*weights, 1.0]
        if not functions:
            raise ConfigError("no reward: pass reward_funcs, or an environment_factory whose environment has "
                              "get_reward()")
        self.user_code = {"reward": list(reward_funcs if isinstance(reward_funcs, (list, tuple)) else
                                         [reward_funcs] if reward_funcs is not None else []),
                          "tool": list(tools or []),
                          "environment_factory": [environment_factory] if environment_factory is not None else []}
        self._explain_user_code()

        self.processing_class = processing_class
        self.callbacks = [*(callbacks or []), self._progress_callback()]
        self.datasets = (train_dataset, eval_dataset)
        self.model_spec = self._model_spec(model)
        self.rewards = TRLRewards(functions, [function_name(f) for f in functions], weights)
        self.task = DatasetTask(self._train_rows(train_dataset, environments), self._eval_rows(eval_dataset),
                                self.rewards, processing_class, environments)
        timeout = self.args.tool_timeout_s
        self.trl_tools = ([FunctionTool(tool, timeout_s=timeout) for tool in tools or []]
                          + (environments.tools(timeout) if environments else []))
        if self.trl_tools and not self.task.chat:
            raise ConfigError("tools and environments need conversational prompts (a list of messages in 'prompt'), "
                              "as in TRL")
        self.cfg = self.args.train_config(len(self.task.rows["train"]), **self._trainer_set())
        if is_rank_zero():
            print(f"notice: {self._step_shape()}", file=sys.stderr, flush=True)
        self.state, self.control = self._fresh_state()
        self.trainer: _HookedTrainer | None = None
        if self.cfg.workers == 1 or launched_distributed():  # workers > 1: train() starts the ranks, then builds
            self.trainer = self._build_trainer()
        self.control = self._event("on_init_end")

    # ---- what the arguments become -----------------------------------------------------------------------------
    def _explain_user_code(self) -> None:
        opaque = [f"{kind} {function_name(value)}" for kind, values in self.user_code.items() for value in values
                  if not isinstance(value, str) and importable_label(value) is None]
        if not opaque:
            return
        what = ", ".join(opaque)
        if self.args.workers > 1:
            raise ConfigError(f"workers={self.args.workers} rebuilds every function in each rank by import, and "
                              f"{what} cannot be imported again (a lambda, a closure or a function of the script "
                              "being run): move it into a module")
        print(f"notice: {what} cannot be imported again (a lambda, a closure or a function of the script being run), "
              "so the journal cannot hash its code and a resume cannot check it is unchanged; move it into a module",
              file=sys.stderr, flush=True)

    def _progress_callback(self) -> Any:
        """transformers.Trainer's own: a step bar that writes each log line (disable_tqdm: the log lines only)."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        return PrinterCallback() if self.args.disable_tqdm else ProgressCallback()

    def _step_shape(self) -> str:
        """One line: what a step rolls out and how many run (TRL's batch and epoch fields, read as TRL reads them),
        and the ES meaning of learning_rate."""
        cfg, args = self.cfg, self.args
        source = ("generation_batch_size // num_generations" if args.trl_prompts_per_step() is not None
                  else "prompt_batch_size")
        steps = f"{cfg.steps} step{'s' * (cfg.steps != 1)}"
        if args.max_steps == -1:
            epochs = args.num_train_epochs
            steps += f" ({epochs:g} epoch{'s' * (epochs != 1)} of {len(self.task.rows['train'])} rows)"
        return (f"each step rolls out {cfg.prompt_batch} prompts ({source}) x {cfg.population} members "
                f"(population_size) = {cfg.prompt_batch * cfg.population} rollouts; {steps}; learning_rate "
                f"{cfg.lr:g} is ES's step size alpha (the paper's 5e-4), not a gradient optimizer's")

    def _model_spec(self, model: Any) -> str:
        """The model as a hub id or an absolute path (the journal's, so copes-replay finds it from any folder); a
        model object is saved once under output_dir/base_model."""
        if isinstance(model, (str, Path)):
            return str(Path(model).resolve()) if Path(model).exists() else str(model)
        if not hasattr(model, "save_pretrained"):
            raise ConfigError(f"model must be a hub id, a local path or a PreTrainedModel, got {type(model).__name__}")
        folder = (Path(self.args.output_dir) / "base_model").resolve()
        model.save_pretrained(folder)
        if self.processing_class is None:  # TRL's default: the tokenizer the model was loaded with
            from transformers import AutoTokenizer

            self.processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        self.processing_class.save_pretrained(folder)
        return str(folder)

    def _train_rows(self, train_dataset: Any, environments: Environments | None) -> list[dict[str, Any]]:
        """The dataset's rows; without one, the environment owns the data: max_steps steps of fresh rows, each
        prompt what reset() returns (TRL's train_dataset=None)."""
        if train_dataset is not None:
            return dataset_rows(train_dataset, "train_dataset")
        if self.args.max_steps < 0:
            raise ConfigError("with no train_dataset the environment deals the prompts and nothing counts epochs: "
                              "set max_steps")
        return environments.owned_rows(self.args.max_steps * self.args.prompts_per_step())

    def _eval_rows(self, eval_dataset: Any) -> list[dict[str, Any]]:
        if eval_dataset is None:
            return []
        if isinstance(eval_dataset, dict):
            return [row for name, part in eval_dataset.items() for row in dataset_rows(part, f"eval_dataset[{name}]")]
        return dataset_rows(eval_dataset, "eval_dataset")

    def _trainer_set(self) -> dict[str, Any]:
        """The TrainConfig fields ESTrainer's arguments set: the run's identity for the journal and resume."""
        labels = {kind: [value if isinstance(value, str) else importable_label(value) or callable_label(value)
                         for value in values] for kind, values in self.user_code.items()}
        return {"model": self.model_spec, "task": self.task.name, "reward": labels["reward"],
                "task_options": {"tools": labels["tool"], "environment_factory": labels["environment_factory"]},
                "eval_size": min(self.args.eval_size, len(self.task.rows["validation"]))}

    def _build_trainer(self) -> _HookedTrainer:
        trainer = _HookedTrainer(self.cfg, progress=False, given=GivenParts(task=self.task, rewards=()))
        trainer.es = self
        if self.processing_class is not None:  # the user's (its chat template, say), padded on the left to generate
            trainer.tokenizer = self.processing_class
            trainer.tokenizer.padding_side = "left"
            if trainer.tokenizer.pad_token is None:
                trainer.tokenizer.pad_token = trainer.tokenizer.eos_token
        if self.task.chat and getattr(trainer.tokenizer, "chat_template", None) is None:  # TRL raises here too
            raise ConfigError("Cannot use chat template functions because tokenizer.chat_template is not set: "
                              "conversational prompts need one (give processing_class a tokenizer with a "
                              "chat_template, or plain-text prompts)")
        trainer.tools = [*trainer.tools, *self.trl_tools]
        self.task.tokenizer = trainer.tokenizer
        return trainer

    def _fresh_state(self) -> tuple[Any, Any]:
        from transformers import TrainerControl, TrainerState

        state = TrainerState(max_steps=self.cfg.steps, num_train_epochs=math.ceil(self.cfg.steps * self.cfg.prompt_batch
                                                                                  / len(self.task.rows["train"])),
                             logging_steps=self.args.logging_steps,
                             eval_steps=self.cfg.eval_every or self.args.logging_steps,
                             save_steps=self.cfg.checkpoint_every, train_batch_size=self.cfg.prompt_batch)
        state.is_world_process_zero = state.is_local_process_zero = is_rank_zero()  # one bar, one log per run
        self.task.trainer_state = state
        return state, TrainerControl()

    # ---- the HF surface --------------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        return self._require_trainer().model

    def _require_trainer(self) -> _HookedTrainer:
        if self.trainer is None:
            raise ConfigError("with workers > 1 the model is loaded by train(); call it first")
        return self.trainer

    def _event(self, event: str, **kwargs: Any) -> Any:
        for callback in self.callbacks:
            result = getattr(callback, event)(self.args, self.state, self.control,
                                              model=self.trainer.model if self.trainer else None,
                                              processing_class=self.task.tokenizer, optimizer=None, lr_scheduler=None,
                                              **kwargs)
            if result is not None:
                self.control = result
        return self.control

    def log(self, logs: dict[str, float]) -> None:
        """Append `logs` to state.log_history at the current step and call on_log (as transformers' Trainer.log)."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self._event("on_log", logs=logs)

    def step_done(self, step: int, metrics: dict[str, Any], logged: dict[str, float]) -> bool:
        """A journaled step: the callbacks' turn (`logged`: GRPO's per-function means and completion length over
        every rank's rollouts). True when they asked training to stop."""
        state, cfg = self.state, self.cfg
        state.global_step = step
        state.epoch = step * cfg.prompt_batch / len(self.task.rows["train"])
        state.num_input_tokens_seen += int(logged.pop("num_tokens"))
        self.control = self._event("on_step_end")
        if step % self.args.logging_steps == 0 or step == cfg.steps:
            self.log({**self.reward_stats(), **logged,
                      **{k: v for k, v in metrics.items() if k.startswith("rewards/")},  # the Trainer's own, if any
                      "num_tokens": state.num_input_tokens_seen, "learning_rate": cfg.lr,
                      "step_time": self.trainer.step_seconds, "update_norm": metrics["update_norm"],
                      "num_invalid_rewards": metrics["num_invalid_rewards"], "epoch": state.epoch})
        if metrics.get("eval"):
            self._evaluated(metrics["eval"])
        if self.trainer.record.saved_step == step:
            self._saved(step)
        if self.control.should_training_stop:
            return True
        self.control = self._event("on_step_begin")
        return False

    def reward_stats(self) -> dict[str, float]:
        """GRPO's reward keys over the step's population: every member's reward on every question, as journaled
        (GRPO's group is a prompt's completions; here, a question's members)."""
        rewards = self.trainer.step_rewards
        finite = rewards[~rewards.isnan()]
        spread = rewards.nan_to_num(0.0).std(dim=0, unbiased=False)
        return {"reward": finite.mean().item() if finite.numel() else math.nan,
                "reward_std": finite.std().item() if finite.numel() > 1 else 0.0,
                "frac_reward_zero_std": (spread == 0).double().mean().item()}

    def _evaluated(self, record: dict[str, Any]) -> dict[str, float]:
        metrics = {"eval_reward": record["reward"], "eval_accuracy": record["accuracy"]}
        self.log(metrics)
        self.control = self._event("on_evaluate", metrics=metrics)
        return metrics

    def _saved(self, step: int) -> None:
        if not self._require_trainer().is_main:
            return
        self.state.save_to_json(str(Path(self.cfg.output_dir) / "trainer_state.json"))
        self.control = self._event("on_save")

    def train(self, resume_from_checkpoint: str | bool | None = None, **_: Any) -> Any:
        """Train for max_steps (or until a callback stops it). `resume_from_checkpoint`: a run dir, or True for
        output_dir; the run continues bit-exactly from its journal. With workers > 1 this process is rank 0 and
        the other ranks run beside it, each rebuilding this trainer from its arguments (by import)."""
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else self.args.resume_from_checkpoint
        if self.trainer is None:  # workers > 1: this process is rank 0, the other ranks rebuild this trainer
            with self._other_ranks(resume):
                self.trainer = self._build_trainer()
                return self._train(resume)
        return self._train(resume)

    def _train(self, resume: str | bool | None) -> Any:
        from transformers.trainer_utils import TrainOutput

        trainer = self._require_trainer()
        self.state, self.control = self._fresh_state()
        if resume:
            trainer.resume(self.cfg.output_dir if resume is True else str(resume))
            self.state.global_step = trainer.start_step
            self.state.log_history = self._earlier_logs(trainer.start_step)
            self.state.num_input_tokens_seen = max((entry.get("num_tokens", 0) for entry in self.state.log_history),
                                                   default=0)
        started = time.perf_counter()
        self.control = self._event("on_train_begin")
        self.control = self._event("on_step_begin")
        summary = trainer.train()
        runtime = time.perf_counter() - started
        metrics = {"train_runtime": round(runtime, 4), "train_steps_per_second": summary["steps"] / max(runtime, 1e-9)}
        self.state.global_step = summary["steps"]
        self.log(metrics)
        self._saved(summary["steps"])
        self.control = self._event("on_train_end")
        self.summary = summary
        return TrainOutput(global_step=summary["steps"], training_loss=math.nan, metrics=metrics)

    @contextlib.contextmanager
    def _other_ranks(self, resume: str | bool | None) -> Iterator[None]:
        """Ranks 1..workers-1 as processes beside this one (rank 0), joined through torch.distributed's env://
        rendezvous on localhost; each gets this trainer's arguments (callables by reference) and trains alike."""
        ranks = self.cfg.workers
        with tempfile.TemporaryDirectory(prefix="copes-estrainer-") as folder:
            spec = Path(folder) / "trainer.pickle"
            processing_class = None
            if self.processing_class is not None:
                processing_class = str(Path(folder) / "processing_class")
                self.processing_class.save_pretrained(processing_class)
            given = {option.name: getattr(self.args, option.name) for option in fields(self.args)}
            spec.write_bytes(pickle.dumps({
                "model": self.model_spec, "args": {name: given[name] for name in self.args.set_fields},
                "train_dataset": None if self.task.owns_data else self.task.rows["train"],
                "eval_dataset": self.task.rows["validation"] or None,
                "reward_funcs": self.user_code["reward"], "tools": self.user_code["tool"],
                "environment_factory": (self.user_code["environment_factory"] or [None])[0],
                "processing_class": processing_class, "resume": resume}))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
                     "LOCAL_WORLD_SIZE": str(ranks), WORKERS_ENV: str(ranks)}
            # the ranks import the user's modules from where this process does (a script's folder included)
            imports = os.pathsep.join(dict.fromkeys(str(Path(p).resolve()) for p in sys.path if p))
            children = [subprocess.Popen([sys.executable, "-c", f"from {__name__} import run_rank; run_rank()",
                                          str(spec)], env={**os.environ, **world, "RANK": str(rank),
                                                           "LOCAL_RANK": str(rank), "PYTHONPATH": imports})
                        for rank in range(1, ranks)]
            saved = {name: os.environ.get(name) for name in [*world, "RANK", "LOCAL_RANK"]}
            os.environ.update({**world, "RANK": "0", "LOCAL_RANK": "0"})
            try:
                yield
            except BaseException:
                for child in children:
                    child.kill()
                raise
            finally:
                failed = [child.wait() for child in children]
                leave_distributed()  # while this process is still rank 0 of the launch
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            if any(failed):
                raise ConfigError(f"a worker rank failed (exit status {max(failed)}); its stderr above says why")

    def _earlier_logs(self, steps_done: int) -> list[dict[str, Any]]:
        """log_history of the run being resumed, up to its last journaled step."""
        from transformers import TrainerState

        saved = Path(self.cfg.output_dir) / "trainer_state.json"
        if not saved.is_file():
            return []
        return [entry for entry in TrainerState.load_from_json(str(saved)).log_history
                if entry.get("step", 0) <= steps_done and "train_runtime" not in entry]

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval", **_: Any) -> dict[str, float]:
        """Roll out and score the held-out rows (or `eval_dataset`) with the current weights; logs and returns
        `{prefix}_reward` and `{prefix}_accuracy`."""
        from copes.run.evaluation import evaluate

        trainer = self._require_trainer()
        questions = trainer.eval_set
        if eval_dataset is not None:
            rows = self._eval_rows(eval_dataset)
            questions = [self.task._example("validation", index, row) for index, row in enumerate(rows)]
        if not questions:
            raise ConfigError("evaluate() needs an eval_dataset (pass one here or to ESTrainer)")
        self.task.collecting = False
        try:
            result = evaluate(trainer.model, trainer.tokenizer, self.task, questions, tools=trainer.tools,
                              agent_config=trainer.agent, progress=False)
        finally:
            self.task.collecting = True
        metrics = {f"{metric_key_prefix}_reward": result.mean_reward, f"{metric_key_prefix}_accuracy": result.accuracy}
        self.log(metrics)
        self.control = self._event("on_evaluate", metrics=metrics)
        return metrics

    def save_model(self, output_dir: str | None = None, **_: Any) -> None:
        """The current weights and the tokenizer as a Hugging Face checkpoint (output_dir by default)."""
        trainer = self._require_trainer()
        folder = output_dir or self.cfg.output_dir
        trainer.model.save_pretrained(folder, state_dict=views_on_their_own_storage(trainer.model))
        trainer.tokenizer.save_pretrained(folder)


def run_rank() -> None:
    """A worker rank of an ESTrainer with workers > 1: rebuild the trainer from rank 0's arguments and train."""
    spec = pickle.loads(Path(sys.argv[-1]).read_bytes())
    processing_class = None
    if spec["processing_class"] is not None:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(spec["processing_class"])
    trainer = ESTrainer(model=spec["model"], reward_funcs=spec["reward_funcs"] or None, args=ESConfig(**spec["args"]),
                        train_dataset=spec["train_dataset"], eval_dataset=spec["eval_dataset"],
                        processing_class=processing_class, tools=spec["tools"] or None,
                        environment_factory=spec["environment_factory"])
    trainer.train(resume_from_checkpoint=spec["resume"])
    leave_distributed()
