"""The error type for mistakes a user must fix (a path, a setting, a data file): the CLI prints its message as one
line and exits with status 2. Library modules raise it with messages about the thing itself, never about a flag,
so they work the same under the CLI, a YAML file or a programmatic `copes.train(config)`."""


class UserError(ValueError):
    """A mistake the user must fix; its message is one sentence saying what and where."""


class ConfigError(UserError):
    """A configuration the user must fix; the CLI prints it as one line and exits with status 2."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT stopped a run where it stood (its journal holds every member scored so far); a
    BaseException like KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum
