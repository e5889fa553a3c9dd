"""TRL's trainer surface over the durable run: `config` (ESConfig, TRL's argument names mapped onto TrainConfig),
`trainer` (ESTrainer, running the very Trainer copes-run runs) and `task` (a TRL dataset and reward functions as
a task). docs/from-trl.md."""
