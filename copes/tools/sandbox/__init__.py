"""The Python sandbox that runs a policy's code: `runner` (the trainer side: tiers, limits, cleanup), `child` (the
standard-library-only process that locks itself down, then runs the code), and the kernel interfaces it uses
(`seccomp`, `landlock`, `cgroups`). docs/sandbox.md has the threat model."""

from copes.tools.sandbox.runner import PythonSandbox, SandboxResult, SandboxUnavailable, remove_tree

__all__ = ["PythonSandbox", "SandboxResult", "SandboxUnavailable", "remove_tree"]
