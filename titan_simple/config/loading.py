"""Loading a job configuration: TOML, then ``--section.key value`` overrides, each value coerced to its field's type,
then validation; and the ``--help`` text.

Precedence is command line > TOML file > the defaults declared in ``config/schema.py``.

    python train.py --config llama3_8b.toml --training.steps 100 --compile.enable

Anything the user can get wrong (an unknown section or key, a wrong type, an impossible value, a missing
file) raises :class:`ConfigError` with one line naming the key, where it came from and what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import types
import typing
from pathlib import Path
from typing import Any

try:  # the standard library's TOML reader (Python 3.11+); tomli is the same package for older Pythons
    import tomllib as tomli
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli

from titan_simple.config.schema import CONFIG_DIR, JobConfig, sections
from titan_simple.config.stage_checks import check_stages
from titan_simple.errors import ConfigError


def resolve_project_path(path: str) -> str:
    """Relative paths are tried in the working directory, then in the project folder (so the shipped
    configs work from anywhere)."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return str(candidate)
    in_project = CONFIG_DIR.parent / candidate
    return str(in_project) if in_project.exists() else str(candidate)


def _section_type(name: str) -> type:
    return typing.get_type_hints(JobConfig)[name]


@functools.cache
def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


# ---------------------------------------------------------------------------------------------- types


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp)).replace("NoneType", "none")
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"table of {' to '.join(_type_name(a) for a in typing.get_args(tp))}"
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "none")


def _coerce(value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float). Raise TypeError."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        for option_type in typing.get_args(tp):
            try:
                return _coerce(value, option_type)
            except TypeError:
                pass
        raise TypeError
    if tp is type(None):
        if value is None:
            return None
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        return [_coerce(v, typing.get_args(tp)[0]) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type): _coerce(v, value_type) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _parse_cli_value(text: str, tp: Any) -> Any:
    """Turn a command-line string into a value of type ``tp`` (TOML syntax for lists, bare words for str; a list
    of strings also takes comma-separated bare words: ``--model.converters float8``)."""
    if tp == list[str] and not text.lstrip().startswith("["):
        return [word.strip() for word in text.split(",") if word.strip()]
    allowed = {tp} if typing.get_origin(tp) not in (types.UnionType, typing.Union) else set(typing.get_args(tp))
    if type(None) in allowed and text.lower() in ("none", "null"):
        return None
    if bool in allowed:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
    if str in allowed:
        return text
    try:
        return tomli.loads(f"v = {text}")["v"]
    except tomli.TOMLDecodeError:
        return text  # reported as a type error by _coerce


# ---------------------------------------------------------------------------------------------- loading


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else f" Known: {', '.join(candidates)}."


def _set(config: JobConfig, section: str, key: str, value: Any, source: str, from_cli: bool) -> None:
    section_names = [f.name for f in sections()]
    if section not in section_names:
        raise ConfigError(f"{source}: unknown section [{section}].{_suggest(section, section_names)}")
    section_obj = getattr(config, section)
    types_by_key = _field_types(type(section_obj))
    if key not in types_by_key:
        raise ConfigError(
            f"{source}: unknown key '{key}' in [{section}].{_suggest(key, list(types_by_key))}"
        )
    tp = types_by_key[key]
    if from_cli and isinstance(value, str):
        value = _parse_cli_value(value, tp)
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        setattr(section_obj, key, _tables(value, typing.get_args(tp)[0], f"{source}: [[{section}.{key}]]"))
        config.sources[f"{section}.{key}"] = source
        return
    try:
        value = _coerce(value, tp)
    except TypeError:
        raise ConfigError(
            f"{source}: [{section}] {key} = {value!r} has the wrong type; expected {_type_name(tp)}."
        ) from None
    choices = next(f for f in dataclasses.fields(section_obj) if f.name == key).metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(
            f"{source}: [{section}] {key} = {value!r} is not allowed; choose one of {', '.join(choices)}."
        )
    setattr(section_obj, key, value)
    config.sources[f"{section}.{key}"] = source


