"""The one exception type that reaches the user as a single line.

Anything the user can fix (a config key, a path, a parallel degree) raises ``ConfigError``; ``train.py``
prints ``error: <message>`` and exits with status 2, with no traceback. Everything else is a bug and keeps
its traceback.
"""


class ConfigError(Exception):
    """A problem in the user's input; the message names what is wrong, where, and how to fix it."""


class NonFiniteTraining(Exception):
    """The loss or gradient norm became NaN/Inf: the run stops (``train.py`` prints one line, exit status 3)
    rather than writing a poisoned checkpoint. The message names the step and the last good checkpoint."""
