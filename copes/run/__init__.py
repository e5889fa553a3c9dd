"""The durable run: `config` (TrainConfig, every option), `components` (config -> task, strategy, tools), the step
loop (`trainer`), its record (`journal`, `replay`, `checkpoint`, `samples`, `metrics`), scoring and held-out
evaluation, and `distributed` (population sharding across ranks). It drives `copes.es` and the rollout side
(`copes.rollout`, `copes.tasks`, `copes.rewards`, `copes.tools`); nothing below imports it."""
