"""The files of a Hugging Face weight set: which ones hold a folder's weights, checked before any model is built,
and their replacement, whole, by an export.

A folder holds one weight set: ``model.safetensors``, or the shards ``model.safetensors.index.json`` lists.
``transformers`` reads ``model.safetensors`` when there is one and the index otherwise, so in a folder holding both
a loader that prefers the index reads other weights than transformers does. A folder where the two could disagree --
an index next to a ``model.safetensors``, ``*.safetensors`` the index does not list, shards without their index --
is refused in one line naming the files, rather than one set being chosen silently.

An export writes its set into a sibling folder and swaps the two folders (``write_weight_set``), the way a
checkpoint step is committed: the folder is always one whole set, the old or the new, and after a crash between
the two renames the old folder is put back by the next export. The folder's other files (a tokenizer, a README,
Meta's ``original/``) are carried over as hard links; the old set's ``config.json``, ``*.safetensors``, index and
``pytorch_model*.bin`` are not. A non-empty folder without Hugging Face weights is refused: the swap would replace
whatever else it holds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

from titan_simple.errors import ConfigError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What a Hugging Face model's weight set is made of: an export replaces these and keeps everything else.
SET_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                "pytorch_model*.bin.index.json")
_OTHER_FORMATS = ("*.bin", "*.bin.index.json", "*.pth", "*.pt")  # weights we cannot read
_STEP = re.compile(r"^step-\d+(\.partial)?$")  # trainer/checkpoint_files.py's step folders


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


# -------------------------------------------------------------------------------------------- reading


def refuse_other_weight_formats(folder: Path) -> None:
    """A Hugging Face folder (config.json) whose weights are not safetensors (``pytorch_model.bin``, ``*.pth``) is
    one ConfigError line saying so and how to convert it, instead of being taken for a broken DCP checkpoint."""
    if not (folder / "config.json").is_file() or any(folder.glob("*.safetensors")):
        return
    others = sorted(p.name for pattern in _OTHER_FORMATS for p in folder.glob(pattern))
    if others:
        raise ConfigError(
            f"{folder} is a Hugging Face folder without safetensors ({_few(others)}); titan_simple reads safetensors "
            f"only. Convert it with transformers: LlamaForCausalLM.from_pretrained('{folder}').save_pretrained("
            "'<new folder>') writes model.safetensors (pass safe_serialization=True before transformers 4.35).")


def _index_map(folder: Path) -> dict[str, str]:
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        if isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values()):
            return weight_map
        raise TypeError("weight_map is not a map of names to files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"Hugging Face weights {folder}: {INDEX} cannot be read ({type(e).__name__}: {e}); it is "
                          "corrupt: download or export the folder again.") from None


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of ``folder``'s one weight set and the index's name -> file map (None without an
    index); a folder that holds more or less than one whole set is one ConfigError line naming the files."""
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    weight_map = _index_map(folder) if (folder / INDEX).is_file() else None
    if weight_map is not None:
        listed = sorted(set(weight_map.values()))
        missing = [name for name in listed if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"Hugging Face weights {folder}: {INDEX} lists {_few(missing)}, which the folder lacks "
                              "(a download or copy that did not finish); copy the missing shards in, or download or "
                              "export the folder again.")
    elif WEIGHTS in present:
        listed = [WEIGHTS]
    else:
        raise ConfigError(f"Hugging Face weights {folder}: {_few(present) or 'no *.safetensors'} without {INDEX} or "
                          f"{WEIGHTS}; copy the index in, or download or export the folder again.")
    stray = [name for name in present if name not in listed]
    if stray:
        which = f"the shards {INDEX} lists" if weight_map is not None else WEIGHTS
        raise ConfigError(f"Hugging Face weights {folder} hold two weight sets: {_few(stray)} besides {which}; "
                          "delete the stale set's files (an export replaces the whole set), or load from a folder "
                          "holding one.")
    return [folder / name for name in listed], weight_map


