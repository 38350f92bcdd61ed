"""The error types for bad input, so callers can tell them from a crash."""


class ConfigError(ValueError):
    """A setting, or a combination of settings, that cannot run.

    The message is one line naming the setting (as its `--flag`) and what would
    be valid. It is raised before any device or variable is created.
    """


class TensorBranchError(TypeError):
    """A model, loss or metric that branches on a tensor's value (`if tensor:`, `while`),
    found when the step is first traced: mgloop traces it without AutoGraph, as Keras's
    `fit` does (runs/loop.py). The message is one line naming the user's line."""


def one_line(error: BaseException) -> str:
    """`Type: first non-blank line of the message` (just `Type` if it has none): an error
    from TensorFlow, the file system or a user's module, quoted inside a one-line message."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def flags_parser(program: str):
    """An entry point's flag parser for absl's `app.run(main, flags_parser=...)`: absl's
    parsing, with a bad flag or value refused in one line on stderr (`PROGRAM: error: ...`)
    and exit code 2, as every other refusal (absl's own prints two lines and exits 1)."""
    import sys

    from absl import flags

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as error:
            print(f"{program}: error: {' '.join(str(error).split())}", file=sys.stderr)
            sys.exit(2)
    return parse
