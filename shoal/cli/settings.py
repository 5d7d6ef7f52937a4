"""``shoal train``'s run settings from its flags and a ``--config`` file: merged, each value
type-checked, an error about a file's value naming the file and the key."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError
from shoal.schema import check_value, field_kind, field_types, flag_name, show_value


def config_from_args(args: argparse.Namespace) -> Any:
    """Merge defaults, ``--config`` file and flags into a validated TrainConfig.

    A config file's values are checked as the flags are, strategy options by the chosen
    strategy's ``Options``; an error about a value from the file names the file and the key.
    """
    from shoal.config import TrainConfig
    from shoal.strategies import get_strategy, make_options

    values: dict[str, Any] = {}
    options: dict[str, Any] = {}
    given = vars(args)
    source, from_file = "", set()
    if "config" in given:
        source = f"config file {given['config']}"
        values, options = _config_file(given["config"], given)
        from_file = set(values) | set(options)
    for key, value in given.items():
        if key.startswith("opt_"):
            options[key[4:]] = value
            from_file.discard(key[4:])
        elif key not in ("command", "config", "debug", "secret_file"):
            values[key] = value
            from_file.discard(key)
    values["strategy_options"] = options
    try:
        cfg = TrainConfig.from_dict(values).validate()
        if from_file & set(options):  # the flags' are checked before workers start
            make_options(get_strategy(cfg.strategy), cfg.strategy_options, cfg.workers)
    except ShoalError as exc:
        raise _blame(exc, source, from_file) from exc
    return cfg


def _blame(exc: ShoalError, source: str, keys: set[str]) -> ShoalError:
    """``exc``, naming ``source`` and the key when it is about a value of one of ``keys``
    (``--seed must be ...`` -> ``config file run.yaml: seed must be ...``)."""
    message = str(exc)
    for key in sorted(keys):
        flag = flag_name(key)
        if message.startswith(flag + " "):
            return ShoalError(f"{source}: {key}{message[len(flag):]}")
    return exc


def _config_file(path: str, flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``--config`` file's settings and strategy options, each value type-checked."""
    from shoal.config import TrainConfig
    from shoal.strategies import STRATEGIES, get_strategy, option_fields

    source = f"config file {path}"
    values = load_config_file(path)
    options = values.pop("strategy_options", None)
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ShoalError(f"{source}: strategy_options must be a mapping of options, "
                         f"got {show_value(options)}")
    options = {str(k).replace("-", "_"): v for k, v in options.items()}
    # A file may give strategy options at the top level, as the flags do.
    option_names = {f.name for cls in STRATEGIES.values() for f in option_fields(cls)}
    for key in [k for k in values if k in option_names]:
        options[key] = values.pop(key)
    TrainConfig.from_dict(values, source)  # unknown keys, types of the settings
    # The options' types, by the strategy that will take them (a flag may choose it).
    from_file = {k: v for k, v in options.items() if f"opt_{k}" not in flags}
    if from_file:
        strategy = flags.get("strategy", values.get("strategy", TrainConfig.strategy))
        hints = field_types(get_strategy(strategy).Options)
        for key, value in from_file.items():
            if key in hints:  # the ranges: make_options, then naming the file
                check_value(value, hints[key], f"{source}: {key}", bounds=False,
                            kind=field_kind(get_strategy(strategy).Options, key))
    return values, options


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON mapping of configuration keys (dashes or underscores)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ShoalError(f"config file {p} does not exist")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShoalError(f"config file {p}: cannot parse: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ShoalError(f"config file {p}: expected a mapping of keys to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
