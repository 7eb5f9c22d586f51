"""The folder torch's compile caches live in, checked before torch first touches it.

Importing ``torch._dynamo`` (which the trainer's modules do) creates ``TORCHINDUCTOR_CACHE_DIR`` at import time, so a
folder that cannot be made fails there with a traceback from inside torch. This module imports no torch: ``train.py``
and ``titan-run`` check the variable with it right after reading the config, and ``compile/cache.py`` checks
``[compile] cache_dir`` with it before the first compile.
"""

from __future__ import annotations

import os
import tempfile

from titan_simple.errors import ConfigError

CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def check_cache_folder_writable(folder: str, name: str) -> None:
    """The one-line ConfigError, before anything is built, of a compile cache folder this process cannot make or
    write (``name`` says where it was set)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ConfigError(f"{name} cannot be written ({error.strerror or error}): choose a folder this process can "
                          "write and every rank of the job can read.") from None


def check_cache_variable() -> None:
    """``TORCHINDUCTOR_CACHE_DIR``, when set, is a folder this process can write (eager runs too: torch makes it
    when the trainer's modules are imported)."""
    folder = os.environ.get(CACHE_DIR_VARIABLE)
    if folder:
        check_cache_folder_writable(folder, f"{CACHE_DIR_VARIABLE} {folder!r}")
