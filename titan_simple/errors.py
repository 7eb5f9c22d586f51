"""The exceptions that reach the user as a single line.

Anything the user can fix raises a ``UserError``: ``ConfigError`` for the input (a config key, a path, a
parallel degree), ``CheckpointError`` for a checkpoint that cannot be read or written (corrupt, truncated, a
full disk). ``train.py`` prints ``error: <message>`` and exits with status 2, with no traceback. Everything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message names what is wrong, where, and how to fix it."""


class ConfigError(UserError):
    """A problem in the user's input: a config key or value, a path, the parallel degrees."""


class CheckpointError(UserError):
    """A checkpoint cannot be read (corrupt, truncated) or written (disk full, permissions); older complete
    checkpoints are never touched."""


class NonFiniteTraining(Exception):
    """The loss or gradient norm became NaN/Inf: the run stops (``train.py`` prints one line, exit status 3)
    rather than writing a poisoned checkpoint. The message names the step and the last good checkpoint."""