def _tables(value: Any, item_type: type, where: str) -> list[Any]:
    """A TOML array of tables (``[[training.mixture]]``, or the same inline on the command line) as a list of
    ``item_type``, each key checked like a section's."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ConfigError(f"{where} must be tables ([[...]] in TOML, or [{{name = ..., ...}}] on the command line).")
    types_by_key, items = _field_types(item_type), []
    for number, table in enumerate(value, start=1):
        item = item_type()
        for key, item_value in table.items():
            if key not in types_by_key:
                raise ConfigError(f"{where} entry {number}: unknown key '{key}'.{_suggest(key, list(types_by_key))}")
            try:
                setattr(item, key, _coerce(item_value, types_by_key[key]))
            except TypeError:
                raise ConfigError(f"{where} entry {number}: {key} = {item_value!r} has the wrong type; expected "
                                  f"{_type_name(types_by_key[key])}.") from None
        items.append(item)
    return items


def resolve_config_path(name: str) -> Path:
    """A path as given, or else a bare file name looked up in the project's configs/ folder."""
    path = Path(name)
    if path.is_file():
        return path
    if not path.is_absolute() and (CONFIG_DIR / path.name).is_file() and len(path.parts) == 1:
        return CONFIG_DIR / path.name
    available = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"config file '{name}' not found; give a path or one of configs/: {available}.")


def load_toml(config: JobConfig, path: Path) -> None:
    try:
        data = tomli.loads(path.read_text())
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e}).") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: '{section}' must be a [section] table, not a bare key.")
        for key, value in table.items():
            _set(config, section, key, value, str(path), from_cli=False)
    config.config_file = str(path)


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str, str | None]], dict[str, Any]]:
    """Split argv into (config file, [(section, key, raw value)], extra flags such as help)."""
    config_file, overrides, flags = None, [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            flags["help"] = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"command line: unexpected argument '{arg}'; options look like --section.key value.")
        name, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            value = None
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
        i += 1
        if name in ("config", "job.config_file"):
            if value is None:
                raise ConfigError("command line: --config needs a file, e.g. --config configs/llama3_debug.toml.")
            config_file = value
            continue
        section, dot, key = name.partition(".")
        if name == "dry_run":  # the bare flag is short for --dry_run.enable
            section, dot, key = "dry_run", ".", "enable"
        if not dot:
            raise ConfigError(f"command line: '--{name}' is not a config key; keys look like --section.key.")
        overrides.append((section, key, value))
    return config_file, overrides, flags


