"""A module imported on first use instead of at `import` time, for the short-lived query commands.

indexcore's modules import numpy at the top for their batch paths (decoding windows, packing units,
truncating files); a query never runs those, yet numpy's import is most of a query's start-up. A query
process therefore puts a `DeferredModule` under numpy's name before it imports indexcore: `import numpy
as np` then binds the stand-in, and the first attribute looked up on it imports the real module and copies
its namespace in, so every later lookup is an ordinary module lookup. Mercurial's demandimport does the
same for its start-up. Single-threaded processes only: the query commands start no threads.
"""

from __future__ import annotations

import importlib
import sys
import types


class DeferredModule(types.ModuleType):
    """Stands in for a module in `sys.modules` until an attribute of it is first needed."""

    def __getattr__(self, attr: str):
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)
        self.__dict__.update(real.__dict__)
        return getattr(real, attr)


def defer(name: str) -> None:
    """Make the next imports of `name` bind a stand-in, unless the module is already loaded."""
    if name not in sys.modules:
        sys.modules[name] = DeferredModule(name)


__all__ = ["DeferredModule", "defer"]
