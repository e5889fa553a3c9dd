"""The ES core: the trainable-parameter space (`params`, the only writer of trainable weights), reward shaping
(`fitness`) and the strategies built on them (`strategies`). It knows nothing of runs, tasks or rollouts; it
imports only `copes_kernels` and the shared `copes.choices` / `copes.errors` / `copes.failpoints`."""
