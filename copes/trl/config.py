"""`ESConfig`: TRL's `GRPOConfig` surface over `TrainConfig`.

Every ES option is a `TrainConfig` field, generated here with its default, help and choices, under GRPOConfig's name
where the meaning is shared (`max_steps` is `steps`, `learning_rate` is `lr`, `population_size` is `population`, ...:
`GRPO_NAMES`). GRPOConfig's own settings that translate into ES options (`eval_strategy`, `report_to`,
`scale_rewards`, `max_tool_calling_iterations`, `use_vllm`, `bf16`, ...) are fields too, mapped by `train_config`.
So the CLI, YAML, `copes.train` and `ESConfig` read one table and cannot drift.

TRL's batch fields (`per_device_train_batch_size`, `gradient_accumulation_steps`, `generation_batch_size`,
`num_generations`) set the prompts of a step as TRL counts them (`generation_batch_size // num_generations`); every
ES member then scores every prompt of the step. `max_steps=-1` (TRL's default) lets `num_train_epochs` decide.
A GRPOConfig field with no ES meaning (`beta`, `loss_type`, ...) is accepted with one notice naming it, so a GRPO
script runs with only its import line changed; a name GRPOConfig does not have either is a one-line ConfigError.
"""

from __future__ import annotations

import math
import sys
from dataclasses import MISSING, Field, field, fields, make_dataclass
from typing import Any

from copes.config.options import TrainConfig, build_config
from copes.errors import ConfigError

# TrainConfig fields under GRPOConfig's (or TrainingArguments') name: the same meaning, the ES value.
GRPO_NAMES = {
    "steps": "max_steps", "lr": "learning_rate", "population": "population_size", "subspaces": "num_subspaces",
    "max_new_tokens": "max_completion_length", "checkpoint_every": "save_steps", "prompt_batch": "prompt_batch_size",
    "template_kwargs": "chat_template_kwargs", "tools": "builtin_tools",
}
# TrainConfig fields that ESTrainer's arguments set (the model, the dataset, the reward functions), or that GRPO-named
# fields below replace (eval_every: eval_strategy + eval_steps).
TRAINER_SET = ("model", "task", "task_options", "reward", "reward_timeout_s", "plan", "eval_split", "eval_every")
# Where ESTrainer's default differs from copes-run's: TRL users bring their own tools.
ES_DEFAULTS = {"tools": False, "steps": -1}  # max_steps=-1: the epochs decide, as in TRL
# TRL's defaults for its batch fields (TrainingArguments' per-device batch and accumulation, GRPOConfig's group).
TRL_BATCH_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8}
# scale_rewards -> fitness: GRPO standardises per prompt group ("group") or over the batch ("batch").
SCALE_REWARDS = {"group": "per_question", True: "per_question", "batch": "joint"}


def _grpo(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help, "choices": None, "algorithms": None})


def _from_train_config(option: Field) -> tuple[str, Any, Any]:
    metadata = {**option.metadata, "train_config": option.name}
    if option.default_factory is not MISSING:
        spec = field(default_factory=option.default_factory, metadata=metadata)
    else:
        spec = field(default=ES_DEFAULTS.get(option.name, option.default), metadata=metadata)
    return GRPO_NAMES.get(option.name, option.name), option.type, spec


_GRPO_FIELDS = [
    ("per_device_train_batch_size", "int | None", _grpo(None, "TRL's batch: with gradient_accumulation_steps and "
                                                              "workers, generation_batch_size's default (TRL's: 8)")),
    ("gradient_accumulation_steps", "int | None", _grpo(None, "TRL's batch (TRL's default: 1)")),
    ("generation_batch_size", "int | None", _grpo(None, "completions per step in TRL; prompts per step = this // "
                                                        "num_generations (default: per_device_train_batch_size x "
                                                        "gradient_accumulation_steps x workers)")),
    ("num_generations", "int | None", _grpo(None, "TRL's completions per prompt: only divides generation_batch_size "
                                                  "into prompts (TRL's default: 8); ES scores each prompt once per "
                                                  "member (population_size)")),
    ("num_train_epochs", "float", _grpo(3.0, "with max_steps=-1: passes over train_dataset (steps = ceil(epochs x "
                                             "rows // prompts per step), as TRL counts them)")),
    ("disable_tqdm", "bool | None", _grpo(None, "True: no progress bar (the per-logging_steps lines stay in "
                                                "log_history)")),
    ("tool_timeout_s", "float", _grpo(60.0, "seconds a tool or environment call may take; past it the call's "
                                            "observation says it timed out and the rollout goes on (0: no limit)")),
    ("logging_steps", "int", _grpo(1, "steps between on_log calls and log_history entries (ES steps are long: 1)")),
    ("eval_strategy", "str", _grpo("no", "no | steps: evaluate eval_dataset every eval_steps (it is evaluated before "
                                         "and after training either way)")),
    ("eval_steps", "int | None", _grpo(None, "with eval_strategy='steps': steps between evaluations "
                                             "(default: logging_steps)")),
    ("report_to", "Any", _grpo("none", "none | wandb | tensorboard | all, or a list of them")),
    ("run_name", "str | None", _grpo(None, "a name for the run, read by callbacks as args.run_name")),
    ("temperature", "float | None", _grpo(None, "not used: ES scores greedy decoding (the paper's); set, a notice")),
    ("top_p", "float | None", _grpo(None, "not used: ES scores greedy decoding; set, a notice")),
    ("top_k", "int | None", _grpo(None, "not used: ES scores greedy decoding; set, a notice")),
    ("scale_rewards", "Any", _grpo(None, "group (z-score each prompt's rewards across members: fitness=per_question) | "
                                         "batch (jointly: fitness=joint); default: the algorithm's own")),
    ("log_completions", "bool", _grpo(False, "write rollout samples (samples.jsonl) every logging_steps steps")),
    ("max_tool_calling_iterations", "int | None", _grpo(None, "tool calls per rollout (max_turns = this + 1)")),
    ("use_vllm", "bool", _grpo(False, "roll out on vLLM (rollout_engine='vllm')")),
    ("vllm_gpu_memory_utilization", "float | None", _grpo(None, "not used: copes sizes vLLM's KV cache by "
                                                                "vllm_kv_cache_gib; set, a notice")),
    ("bf16", "bool | None", _grpo(None, "True: dtype bfloat16")),
    ("fp16", "bool | None", _grpo(None, "True: dtype float16")),
    ("resume_from_checkpoint", "Any", _grpo(None, "a run dir (or True: output_dir) that train() continues")),
]

_ESFields = make_dataclass(
    "_ESFields",
    [_from_train_config(option) for option in fields(TrainConfig) if option.name not in TRAINER_SET] + _GRPO_FIELDS,
)
OWN_NAMES = {option.name for option in fields(_ESFields)}


def grpo_field_names() -> set[str]:
    """GRPOConfig's field names (TrainingArguments' included); empty without TRL installed."""
    try:
        from trl import GRPOConfig
    except ImportError:
        return set()
    return {option.name for option in fields(GRPOConfig)}


def es_names(message: str) -> str:
    """A TrainConfig error message with its options spelled as ESConfig's fields (`--steps` -> `max_steps`)."""
    for name, es_name in sorted(GRPO_NAMES.items(), key=lambda item: -len(item[0])):
        message = message.replace(f"--{name.replace('_', '-')}", es_name)
    for name in OWN_NAMES:
        message = message.replace(f"--{name.replace('_', '-')}", name)
    return message


