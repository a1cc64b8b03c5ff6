"""Module attributes imported on first use, so `import wde` (and the CLI's fast commands) never pull in torch."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(module: str, table: dict[str, str], hint: str = "") -> tuple[Callable[[str], Any],
                                                                              Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `module`, whose public names live in the modules `table` maps them to."""

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}{hint}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(table))

    return __getattr__, __dir__
