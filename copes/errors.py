"""The error type for mistakes a user must fix (a path, a setting, a data file): the CLI prints its message as one
line and exits with status 2. Library modules raise it with messages about the thing itself, never about a flag,
so they work the same under the CLI, a YAML file or a programmatic `copes.train(config)`."""


class UserError(ValueError):
    """A mistake the user must fix; its message is one sentence saying what and where."""


class ConfigError(UserError):
    """A configuration the user must fix; the CLI prints it as one line and exits with status 2."""
