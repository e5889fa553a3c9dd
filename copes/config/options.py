"""Run configuration: one dataclass with help text, choices and defaults; YAML files and CLI flags map onto it
(the CLI's options are generated from the fields, see `copes.cli`).

Precedence, lowest first: the dataclass defaults (the paper's hyperparameters) < the model's own preset
(`copes.yaml` inside a model directory, e.g. the embedded tiny model, or `copes.<algorithm>.yaml` beside it when the
chosen algorithm has its own) < `--config FILE.yaml` < CLI flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from copes.choices import (
    ALGORITHM_TABLE,
    ALGORITHMS,
    DTYPES,
    FITNESS_MODES,
    LOWRANK_ALGORITHMS,
    OPTIMIZERS,
    PER_MEMBER_ALGORITHMS,
    RESTORE_MODES,
    ROLLOUT_ENGINES,
    SUBSPACE_ALGORITHMS,
    TOOL_FORMATS,
    VLLM_CPU_WEIGHTS,
)
from copes.errors import ConfigError
from copes.extras import rollout_engine_for

DEFAULT_OUTPUT_DIR = "runs/copes"
# Where each algorithm-specific option applies; an option set for any other algorithm is ignored (with a warning).
# Options that fix a run's trajectory: a resumed run must share them with the journal it continues.
RESUME_KEYS = ("model", "task", "task_options", "reward", "reward_weights", "algorithm", "population", "subspaces",
               "sigma", "lr", "rank", "prompt_batch", "fitness", "antithetic", "optimizer", "chunk_size", "seed",
               "dtype", "include", "exclude", "restore", "max_new_tokens", "tool_budgets", "tool_format",
               "template_kwargs")


def _opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
         algorithms: tuple[str, ...] | None = None) -> Any:
    """A config field: `help` and `choices` become the CLI option's; `algorithms` lists where it applies."""
    metadata = {"help": help, "choices": choices, "algorithms": algorithms}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    model: str = _opt("tiny", "model directory, FILE.gguf or hub id; 'tiny' is the embedded default model, "
                                 "'tiny-agent' the embedded tool-using one, 'small' the embedded "
                                 "2M-parameter one (arithmetic and countdown), 'smollm2-135m-instruct' a real "
                                 "pretrained one (fetched once per machine)")
    task: str = _opt("arithmetic", "what to train on: a task name (gsm8k, math, math500, aime24, aime25, hotpotqa, "
                                   "2wiki, musique, countdown, arithmetic, tool-arithmetic, tool-lookup), a "
                                   ".jsonl/.json/.parquet file, hf:OWNER/NAME[:CONFIG] (a hub dataset or a "
                                   "local datasets folder) or "
                                   "MODULE:FACTORY (a function returning a Task; docs/your-task.md)")
    task_options: dict[str, Any] = _opt({}, "keyword options of the task, e.g. qa_metric=em, digit_shaping=0.5, "
                                            "validation_size=500; a file or hub task: prompt_field=, answer_field=, "
                                            "eval_file=, eval_split=, chat=true|false, system_prompt=")
    reward: list[str] = _opt([], "reward functions replacing the task's own: a built-in (exact, math, qa_em, qa_f1, "
                                 "countdown, format) or MODULE:FUNCTION with TRL's signature "
                                 "f(completions, **columns) -> list[float | None]")
    reward_timeout_s: float = _opt(30.0, "seconds one call of a MODULE:FUNCTION reward may take; a call that runs "
                                         "longer (or raises) gives invalid rewards and one warning")
    invalid_reward_steps: int = _opt(3, "stop the run after this many consecutive steps in which one reward function "
                                        "was invalid for every row (it raised, hung or returned None/NaN); 0 never "
                                        "stops")
    reward_weights: list[float] = _opt([], "one weight per --reward (default: 1 each); a completion's reward is the "
                                           "weighted sum")
    algorithm: str = _opt("copes", " | ".join(f"{a.name} ({a.help})" for a in ALGORITHM_TABLE), choices=ALGORITHMS)
    population: int = _opt(40, "N: perturbed members per step (paper: 40)")
    subspaces: int = _opt(4, "K: random parameter subspaces per step (paper: 4); 1 for es and eggroll",
                          algorithms=SUBSPACE_ALGORITHMS)
    sigma: float = _opt(1e-3, "noise scale sigma; each subspace uses sqrt(K) * sigma (paper: 1e-3)")
    lr: float = _opt(5e-4, "learning rate alpha (paper: 5e-4)")
    rank: int = _opt(1, "EGGROLL rank r of each member's perturbation", algorithms=LOWRANK_ALGORITHMS)
    steps: int = _opt(100, "ES steps to run")
    prompt_batch: int = _opt(64, "questions per step, shared by every member (paper: 64)")
    max_new_tokens: int = _opt(1024, "tokens generated per turn")
    rollout_batch: int | None = _opt(None, "rows per generate call (default: the whole prompt batch at once)")
    plan: bool = _opt(False, "print the memory plan (weights, backups, optimizer state, KV and delta-net state, "
                             "activations per row) for the device and exit; needs only the model's config.json")
    device_memory_gib: float | None = _opt(None, "the device memory the plan budgets, in GiB (default: the device's "
                                                 "free memory, or 24 when no device is visible)")
    oom_retry: bool = _opt(False, "on out-of-memory, retry the member with half the rollout batch instead of stopping")
    overlap_scoring: bool = _opt(True, "score each member's rollouts on a background thread while the next member "
                                "generates (the same rewards and journal; a kill may then lose two members, not one)")
    max_turns: int = _opt(8, "agent turns per question (tool calls need turns)")
    max_context_tokens: int = _opt(131072, "hard cap on prompt + generated tokens per question (paper: 128K)")
    tools: bool | None = _opt(None, "let the agent call the Python sandbox and search where the task supports them "
                                    "(default: on for copes' own tasks and task plugins, off for a data file or a hub "
                                    "dataset, whose rows expect none)")
    tool_budgets: dict[str, int] = _opt({}, "calls allowed per tool per question, e.g. python=5 search=3 "
                                            "(default: the paper's for the task kind)")
    tool_format: str = _opt("auto", "tool-call format: qwen (<tool_call> JSON) | tags (<python>/<search>) | "
                                    "auto (from the chat template)", choices=TOOL_FORMATS)
    template_kwargs: dict[str, Any] = _opt({}, "extra chat-template variables, e.g. enable_thinking=false")
    unsafe_sandbox: bool = _opt(False, "run the Python tool even where the sandbox cannot isolate model-written code "
                                       "(no namespaces or cgroups here); a loud warning says what is missing")
    max_observation_tokens: int = _opt(1024, "each tool result (program output, passages) is clipped to this many "
                                             "tokens before it enters the model's context")
    search_corpus: str | None = _opt(None, "BM25 corpus jsonl for the search tool "
                                           "(default: built from the task's contexts)")
    retriever_url: str | None = _opt(None, "Search-R1 style retrieval server URL instead of local BM25")
    fitness: str | None = _opt(None, "reward standardisation (default: joint for copes/es/copes-lowrank, "
                                     "per_question for eggroll)", choices=FITNESS_MODES)
    antithetic: bool = _opt(False, "pair members inside each subspace as +eps/-eps (mirrored sampling); needs an "
                                   "even population/subspaces", algorithms=PER_MEMBER_ALGORITHMS)
    optimizer: str = _opt("sgd", "what applies the ES gradient estimate: sgd (w += lr * g) | adam (fp32 moments "
                                 "and master weights, evolved again on resume)", choices=OPTIMIZERS,
                          algorithms=PER_MEMBER_ALGORITHMS)
    dtype: str = _opt("auto", "weights dtype: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16",
                      choices=DTYPES)
    device: str = _opt("auto", "auto (cuda if available) | cpu | cuda | cuda:N")
    rollout_engine: str = _opt("auto", "what generates rollouts: auto (vllm on CUDA where vLLM is installed, else hf) "
                                       "| hf (the model's own forward, the reference) | vllm (the weights live in a "
                                       "vLLM engine and are perturbed in place there; pip install -e '.[vllm]')",
                               choices=ROLLOUT_ENGINES)
    vllm_kv_cache_gib: float | None = _opt(None, "with --rollout-engine vllm: the engine's KV cache size in GiB "
                                                 "(default: on CUDA what the memory plan leaves, on CPU 1)")
    vllm_cpu_weights: str = _opt("packed", "with --rollout-engine vllm on CPU: packed (each linear layer also keeps "
                                           "vLLM's oneDNN-packed copy, rebuilt before the next generation after "
                                           "each weight change: faster GEMMs for twice the linear weights' memory "
                                           "and a repack per member; the default, measured 1.24x plain's tokens/s "
                                           "on a 100M model in fp32 and 1.14x in bf16) | plain (F.linear on the "
                                           "trainer's weights: the same GEMMs and bits as hf). Ignored on CUDA, "
                                           "where vLLM reads the plain weights", choices=VLLM_CPU_WEIGHTS)
    cpu_threads: int = _opt(0, "torch intra-op threads on CPU (0: torch's default); tiny models run fastest on 1")
    workers: int = _opt(1, "processes on this machine that split each step's members (copes-run starts them as "
                           "torch.distributed ranks, gloo on CPU, one GPU each on CUDA; each holds the whole model "
                           "and uses --cpu-threads threads); the weights are bitwise those of 1. Under torchrun: 1")
    restore: str = _opt("device", "how a member's perturbation is undone: device backup | host backup | subtract",
                        choices=RESTORE_MODES, algorithms=PER_MEMBER_ALGORITHMS)
    chunk_size: int = _opt(65536, "elements per partition chunk", algorithms=PER_MEMBER_ALGORITHMS)
    seed: int = _opt(0, "seeds the data order, every noise stream and the partition")
    eval_split: str = _opt("validation", "split used for held-out accuracy (falls back to test if absent)")
    eval_size: int = _opt(200, "held-out questions evaluated before, during and after training")
    eval_every: int = _opt(0, "steps between held-out evaluations during training (0: only before and after)")
    checkpoint_every: int = _opt(0, "steps between checkpoint exports (0: only at the end); "
                                    "resume needs only the journal")
    output_dir: str = _opt(DEFAULT_OUTPUT_DIR, "where metrics, plots, summary and checkpoints go; a folder holding a "
                                               "run is refused (the default one: the run moves to a fresh "
                                               "numbered folder)")
    overwrite: bool = _opt(False, "start a new run in --output-dir even though it holds one: the earlier run's "
                                  "journal, metrics, samples, summary, plots and checkpoints are deleted first")
    budget_hours: float | None = _opt(None, "stop cleanly (checkpoint + summary) after this much wall time")
    dist_check_every: int = _opt(10, "with torchrun: steps between cross-rank weight checksum comparisons")
    dist_timeout_s: float = _opt(1800.0, "with torchrun: seconds a rank waits for the others before failing")
    tensorboard: bool = _opt(False, "also write TensorBoard events (needs the tensorboard package)")
    wandb: bool = _opt(False, "also log metrics and a rollout-samples table to Weights & Biases (needs the wandb "
                              "package; WANDB_MODE=offline works without network)")
    wandb_project: str = _opt("copes", "W&B project name")
    sample_every: int = _opt(10, "steps between rollout samples in samples.jsonl: the best and worst member's "
                                 "transcripts on a fixed few questions (0: none)")
    sample_prompts: int = _opt(4, "fixed questions in each rollout sample (the first held-out ones)")
    data_dir: str | None = _opt(None, "local dataset folder (default: $COPES_DATA_DIR, else a shared/data folder "
                                      "beside the checkout; else the hub)")
    include: list[str] = _opt([], "only parameters whose names match one of these patterns (default: all)")
    exclude: list[str] = _opt([], "parameters whose names match these patterns are never perturbed")

    def validate(self) -> TrainConfig:
        """Reject inconsistent settings with one sentence naming the option."""
        for option in fields(self):
            choices, value = option.metadata["choices"], getattr(self, option.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"unknown {option.name} {value!r}; choose one of: {', '.join(choices)}")
        if any(not isinstance(calls, int) or calls < 0 for calls in self.tool_budgets.values()):
            raise ConfigError(f"--tool-budgets must map tool names to call counts >= 0, got {self.tool_budgets}")
        for name in ("sigma", "lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")
        for name in ("population", "subspaces", "rank", "prompt_batch", "max_new_tokens", "max_turns", "chunk_size",
                     "dist_check_every", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.rollout_batch is not None and self.rollout_batch < 1:
            raise ConfigError(f"--rollout-batch must be >= 1, got {self.rollout_batch}")
        if self.vllm_kv_cache_gib is not None and not self.vllm_kv_cache_gib > 0:
            raise ConfigError(f"--vllm-kv-cache-gib must be > 0, got {self.vllm_kv_cache_gib}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.cpu_threads < 0:
            raise ConfigError(f"--cpu-threads must be >= 0, got {self.cpu_threads}")
        if min(self.steps, self.eval_size, self.eval_every, self.checkpoint_every, self.sample_every,
               self.sample_prompts) < 0:
            raise ConfigError("--steps, eval_size, eval_every, checkpoint_every, sample_every and sample_prompts "
                              "must be >= 0")
        if self.algorithm in SUBSPACE_ALGORITHMS and self.population % self.subspaces:
            raise ConfigError(
                f"--population {self.population} is not divisible by --subspaces {self.subspaces}: "
                "every subspace needs the same number of members"
            )
        if self.antithetic and self.algorithm in PER_MEMBER_ALGORITHMS and (self.population // self.num_subspaces) % 2:
            raise ConfigError(f"--antithetic pairs the members of each subspace, but --population {self.population} "
                              f"gives {self.population // self.num_subspaces} per subspace (odd)")
        if self.invalid_reward_steps < 0:
            raise ConfigError(f"--invalid-reward-steps must be >= 0, got {self.invalid_reward_steps}")
        if not self.reward_timeout_s > 0:
            raise ConfigError(f"--reward-timeout-s must be > 0, got {self.reward_timeout_s}")
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise ConfigError(f"--reward-weights gives {len(self.reward_weights)} weights for {len(self.reward)} "
                              f"--reward functions ({', '.join(self.reward) or 'none'})")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ConfigError(f"--device-memory-gib must be > 0, got {self.device_memory_gib}")
        if self.budget_hours is not None and self.budget_hours <= 0:
            raise ConfigError(f"--budget-hours must be > 0, got {self.budget_hours}")
        return self

    @property
    def num_subspaces(self) -> int:
        return self.subspaces if self.algorithm in SUBSPACE_ALGORITHMS else 1

    @property
    def task_label(self) -> str:
        """The task as progress lines name it: a data file by its file name (the config holds its absolute path)."""
        return Path(self.task).name if "/" in self.task and not self.task.startswith("hf:") else self.task

    @property
    def method(self) -> str:
        """What the run is, for people: CoPES with one subspace is standard ES, whichever flag asked for it."""
        return "es" if self.algorithm == "copes" and self.num_subspaces == 1 else self.algorithm

    def with_engine_for(self, device: str) -> TrainConfig:
        """This config with `--rollout-engine auto` made concrete for `device` (copes.extras.rollout_engine_for)."""
        return dataclasses.replace(self, rollout_engine=rollout_engine_for(self.rollout_engine, device))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def ignored_options(self, names: Collection[str]) -> list[str]:
        """Those of `names` (options the user set) that the chosen algorithm does not use."""
        return [f.name for f in fields(self)
                if f.name in names and self.algorithm not in (f.metadata["algorithms"] or ALGORITHMS)]


FIELD_NAMES = {f.name for f in fields(TrainConfig)}


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping of TrainConfig fields; unknown keys and malformed files are ConfigErrors naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"invalid YAML in {path}{where}: {getattr(error, 'problem', error)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of option: value, got {type(data).__name__}")
    unknown = sorted(set(data) - FIELD_NAMES)
    if unknown:
        raise ConfigError(f"unknown config key(s) in {path}: {', '.join(unknown)}")
    return data


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """Merge layers (later wins) onto the defaults, coercing scalar types; validation included."""
    merged: dict[str, Any] = {}
    for layer in layers:
        unknown = sorted(set(layer) - FIELD_NAMES)
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(map(repr, unknown))}; "
                              f"valid keys: {', '.join(sorted(FIELD_NAMES))}")
        merged.update({k: v for k, v in layer.items() if v is not None})
    types = {f.name: f.type for f in fields(TrainConfig)}
    for name, value in merged.items():
        merged[name] = _coerce(name, value, types[name])
    return TrainConfig(**merged).validate()


