"""Loading configs: YAML files and dotted overrides onto the schema (`rl.config.schema`).

Strictness is the point: an unknown key, a wrong type or an out-of-range value raises
`ConfigError` naming `file:key`, the offending value and what was expected. Command-line
overrides use dotted keys (`trainer.lr=1e-6`); their values are parsed as YAML scalars.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from rl.config.schema import Config, ConfigError, FieldError, to_dict


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class _Mismatch(Exception):
    pass


def _convert(value: Any, tp: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(tp, value, where, key)  # type: ignore[arg-type]  # lint baseline (issue 39)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, where, key)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        k_tp, v_tp = typing.get_args(tp)
        return {_convert(k, k_tp, where, key): _convert(v, v_tp, where, f"{key}.{k}")
                for k, v in value.items()}
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `1e-6` (no dot) as a string; accept what is plainly a number.
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"unsupported config type {tp!r} at {key}")


# Keys that moved: an old config gets one line saying where, instead of "unknown key".
MOVED_KEYS = {"plan.kv_cache_dtype": "rollout.kv_cache_dtype",
              **{f"plan.{k}": f"trainer.{k}" for k in (
                  "activation_checkpointing", "optimizer_offload", "param_offload", "nvme_path",
                  "attention_kernel")}}


def _build(cls: type, data: dict, where: "str | typing.Callable[[str], str]",
           prefix: str = "") -> Any:
    """`where`: the source named in errors, or a function from a dotted key to its source."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names and full in MOVED_KEYS:
            raise ConfigError(f"{_source(where, full)}:{full}: this key moved to "
                              f"{MOVED_KEYS[full]} (same values)")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{_source(where, full)}:{full}: unknown key{hint}; valid keys: "
                              f"{', '.join(names)}")
        try:
            kwargs[key] = _convert(value, hints[key], where, full)  # type: ignore[arg-type]  # lint baseline (issue 39)
        except _Mismatch:
            raise ConfigError(f"{_source(where, full)}:{full}: got {value!r}, expected "
                              f"{_type_name(hints[key])}") from None
    try:
        return cls(**kwargs)
    except FieldError as e:
        full = f"{prefix}.{e.key}" if prefix else e.key
        raise ConfigError(f"{_source(where, full)}:{full}: got {e.value!r}, expected "
                          f"{e.expected}") from None


def _source(where: "str | typing.Callable[[str], str]", key: str) -> str:
    return where(key) if callable(where) else where


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> dict:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}; the value is parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"<command line>:{text}: expected an override of the form key.sub=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"<command line>:{key}: malformed key in override {text!r}")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _leaves(data: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.extend(_leaves(v, key) if isinstance(v, dict) and v else [key])
    return out


def _read_yaml(path: str | Path) -> dict:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x}); expected a "
                          "UTF-8 YAML file") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""  # type: ignore[assignment]  # lint baseline (issue 39)
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(paths: str | Path | typing.Sequence[str | Path] | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load one YAML file or several layered ones (later files win), apply the dotted
    `overrides` (they win over every file), then validate the result once, so cross-field
    checks see the final values whatever the order of the overrides. Raises ConfigError naming
    the file (or `<command line>`) that set the offending key last."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    data: dict = {}
    origin: dict[str, tuple[int, str]] = {}  # dotted key -> (layer, file or "<command line>")
    layers = [(str(p), _read_yaml(p)) for p in paths]
    layers += [("<command line>", parse_override(text)) for text in overrides]
    for n, (source, layer) in enumerate(layers):
        data = _merge(data, layer)
        origin.update({key: (n, source) for key in _leaves(layer)})
    fallback = str(paths[-1]) if paths else "<defaults>"

    def where(key: str) -> str:
        # The key itself, or the nearest enclosing key a layer set (a whole mapping replaced).
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in origin:
                return origin[".".join(parts[:n])][1]
        # A cross-field check names a key nobody set (`data.train_path` when `data.source` is
        # `file`): blame the latest layer that set a key beside it.
        for n in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:n])
            near = [v for k, v in origin.items() if not prefix or k.startswith(prefix + ".")]
            if near:
                return max(near)[1]
        return fallback

    return _build(Config, data, where)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