def load_job_config(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from ``--config FILE`` and ``--section.key value`` overrides, then validate it."""
    argv = sys.argv[1:] if argv is None else argv
    config_file, overrides, flags = parse_overrides(argv)
    if flags.get("help"):
        print(help_text())
        raise SystemExit(0)
    config = JobConfig()
    if config_file is not None:
        load_toml(config, resolve_config_path(config_file))
    for section, key, value in overrides:
        if value is None:  # a bare flag: only booleans may omit the value
            tp = _field_types(_section_type(section)).get(key) if section in [f.name for f in sections()] else None
            value = "true" if tp is bool else None
            if value is None and tp is not None:
                raise ConfigError(f"command line: --{section}.{key} needs a value ({_type_name(tp)}).")
        _set(config, section, key, value, "command line", from_cli=True)
    validate(config)
    return config


# ---------------------------------------------------------------------------------------------- checks


CONVERTERS = ("float8",)  # [model] converters


def _require(ok: bool, config: JobConfig, section: str, key: str, expected: str) -> None:
    if not ok:
        value = getattr(getattr(config, section), key)
        source = config.sources.get(f"{section}.{key}", "default value")
        raise ConfigError(f"{source}: [{section}] {key} = {value!r} is impossible; expected {expected}.")


def _check_mixture(config: JobConfig, section: str) -> None:
    """[[training.mixture]] / [[validation.mixture]]: named sources, positive weights, not beside one dataset."""
    mixture = getattr(config, section).mixture
    if not mixture:
        return
    mixture_source = config.sources.get(f"{section}.mixture", "default value")
    where = f"{mixture_source}: [[{section}.mixture]]"
    for single in ("dataset", "dataset_path"):
        # A mixture on the command line replaces a config file's single dataset; set in one place, both are a slip.
        set_in = config.sources.get(f"{section}.{single}")
        if set_in is not None and not (mixture_source == "command line" != set_in):
            raise ConfigError(f"{set_in}: [{section}] {single} is set beside [[{section}.mixture]]; name every "
                              "source in the mixture and remove it.")
    names = [entry.name for entry in mixture]
    for number, entry in enumerate(mixture, start=1):
        if not entry.name or any(c.isspace() or c in "/=," for c in entry.name):
            raise ConfigError(f"{where} entry {number}: name {entry.name!r} must be a word (no spaces, '/', '=' or "
                              "','): it names the source in logs and metrics.")
        if not (entry.weight > 0 and entry.weight < float("inf")):
            raise ConfigError(f"{where} '{entry.name}': weight = {entry.weight!r} is impossible; expected a positive "
                              "share of the tokens.")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"{where}: the name(s) {', '.join(duplicates)} appear twice; give every source its own.")


def validate(config: JobConfig) -> None:
    """Value checks that need no hardware (world-size checks live in ParallelDims)."""
    training, parallelism = config.training, config.parallelism
    optimizer, lr_scheduler = config.optimizer, config.lr_scheduler
    _require(config.model.n_layers >= 0, config, "model", "n_layers", "0 (the flavor's) or a positive number")
    _require(set(config.model.converters) <= set(CONVERTERS) and len(set(config.model.converters))
             == len(config.model.converters), config, "model", "converters",
             f"a list of distinct converters from {list(CONVERTERS)}, e.g. [\"float8\"]")
    _require(training.steps > 0, config, "training", "steps", "a positive number of steps")
    _require(training.local_batch_size > 0, config, "training", "local_batch_size", "a positive integer")
    _require(training.global_batch_size == -1 or training.global_batch_size > 0, config, "training",
             "global_batch_size", "-1 or a positive integer")
    _require(training.seq_len > 0, config, "training", "seq_len", "a positive integer")
    _check_mixture(config, "training")
    _check_mixture(config, "validation")
    check_stages(config)
    _require(training.loss_chunks > 0, config, "training", "loss_chunks", "a positive integer (1: the plain loss)")
    _require(training.max_norm >= 0, config, "training", "max_norm", ">= 0 (0 disables clipping)")
    _require(optimizer.lr > 0, config, "optimizer", "lr", "a positive learning rate")
    _require(optimizer.eps > 0, config, "optimizer", "eps", "a positive epsilon")
    _require(optimizer.weight_decay >= 0, config, "optimizer", "weight_decay", ">= 0")
    _require(lr_scheduler.warmup_steps >= 0, config, "lr_scheduler", "warmup_steps", ">= 0")
    _require(lr_scheduler.decay_ratio is None or 0 <= lr_scheduler.decay_ratio <= 1, config, "lr_scheduler",
             "decay_ratio", "none or a fraction in [0, 1]")
    _require(0 <= lr_scheduler.min_lr_factor <= 1, config, "lr_scheduler", "min_lr_factor", "a fraction in [0, 1]")
    ac = config.activation_checkpoint
    _require(ac.selective_ac_option in ("op", "op_all_matmuls")
             or (ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) > 0), config,
             "activation_checkpoint", "selective_ac_option",
             "'op', 'op_all_matmuls' or a positive integer N (every N-th block)")
    _require(config.metrics.log_freq > 0, config, "metrics", "log_freq", "a positive integer")
    _require(config.compile.precompile_world_size >= 0, config, "compile", "precompile_world_size",
             "0 (train) or the number of ranks of the job to compile for")
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                "context_parallel_degree"):
        _require(getattr(parallelism, key) >= 1, config, "parallelism", key, "an integer >= 1")
    _require(parallelism.data_parallel_shard_degree == -1 or parallelism.data_parallel_shard_degree >= 1, config,
             "parallelism", "data_parallel_shard_degree", "-1 (the rest of the world) or an integer >= 1")
    compile_config = config.compile
    _require(not compile_config.manual_bucketed_modules or compile_config.bucketing == "transformer_block", config,
             "compile", "manual_bucketed_modules", "[] unless bucketing = 'transformer_block' (the manual plan)")
    _require(not compile_config.manual_bucketed_modules or not compile_config.regional, config, "compile",
             "manual_bucketed_modules", "[] with regional = true (regions bucket themselves: the first block's "
             "attention norm + q / k / v, its wo, its feed-forward, the middle blocks, the last block but its w2, "
             "its w2; see regional_blocks)")
    _require(compile_config.regional_blocks >= 1, config, "compile", "regional_blocks", "an integer >= 1")
    _validate_muon(config)
    _validate_pipeline(config)
    _validate_comm(config)
    _validate_checkpoint(config)
    _validate_validation_and_profiling(config)
    _validate_fault_tolerance(config)
    _require(config.dry_run.world_size >= 1, config, "dry_run", "world_size",
             "the number of devices to plan for (>= 1)")


MUON_KEYS = ("muon_lr", "muon_weight_decay", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr_fn",
             "muon_ns_dtype", "muon_exclude")


def _validate_muon(config: JobConfig) -> None:
    """Muon's keys on their own; whether the model has block matrices for it is the plan's check."""
    optimizer = config.optimizer
    set_here = [key for key in MUON_KEYS if f"optimizer.{key}" in config.sources]
    if optimizer.name != "Muon" and set_here:
        source = config.sources[f"optimizer.{set_here[0]}"]
        raise ConfigError(f"{source}: [optimizer] {set_here[0]} is set but name = {optimizer.name!r}: Muon's keys "
                          "take effect with name = 'Muon' (whose other parameters take AdamW, the decoupled decay "
                          "Muon's matrices have too; Adam's L2 decay has no Muon counterpart). Set name = 'Muon' or "
                          "drop the muon_ keys.")
    _require(optimizer.muon_lr is None or optimizer.muon_lr > 0, config, "optimizer", "muon_lr",
             "none (= lr) or a positive learning rate")
    _require(optimizer.muon_weight_decay is None or optimizer.muon_weight_decay >= 0, config, "optimizer",
             "muon_weight_decay", "none (= weight_decay) or a value >= 0")
    _require(0 <= optimizer.muon_momentum < 1, config, "optimizer", "muon_momentum", "a value in [0, 1)")
    _require(optimizer.muon_ns_steps >= 1, config, "optimizer", "muon_ns_steps",
             "at least 1 Newton-Schulz iteration (torch.optim.Muon's default: 5)")


def _validate_fault_tolerance(config: JobConfig) -> None:
    """The keys on their own; the checks against the layout and the lighthouse live in trainer/fault_tolerance.py."""
    ft = config.fault_tolerance
    if not ft.enable:
        return
    _require(ft.group_size >= 1, config, "fault_tolerance", "group_size", "the number of replica groups (>= 1)")
    _require(0 <= ft.replica_id < ft.group_size, config, "fault_tolerance", "replica_id",
             f"this group's index, 0 .. group_size - 1 = {ft.group_size - 1}")
    _require(1 <= ft.min_replica_size <= ft.group_size, config, "fault_tolerance", "min_replica_size",
             f"1 .. group_size = {ft.group_size}")
    for key in ("timeout_seconds", "quorum_timeout_seconds", "bucket_cap_mb", "heal_gb_per_second"):
        _require(getattr(ft, key) > 0, config, "fault_tolerance", key, "a positive number")


def _validate_validation_and_profiling(config: JobConfig) -> None:
    validation, profiling = config.validation, config.profiling
    _require(validation.freq > 0, config, "validation", "freq", "a positive number of steps")
    _require(validation.steps == -1 or validation.steps > 0, config, "validation", "steps",
             "-1 (the whole held-out set) or > 0")
    _require(validation.local_batch_size == -1 or validation.local_batch_size > 0, config, "validation",
             "local_batch_size", "-1 (as [training]) or a positive integer")
    training_seq_len = config.training.seq_len
    _require(validation.seq_len == -1 or 0 < validation.seq_len <= training_seq_len, config, "validation", "seq_len",
             f"-1 (as [training]) or 1..[training] seq_len = {training_seq_len} (the model's longest)")
    _require(profiling.profiler_active > 0, config, "profiling", "profiler_active", "a positive number of steps")
    _require(profiling.profiler_warmup >= 0, config, "profiling", "profiler_warmup", ">= 0")
    recorded = profiling.profiler_warmup + profiling.profiler_active
    _require(profiling.profile_freq >= recorded, config, "profiling", "profile_freq",
             f">= profiler_warmup + profiler_active = {recorded}")


def _validate_comm(config: JobConfig) -> None:
    comm = config.comm
    _require(comm.init_timeout_seconds > 0, config, "comm", "init_timeout_seconds", "a positive number of seconds")
    _require(comm.train_timeout_seconds > 0, config, "comm", "train_timeout_seconds", "a positive number of seconds")
    _require(comm.trace_buf_size >= 0, config, "comm", "trace_buf_size", ">= 0 (0 turns the flight recorder off)")
    _require(bool(comm.save_traces_folder) and not Path(comm.save_traces_folder).is_absolute(), config, "comm",
             "save_traces_folder", "a relative folder name (it lives under [job] dump_folder)")


def _validate_checkpoint(config: JobConfig) -> None:
    checkpoint = config.checkpoint
    _require(checkpoint.interval > 0, config, "checkpoint", "interval", "a positive number of steps")
    _require(checkpoint.keep_latest_k >= 0, config, "checkpoint", "keep_latest_k", ">= 0 (0 keeps all)")
    _require(checkpoint.load_step >= -1, config, "checkpoint", "load_step", "-1 (the newest) or a step >= 0")
    loadable = ("optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
    _require(all(part in loadable for part in checkpoint.exclude_from_loading), config, "checkpoint",
             "exclude_from_loading", f"a list of: {', '.join(loadable)}")
    _require(bool(checkpoint.folder) and not Path(checkpoint.folder).is_absolute(), config, "checkpoint", "folder",
             "a relative folder name (it lives under [job] dump_folder)")


def _validate_pipeline(config: JobConfig) -> None:
    """The pipeline keys on their own; the checks against the model's layers live in parallel/pipeline.py."""
    parallelism = config.parallelism
    _require(parallelism.pipeline_parallel_microbatch_size >= 1, config, "parallelism",
             "pipeline_parallel_microbatch_size", "a positive integer")
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    _require(layers_per_stage is None or layers_per_stage >= 1, config, "parallelism",
             "pipeline_parallel_layers_per_stage", "none or a positive integer")
    points = parallelism.pipeline_parallel_split_points
    starts = [int(s.removeprefix("layers.")) if s.startswith("layers.") and s[7:].isdigit() else -1 for s in points]
    _require(all(start >= 1 for start in starts) and starts == sorted(set(starts)), config, "parallelism",
             "pipeline_parallel_split_points", "strictly increasing layer names 'layers.N' (N >= 1), e.g. "
             "['layers.2', 'layers.4']")
    if parallelism.pipeline_parallel_degree > 1:
        _require(config.training.local_batch_size % parallelism.pipeline_parallel_microbatch_size == 0, config,
                 "parallelism", "pipeline_parallel_microbatch_size",
                 f"a divisor of [training] local_batch_size = {config.training.local_batch_size}")


# ---------------------------------------------------------------------------------------------- help


def help_text() -> str:
    lines = [
        "usage: train.py [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "--config FILE  a TOML file, or a bare name from configs/ (e.g. llama3_8b.toml).",
        "Precedence: command line > TOML > defaults. Booleans may be given bare (--compile.enable).",
    ]
    defaults = JobConfig()
    for section_field in sections():
        section = getattr(defaults, section_field.name)
        lines += ["", f"[{section_field.name}]"]
        hints = _field_types(type(section))
        for f in dataclasses.fields(section):
            choices = f.metadata.get("choices")
            kind = " | ".join(choices) if choices else _type_name(hints[f.name])
            lines.append(f"  --{section_field.name}.{f.name} ({kind}, default {getattr(section, f.name)!r})")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
