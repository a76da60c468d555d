"""Pass options: each pass declares the settings it reads, and they are resolved once per pipeline.

A pass lists its `options` (name, type, default, doc) as a class attribute; the manager declares
its own (`MANAGER_OPTIONS`). `resolve()` merges, in order, every declared default, the target's
`[passes]` table and the caller's `pass_options=`, checks each value against its declaration,
and refuses a key no pass declares (naming the known ones), so a misspelt option is an error
instead of a silent default. Passes read the result from `PassContext.options`; the pass
manager hashes it into its uuid, and `metainfer passes` lists the declarations.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


class OptionError(ValueError):
    """An unknown pass option, or a value its declaration does not allow."""


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Option:
    """One setting a pass reads. `default` None means "the pass decides" (it is always
    allowed); `choices` restricts the values; `minimum` bounds a number from below."""

    name: str
    kind: type
    default: Any
    doc: str
    choices: tuple = ()
    minimum: float | None = None

    def check(self, value: Any, source: str) -> Any:
        """`value` as the pass reads it, or OptionError naming `source` and what is allowed."""
        if value is None and self.default is None:
            return None
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind in (int, float):
            ok = isinstance(value, (int, float) if self.kind is float else int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.kind)
        if ok and self.choices and value not in self.choices:
            raise OptionError(f"{source}: {self.name} must be one of {self.choices}, got {value!r}")
        if not ok or (self.minimum is not None and value < self.minimum):
            bound = f" of at least {self.minimum:g}" if self.minimum is not None else ""
            what = ("a non-negative number" if self.kind in (int, float) and self.minimum == 0
                    else f"{_KIND_WORDS.get(self.kind, self.kind.__name__)}{bound}")
            raise OptionError(f"{source}: {self.name} must be {what}{' (or unset)' if self.default is None else ''}, "
                              f"got {value!r}")
        return float(value) if self.kind is float else value

    def describe(self) -> str:
        allowed = f" {'|'.join(map(str, self.choices))}" if self.choices else ""
        default = "unset" if self.default is None else repr(self.default)
        return f"{self.name} ({self.kind.__name__}{allowed}, default {default}): {self.doc}"


MANAGER_OPTIONS = (
    Option("cost_gates", bool, True,
           "keep a cost-gated pass's rewrite only where the cost model predicts the graph no slower "
           "(false: always keep it, to measure what the gate decided)"),
)


def declared(passes: Iterable = ()) -> dict[str, tuple[Option, str]]:
    """name -> (declaration, owner) over every registered pass, `passes` (which may hold
    unregistered ones) and the manager."""
    from .base import registered_classes

    out: dict[str, tuple[Option, str]] = {o.name: (o, "the pass manager") for o in MANAGER_OPTIONS}
    for p in [*registered_classes(), *passes]:
        for o in getattr(p, "options", ()):
            seen = out.get(o.name)
            if seen is not None and seen[0] != o:
                raise OptionError(f"pass option {o.name!r} is declared twice, differently: by {seen[1]} and {p.name}")
            out[o.name] = (o, p.name)
    return out


def resolve(target, given: Mapping[str, Any] | None, passes: Iterable = ()) -> Mapping[str, Any]:
    """Every declared option's value for a pipeline: its default, then `target`'s [passes]
    table, then `given` (optimize's pass_options=); read-only."""
    known = declared(passes)
    values = {name: option.default for name, (option, _) in known.items()}
    for source, table in ((f"target {target.name!r} [passes]", target.pass_options), ("pass_options", given or {})):
        if not isinstance(table, Mapping):
            raise OptionError(f"{source} must be a table of option names to values, not {type(table).__name__}")
        for key, value in table.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                listing = ", ".join(f"{n} ({owner})" for n, (_, owner) in sorted(known.items()))
                raise OptionError(f"{source}: unknown pass option {key!r}{hint}; known: {listing}")
            values[key] = known[key][0].check(value, source)
    return MappingProxyType(values)