class ESConfig(_ESFields):
    """GRPOConfig's fields where the meaning is shared, plus the ES ones (`algorithm`, `population_size`,
    `num_subspaces`, `sigma`, `rank`, `prompt_batch_size`, ...): see docs/from-trl.md for the table. Keywords only."""

    def __init__(self, **options: Any) -> None:
        foreign = sorted(set(options) - OWN_NAMES)
        unknown = sorted(set(foreign) - grpo_field_names())
        if unknown:
            raise ConfigError(f"ESConfig has no field {', '.join(unknown)} (and GRPOConfig has none by that name "
                              "either); docs/from-trl.md lists the fields")
        super().__init__(**{name: value for name, value in options.items() if name in OWN_NAMES})
        self.ignored_grpo_fields = foreign
        self.set_fields = sorted(set(options) & OWN_NAMES)
        if foreign:
            print(f"notice: ESConfig ignores GRPOConfig's {', '.join(foreign)}: gradient-training settings with no "
                  "meaning for evolution strategies (docs/from-trl.md)", file=sys.stderr, flush=True)
        self.train_config(reward=[f"reward {i}" for i in range(len(self.reward_weights))])  # refuse bad values now

    def trl_prompts_per_step(self) -> int | None:
        """TRL's prompts per step, `generation_batch_size // num_generations` (generation_batch_size defaulting to
        per_device_train_batch_size x gradient_accumulation_steps x processes); None when no batch field is set."""
        given = {name: getattr(self, name) for name in [*TRL_BATCH_DEFAULTS, "generation_batch_size"]}
        if all(value is None for value in given.values()):
            return None
        for name, value in given.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        batch = {name: given[name] or default for name, default in TRL_BATCH_DEFAULTS.items()}
        generation_batch = given["generation_batch_size"] or (batch["per_device_train_batch_size"]
                                                              * batch["gradient_accumulation_steps"] * self.workers)
        if generation_batch % batch["num_generations"]:
            raise ConfigError(f"generation_batch_size ({generation_batch}) must be divisible by num_generations "
                              f"({batch['num_generations']}), as in TRL")
        return generation_batch // batch["num_generations"]

    def prompts_per_step(self) -> int:
        """The prompts every member scores each step: TRL's batch fields when set, else prompt_batch_size."""
        trl_prompts = self.trl_prompts_per_step()
        if trl_prompts is None:
            return self.prompt_batch_size
        if "prompt_batch_size" in self.set_fields and self.prompt_batch_size != trl_prompts:
            raise ConfigError(f"prompt_batch_size={self.prompt_batch_size} and TRL's batch fields "
                              f"(generation_batch_size // num_generations = {trl_prompts}) disagree; set one of them")
        return trl_prompts

    def steps_for(self, train_rows: int | None) -> int:
        """max_steps, or with max_steps=-1 TRL's count for num_train_epochs over `train_rows` rows: each epoch is
        rows // prompts per step steps (at least 1). None rows (not known yet): 1, to check the other fields."""
        if self.max_steps >= 0:
            return self.max_steps
        if self.max_steps != -1:
            raise ConfigError(f"max_steps must be >= 0, or -1 (num_train_epochs decides), got {self.max_steps}")
        if not self.num_train_epochs > 0:
            raise ConfigError(f"with max_steps=-1, num_train_epochs must be > 0, got {self.num_train_epochs}")
        if train_rows is None:
            return 1
        return math.ceil(self.num_train_epochs * max(train_rows // self.prompts_per_step(), 1))

    def translated(self, train_rows: int | None = None) -> dict[str, Any]:
        """The TrainConfig options GRPO's own fields set, each checked; `train_rows` (the dataset's length) turns
        max_steps=-1 into TRL's step count for num_train_epochs."""
        layer: dict[str, Any] = {"prompt_batch": self.prompts_per_step(), "steps": self.steps_for(train_rows)}
        if self.tool_timeout_s < 0:
            raise ConfigError(f"tool_timeout_s must be >= 0 (0: no limit), got {self.tool_timeout_s}")
        if self.eval_strategy not in ("no", "steps"):
            raise ConfigError(f"eval_strategy must be 'no' or 'steps' (ES counts steps, not epochs), got "
                              f"{self.eval_strategy!r}")
        layer["eval_every"] = (self.eval_steps or self.logging_steps) if self.eval_strategy == "steps" else 0
        if self.logging_steps < 1:
            raise ConfigError(f"logging_steps must be >= 1, got {self.logging_steps}")
        reports = [self.report_to] if isinstance(self.report_to, str) or self.report_to is None else self.report_to
        unknown = sorted(set(reports) - {"none", "all", "wandb", "tensorboard", None})
        if unknown:
            raise ConfigError(f"report_to {', '.join(map(str, unknown))} is not available; give none, wandb, "
                              "tensorboard or all")
        layer["wandb"] = "wandb" in reports or "all" in reports or self.wandb
        layer["tensorboard"] = "tensorboard" in reports or "all" in reports or self.tensorboard
        if self.scale_rewards is not None:
            if self.scale_rewards not in SCALE_REWARDS:
                raise ConfigError(f"scale_rewards {self.scale_rewards!r} has no ES meaning: ES needs standardised "
                                  "rewards; give 'group' or 'batch', or leave it unset")
            if self.fitness is not None and self.fitness != SCALE_REWARDS[self.scale_rewards]:
                raise ConfigError(f"scale_rewards={self.scale_rewards!r} and fitness={self.fitness!r} disagree; "
                                  "set one of them")
            layer["fitness"] = SCALE_REWARDS[self.scale_rewards]
        if self.log_completions:
            layer["sample_every"] = self.logging_steps
        if self.max_tool_calling_iterations is not None:
            layer["max_turns"] = self.max_tool_calling_iterations + 1
        if self.use_vllm:
            layer["rollout_engine"] = "vllm"
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both set; choose one")
        if self.bf16 or self.fp16:
            layer["dtype"] = "bfloat16" if self.bf16 else "float16"
        return layer

    def notices(self) -> list[str]:
        """One line per set GRPO field that ES does not use."""
        unused = [name for name in ("temperature", "top_p", "top_k") if getattr(self, name) is not None]
        lines = [f"ES scores greedy decoding (the paper's): {', '.join(unused)} not used"] if unused else []
        if self.vllm_gpu_memory_utilization is not None:
            lines.append("vllm_gpu_memory_utilization is not used: copes sizes vLLM's KV cache by vllm_kv_cache_gib")
        return lines

    def train_config(self, train_rows: int | None = None, **trainer_set: Any) -> TrainConfig:
        """The TrainConfig this config means, with the fields ESTrainer's arguments set (model, task, reward, ...);
        `train_rows`: the training dataset's length (max_steps=-1 counts epochs over it)."""
        layer = {option.metadata["train_config"]: getattr(self, option.name)
                 for option in fields(self) if "train_config" in option.metadata}
        try:
            return build_config(layer, self.translated(train_rows), trainer_set)
        except ConfigError as error:
            raise ConfigError(es_names(str(error))) from None
