"""The durable run: the step loop (`trainer`), scoring and held-out evaluation, the budget, ranks (`distributed`),
and the run's record (`record`, `journal`, `replay`, `checkpoint`, `samples`, `metrics`). It is built from a
config (`copes.config`), checks the memory plan (`copes.plan`) and drives `copes.es` and the rollout side; only
the TRL face and the command line import it."""
