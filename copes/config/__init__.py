"""A run's options and its parts: `options` (TrainConfig, every option, the one source the CLI, YAML,
`copes.train` and ESConfig are views of) and `components` (a config -> its task, strategy, agent and tools).
Below the plan and the durable run, which both read a config."""
