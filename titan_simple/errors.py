"""The exceptions that reach the user as a single line.

Anything the user can fix raises a ``UserError``: ``ConfigError`` for the input (a config key, a path, a
parallel degree), ``DataError`` for data one rank finds unusable while reading it, ``CheckpointError`` for a
checkpoint that cannot be read or written (corrupt, truncated, a full disk). ``train.py`` prints
``error: <message>`` (a ConfigError on rank 0 only: it is the same on every rank) and exits with status 2, with
no traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message names what is wrong, where, and how to fix it."""

    same_on_every_rank = False  # True: rank 0 says it for the job (train.py)


class ConfigError(UserError):
    """A problem in the user's input: a config key or value, a path, the parallel degrees."""

    same_on_every_rank = True


class LighthouseLost(UserError):
    """Fault tolerance: the torchft lighthouse every replica group asks before each step stopped answering."""

    same_on_every_rank = True


class DataError(UserError):
    """The data a rank reads while training cannot be used (a stream with no documents, a file that fails to
    parse): found by one rank, so that rank reports it (a ``ConfigError`` is reported once, by rank 0)."""


class CheckpointError(UserError):
    """A checkpoint cannot be read (corrupt, truncated) or written (disk full, permissions); older complete
    checkpoints are never touched."""


class NonFiniteTraining(Exception):
    """The loss or gradient norm became NaN/Inf: the run stops (``train.py`` prints one line, exit status 3)
    rather than writing a poisoned checkpoint. The message names the step and the last good checkpoint."""
