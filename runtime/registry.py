"""`Registry`: objects by name, the way drafter kinds are kept (`runtime.draft_spec` for the runtime's share of a kind,
`builder.drafters` for the builder's): the built-in ones, each the `KIND` of a module named in `modules`, imported by
name on the first lookup (not when the registry's own module is imported, so a kind module may import the registry's);
then those `register`ed by modules outside that list, which the caller imports."""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Generic, Protocol, TypeVar

from runtime.errors import ConfigError


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    def __init__(self, what: str, kind: type, modules: tuple[str, ...]) -> None:
        self.what = what  # for errors: "drafter kind"
        self.kind = kind  # the class every entry is an instance of
        self.modules = modules
        self._registered: dict[str, T] = {}
        self._lock = threading.Lock()

    @functools.cached_property
    def _builtin(self) -> dict[str, T]:
        found = (importlib.import_module(module).KIND for module in self.modules)
        return {entry.name: entry for entry in found}

    def get(self, name: str) -> T | None:
        return self._builtin.get(name) or self._registered.get(name)

    def all(self) -> tuple[T, ...]:
        """The built-in entries in `modules`' order, then those registered, in the order they were."""
        return (*self._builtin.values(), *self._registered.values())

    def register(self, entry: T) -> T:
        """Add `entry` under its name; the same object again is a no-op, another one under a taken name an error."""
        if not isinstance(entry, self.kind):
            raise TypeError(f"expected a {self.kind.__name__}, got {entry!r}")
        with self._lock:
            known = self.get(entry.name)
            if known is not None and known is not entry:
                raise ConfigError(f"a {self.what} named {entry.name!r} is already registered")
            self._registered[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove an entry `register` added (the built-in ones stay)."""
        with self._lock:
            self._registered.pop(name, None)


__all__ = ["Named", "Registry"]
