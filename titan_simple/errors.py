"""The one exception type that reaches the user as a single line.

Anything the user can fix (a config key, a path, a parallel degree) raises ``ConfigError``; ``train.py``
prints ``error: <message>`` and exits with status 2, with no traceback. Everything else is a bug and keeps
its traceback.
"""


class ConfigError(Exception):
    """A problem in the user's input; the message names what is wrong, where, and how to fix it."""
