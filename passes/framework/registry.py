"""Pass registry and the pipeline text format.

A pipeline is written as MLIR writes one: pass names separated by commas, options in
braces, e.g. ``lift-state{beam=keep},fuse-kvcache{beam=indirect},lower-kvcache``.
Option values are parsed by the type of the option's default (bool: true/false, int,
str; tuples as colon-separated lists: ``variants=256:512``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvc.errors import UsageError
from kvc.passes.framework.base import Pass

_REGISTRY: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", cls.name or ""):
        raise ValueError(f"pass name {cls.name!r} must be kebab-case")
    if cls.name in _REGISTRY:
        raise ValueError(f"pass {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Pass]]:
    from kvc.passes import load_all

    load_all()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str, **options: Any) -> Pass:
    passes = registered()
    if name not in passes:
        raise UsageError(f"unknown pass {name!r}; registered passes: {', '.join(passes)}")
    cls = passes[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in options.items():
        if key not in fields:
            raise UsageError(f"pass {name} has no option {key!r}; options: {', '.join(fields) or 'none'}")
        choices = fields[key].metadata.get("choices")
        if choices and value not in choices:
            raise UsageError(f"pass {name}: option {key}={value!r} must be one of {', '.join(map(str, choices))}")
    return cls(**options)


def option_info(cls: type[Pass]) -> list[dict]:
    """Each option of a pass: name, default, allowed values and help."""
    return [{"name": f.name, "default": f.default, "choices": f.metadata.get("choices"),
             "help": f.metadata.get("help", "")} for f in dataclasses.fields(cls)]


def _parse_value(text: str, default: Any, where: str) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise UsageError(f"{where}: expected true or false, found {text!r}")
        return text.lower() in ("true", "1", "yes")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"{where}: expected an integer, found {text!r}") from None
    if isinstance(default, tuple):
        try:
            return tuple(int(x) for x in text.split(":") if x)
        except ValueError:
            raise UsageError(f"{where}: expected integers separated by ':', found {text!r}") from None
    return text


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise UsageError(f"unbalanced '}}' in pipeline {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise UsageError(f"unbalanced '{{' in pipeline {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_pipeline(text: str) -> list[Pass]:
    """`lift-state{beam=keep},fuse-kvcache` -> [LiftState(beam='keep'), FuseKVCache()]."""
    passes = []
    for item in _split_top(text):
        m = re.fullmatch(r"([a-z0-9-]+)\s*(?:\{(.*)\})?", item, re.S)
        if not m:
            raise UsageError(f"cannot parse pipeline element {item!r}: expected name or name{{opt=value,...}}")
        name, body = m.group(1), m.group(2)
        cls = registered().get(name)
        if cls is None:
            raise UsageError(f"unknown pass {name!r}; registered passes: {', '.join(registered())}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        options = {}
        for assignment in filter(None, (a.strip() for a in (body or "").split(","))):
            key, sep, value = assignment.partition("=")
            key = key.strip()
            if not sep:
                raise UsageError(f"pass {name}: option {assignment!r} needs a value (key=value)")
            if key not in defaults:
                raise UsageError(f"pass {name} has no option {key!r}; options: {', '.join(defaults) or 'none'}")
            options[key] = _parse_value(value.strip(), defaults[key], f"pass {name} option {key}")
        passes.append(get_pass(name, **options))
    return passes


def format_pipeline(passes: list[Pass]) -> str:
    return ",".join(p.spec() for p in passes)


def declared(cls, which: str) -> tuple[str, ...]:
    """A pass's invariants (`which`: "requires" or "ensures") as its class declares them, or
    those of its default options where they follow the options (static-shape's rows=dynamic
    ensures static-but-rows, not static)."""
    value = getattr(cls, which)
    return getattr(cls(), which) if isinstance(value, property) else value
