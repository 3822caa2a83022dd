"""Named registries for methods, datasets, partitioners, mechanisms and models."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Callable, Generic, Iterable, Iterator, TypeVar

from raysim.errors import ConfigError, shown

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object table whose lookups fail with the list of valid names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            key = name.lower()
            if key in self._items and self._items[key] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[key] = obj
            return obj

        return deco

    def add(self, obj: T) -> T:
        """Register a class under its own `name` attribute (methods, mechanisms, protocols); returns it,
        so it serves as a class decorator."""
        name = getattr(obj, "name", "")
        if not name:
            raise ValueError(f"{obj!r} needs a name to be registered as a {self.kind}")
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        key = str(name).lower()
        if key not in self._items:
            hint = difflib.get_close_matches(key[:100], self._items, n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"unknown {self.kind} {shown(name)}.{extra} Valid choices: {', '.join(sorted(self._items))}."
            )
        return self._items[key]

    def __contains__(self, name: object) -> bool:
        return str(name).lower() in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)


_IMPORTED: dict[str, list[str]] = {}


def import_all(path: Iterable[str], prefix: str, *, recursive: bool = False, skip: tuple[str, ...] = ()) -> list[str]:
    """Import every module of a plug-in package once (`import_all(__path__, __name__)` in its __init__), so
    each module's decorators register what it defines; returns the modules' names. A new plug-in is then one
    new file: nothing lists the modules by hand. `skip`: module names (without the prefix) that register nothing."""
    if prefix not in _IMPORTED:
        walk = pkgutil.walk_packages if recursive else pkgutil.iter_modules
        names = [info.name for info in walk(list(path), prefix=prefix + ".") if info.name.rpartition(".")[2] not in skip]
        _IMPORTED[prefix] = names  # before importing: a module that imports its package back sees the walk as done
        for name in names:
            importlib.import_module(name)
    return _IMPORTED[prefix]