def weight_shapes(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every weight of ``folder``'s set as ``name -> (file, shape)``, from the files' headers only (no tensor is
    read): a file that is not whole, or that disagrees with the index, is one ConfigError line."""
    files, weight_map = weight_files(folder)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in found:
                        raise ConfigError(f"Hugging Face weights {folder}: {name} is in both {found[name][0].name} "
                                          f"and {file.name}; download or export the folder again.")
                    found[name] = (file, tuple(f.get_slice(name).get_shape()))
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"Hugging Face weights {file} cannot be read ({e}); the file is truncated or corrupt: "
                              "download or export it again.") from None
    if weight_map is not None:
        wrong = sorted(name for name, file in weight_map.items() if found.get(name, (None,))[0] != folder / file)
        if wrong:
            raise ConfigError(f"Hugging Face weights {folder}: {INDEX} puts {_few(wrong)} in files that do not hold "
                              "them; download or export the folder again.")
    return found


# -------------------------------------------------------------------------------------------- writing


def check_export_target(folder: str | Path, source: str | Path | None = None) -> Path:
    """The folder an export may replace the weight set of (resolved), or the ConfigError line: a file, a DCP
    checkpoint (or a folder of them), or a folder holding ``source``, the checkpoint being exported."""
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"Hugging Face export target {folder} is a file; give a folder (it is created, or the "
                          "Hugging Face weights in it are replaced).")
    if not folder.is_dir():
        return folder
    if (folder / ".metadata").exists() or (folder / "complete.json").exists() or any(
            _STEP.match(entry.name) for entry in folder.iterdir() if entry.is_dir()):
        raise ConfigError(f"Hugging Face export target {folder} holds a DCP checkpoint, which the export would "
                          "replace; export into a folder of its own.")
    if source is not None and Path(source).resolve().is_relative_to(folder):
        raise ConfigError(f"Hugging Face export target {folder} holds the checkpoint being exported ({source}); "
                          "export into a folder of its own.")
    if any(folder.iterdir()) and not ((folder / "config.json").exists() or any(folder.glob("*.safetensors"))):
        raise ConfigError(f"Hugging Face export target {folder} holds files but no Hugging Face weights (no "
                          "config.json, no *.safetensors), which the export would replace; export into a new or "
                          "empty folder, or into a Hugging Face folder.")
    return folder


def write_weight_set(folder: str | Path, write: Callable[[Path], None]) -> Path:
    """Replace ``folder``'s weight set with the one ``write(new_folder)`` writes, atomically (see the module
    docstring); returns the folder."""
    folder = check_export_target(folder)
    partial, replaced = (folder.with_name(f".{folder.name}.export-{what}") for what in ("partial", "replaced"))
    try:
        _put_back_interrupted(folder, replaced)
        shutil.rmtree(partial, ignore_errors=True)  # a crashed export's
        partial.mkdir(parents=True)
        try:
            write(partial)
            if folder.is_dir():
                _carry_other_files(folder, partial)
                shutil.copymode(folder, partial)
            _swap(folder, partial, replaced)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    except OSError as error:  # a parent folder this process cannot write, a mount point that cannot be renamed
        raise ConfigError(f"Hugging Face export into {folder} failed ({error.strerror or error}); the folder is as "
                          "it was. The export writes beside the folder and swaps the two: export into a folder "
                          "whose parent this process can write (not a mount point itself).") from None
    return folder


def _swap(folder: Path, partial: Path, replaced: Path) -> None:
    """``partial`` becomes ``folder``; the old folder, if any, is deleted once the new one is in place."""
    if not folder.is_dir():
        partial.rename(folder)
        return
    folder.rename(replaced)
    try:
        partial.rename(folder)
    except OSError:
        replaced.rename(folder)
        raise
    shutil.rmtree(replaced)


def _put_back_interrupted(folder: Path, replaced: Path) -> None:
    """An export that stopped between its two renames left the old folder under ``replaced``: put it back."""
    if replaced.is_dir():
        if folder.exists():
            shutil.rmtree(replaced)
        else:
            replaced.rename(folder)


def _in_weight_set(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in SET_PATTERNS)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)


def _carry_other_files(old: Path, new: Path) -> None:
    """Everything in ``old`` that is not part of its weight set, into ``new`` (hard links: no data is copied)."""
    for entry in old.iterdir():
        if entry.is_file() and _in_weight_set(entry.name) or (new / entry.name).exists():
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(new / entry.name))
