"""JSON and TOML documents that come from outside (a trace's metadata, the health
documents `fleet` merges, the health config), parsed with their nesting bounded.

Python's parsers recurse once per level of nesting: a document nested a few thousand
deep is a RecursionError inside the parser, and one nested a few hundred deep parses but
breaks whatever walks it later (repr in an error message, json.dumps).  trainbpf's own
documents nest at most six deep."""

from __future__ import annotations

import json
import tomllib
from typing import Any, Callable

MAX_DEPTH = 64


class TooDeep(ValueError):
    """A document nested deeper than MAX_DEPTH (a ValueError, as the parsers' own errors)."""

    def __init__(self) -> None:
        super().__init__(f"nested deeper than {MAX_DEPTH} levels")


def load_json(data: str | bytes) -> Any:
    """json.loads, or ValueError: not JSON, or nested deeper than MAX_DEPTH (TooDeep)."""
    return _bounded(json.loads, data)


def load_toml(text: str) -> dict[str, Any]:
    """tomllib.loads, or ValueError: not TOML (TOMLDecodeError), or too deep (TooDeep)."""
    return _bounded(tomllib.loads, text)


def _bounded(parse: Callable[[Any], Any], data: Any) -> Any:
    try:
        value = parse(data)
    except RecursionError:  # the parser ran out of stack: far deeper than MAX_DEPTH
        raise TooDeep() from None
    if nesting(value) > MAX_DEPTH:
        raise TooDeep()
    return value


def nesting(value: Any) -> int:
    """How deep lists and dicts nest in `value` (a scalar: 0), walked without recursion."""
    deepest = 0
    todo = [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:  # deep enough to refuse: no need to walk the rest
            return level
        todo.extend((child, level + 1) for child in children)
    return deepest