def config_with_preset(*layers: dict[str, Any]) -> TrainConfig:
    """`build_config(*layers)` over the model's own preset (`copes.yaml` in its folder, the embedded models' ES
    settings, their time budget included), as copes-run and copes.train both read it."""
    from copes.modeling import EMBEDDED_MODEL, read_preset  # torch and transformers: only when a run is built

    layers = tuple(absolute_paths(layer) for layer in layers)
    given = {k: v for layer in layers for k, v in layer.items() if v is not None}
    preset = read_preset(given.get("model") or EMBEDDED_MODEL, given.get("algorithm"))
    return build_config(read_yaml(preset) if preset else {}, *layers)


def absolute_paths(layer: dict[str, Any]) -> dict[str, Any]:
    """`layer` with the local files and folders it names relative to the working directory made absolute (a data
    file task, `hf:` folder, eval_file, data_dir, search corpus, model folder): the journal then holds paths a
    `--resume` from any other directory finds."""
    from copes.tasks.file_task import HUB_PREFIX
    from copes.tasks.plugins import task_form

    def resolved(path: Any) -> Any:
        return str(Path(path).resolve()) if isinstance(path, str) and path and Path(path).exists() else path

    out = dict(layer)
    for key in ("data_dir", "search_corpus", "model"):
        if key in out:
            out[key] = resolved(out[key])
    task = out.get("task")
    form = task_form(task) if isinstance(task, str) else None
    if form == "hub":
        folder, _, config = task[len(HUB_PREFIX):].partition(":")
        out["task"] = HUB_PREFIX + resolved(folder) + (f":{config}" if config else "")
    elif form == "file":
        out["task"] = resolved(task)
    options = out.get("task_options")
    if isinstance(options, dict) and "eval_file" in options:
        out["task_options"] = {**options, "eval_file": resolved(options["eval_file"])}
    return out


def _coerce(name: str, value: Any, annotation: str) -> Any:
    if annotation.startswith("list"):
        if annotation == "list[float]":  # --reward-weights 1,0.5 or repeated, or a YAML list
            items = [part for v in ([value] if isinstance(value, (str, int, float)) else value)
                     for part in str(v).split(",")]
            return [_coerce(name, item, "float") for item in items]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"option {name} must be a list, got {value!r}")
        return [str(v) for v in value]
    if annotation.startswith("dict"):
        if not isinstance(value, dict):
            raise ConfigError(f"option {name} must be a mapping of key: value, got {value!r}")
        value_type = annotation.split(",", 1)[1].strip(" ]")
        return {str(k): _coerce(f"{name}.{k}", v, value_type) for k, v in value.items()}
    target = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation.split(" |")[0])
    if target is None or isinstance(value, target) and not (target is int and isinstance(value, bool)):
        return value
    try:
        if target is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise ValueError
        return target(value)
    except (TypeError, ValueError):
        raise ConfigError(f"option {name} must be {annotation}, got {value!r}") from None
