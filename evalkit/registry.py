"""One registry type for policies and tasks: by name, with aliases and "did you mean" hints."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

from evalkit.errors import EvalkitError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, explain_unknown: Callable[[str], str | None] = lambda name: None):
        self.kind = kind
        self.explain_unknown = explain_unknown  # a one-line reason for an unknown name, or None
        self._entries: dict[str, Callable[[], T]] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, factory: Callable[[], T], aliases: tuple[str, ...] = ()) -> None:
        for key in (name, *aliases):
            if key in self._entries or key in self._aliases:
                raise ValueError(f"{self.kind} {key!r} is registered twice")
        self._entries[name] = factory
        self._aliases.update({alias: name for alias in aliases})

    def names(self) -> list[str]:
        return sorted(self._entries)

    def aliases_of(self, name: str) -> list[str]:
        return sorted(alias for alias, target in self._aliases.items() if target == name)

    def canonical(self, name: str) -> str:
        name = self._aliases.get(name, name)
        if name not in self._entries:
            if (reason := self.explain_unknown(name)) is not None:
                raise EvalkitError(reason)
            known = [*self._entries, *self._aliases]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise EvalkitError(f"unknown {self.kind} {name!r}{hint}; known: {', '.join(self.names())}")
        return name

    def create(self, name: str) -> T:
        return self._entries[self.canonical(name)]()
