"""Globals an unpickler hands a file, made so that pickle's BUILD on them fails.

A BUILD sets attributes on whatever object is on the stack. On an object the
file made, that is how pickle restores it; on a global (a class, a function,
an object shared by every load) it would change the process: the next file's
dtypes, the paths ``convert`` writes to. Builtin types, builtin functions and
dtypes already refuse attribute writes; what the unpicklers hand out besides
is wrapped here.
"""

from __future__ import annotations

from typing import Any, Callable


class Unchangeable:
    """Refuses every attribute write and delete after construction."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} cannot be changed")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} cannot be changed")


class Sealed(type):
    """The metaclass of record classes a file instantiates (NEWOBJ needs a class): the class itself refuses
    attribute writes; its instances, the file's own objects, take their fields as usual."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"class {cls.__name__} cannot be changed")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"class {cls.__name__} cannot be changed")


def sealed_call(target: Callable[..., Any]) -> Unchangeable:
    """A Python function or class, callable as it (pickle's REDUCE), unchangeable unlike it.

    Its class, made for it and sealed, holds ``target`` as its ``__call__``,
    so a call costs no extra Python frame (the tensor rebuilds run once per
    tensor).
    """
    kind = Sealed(f"Sealed_{getattr(target, '__name__', 'call')}", (Unchangeable,),
                  {"__slots__": (), "__call__": staticmethod(target)})
    return kind()
