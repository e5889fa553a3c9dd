"""Memory plans read from a config alone, before anything loads: `memory` (what an ES run keeps on the device,
per engine, and the refusal that names what to change) and `grpo` (full-parameter GRPO's column beside it)."""
