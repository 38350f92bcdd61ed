"""The one error type for bad settings, so callers can tell it from a crash."""


class ConfigError(ValueError):
    """A setting, or a combination of settings, that cannot run.

    The message is one line naming the setting (as its `--flag`) and what would
    be valid. It is raised before any device or variable is created.
    """
