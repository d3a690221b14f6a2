"""``--config FILE.yaml``: a command's flags from a file, as vLLM's ``--config`` takes them.

Keys are the flag names (``block-size`` or ``block_size``); a flag given on the command line
wins over the file, and the file over the built-in defaults. An unknown key or a bad value is
a ConfigError naming the file, the key and the value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError, EngineConfig

# flags a file cannot set: what reads it, and what makes a command print instead of run
NOT_IN_FILES = frozenset({"config", "help", "print_config"})


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="flags from a YAML file (keys are flag names, e.g. block-size: 32); "
                             "a flag on the command line wins")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as YAML (for --config) and exit")


def file_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The file's settings as parsed values for ``parser``'s flags (argparse dests)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path!r} does not exist")
    import yaml

    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    actions = {option: action for action in parser._actions for option in action.option_strings}
    values: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(f"--{str(key).replace('_', '-')}")
        if action is None or action.dest in NOT_IN_FILES:
            known = sorted(o[2:] for o, a in actions.items() if o.startswith("--") and a.dest not in NOT_IN_FILES)
            raise ConfigError(f"{path}: unknown key {key!r} (this command takes: {', '.join(known)})")
        try:
            values[action.dest] = _convert(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ConfigError(f"{path}: key {key!r}: bad value {value!r}: {exc}") from None
    return values


def check_engine_values(path: str, from_file: dict[str, Any], model: str, engine: dict[str, Any]) -> None:
    """Validate the effective engine settings (``engine``: EngineConfig's keyword arguments)
    before anything loads; a bad value the file set is reported with the file and its key."""
    try:
        EngineConfig.from_settings(model=model, **engine)
    except ConfigError as exc:
        key = next((k for k in engine if str(exc).startswith(k) and k in from_file
                    and from_file[k] == engine[k]), None)
        if key is None:
            raise
        raise ConfigError(f"{path}: key {key.replace('_', '-')!r}: bad value {engine[key]!r}: {exc}") from None


def _convert(action: argparse.Action, value: Any) -> Any:
    """``value`` as the command line would have given it to ``action``."""
    if value is None:
        if action.default is not None:
            raise ValueError("null is only allowed where the flag has no default")
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return value
    if isinstance(value, dict):  # a JSON flag written as a YAML mapping (--speculative-config)
        value = json.dumps(value)
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item) for item in items]
    if isinstance(value, list):  # a comma-separated flag written as a YAML list (layer indices)
        value = ",".join(str(item) for item in value)
    return _one(action, value)


def _one(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a value, not true/false")
    converted = action.type(str(value)) if callable(action.type) else str(value)
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return converted


def effective_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Every flag of ``parser`` with its effective value, as YAML that --config reads back."""
    import yaml

    out: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_IN_FILES or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        name = next(o for o in action.option_strings if o.startswith("--"))[2:]
        out[name] = list(value) if isinstance(value, tuple) else value
    return str(yaml.safe_dump(out, sort_keys=False, default_flow_style=False))
