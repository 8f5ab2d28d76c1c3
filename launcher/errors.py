"""User-facing errors: raised for bad input, printed as one line by the CLI, exit code 2."""


class ConfigError(Exception):
    """Bad user input (config key, value, file, layout). The message names the key or file and the fix."""

    exit_code = 2
