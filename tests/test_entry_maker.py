"""Entries made by writing their slots (``store/_centry.pyx``) are the objects ``Entry`` makes."""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from typing import Any

import numpy as np
import pytest

from aioparamsync import sgd
from aioparamsync.store import table
from aioparamsync.store.table import Entry, ParameterTable
from aioparamsync.values.arrays import to_parameter

pytestmark = pytest.mark.skipif(table._centry is None, reason="the compiled path is not built")


class Held:
    """A rule-like object that can hold the entry holding it (a cycle), and be watched."""

    def __init__(self) -> None:
        self.entry: Any = None


def values() -> list[tuple[Any, ...]]:
    data = memoryview(np.arange(6, dtype=np.float32).tobytes())
    array = np.frombuffer(data, np.float32)
    return [
        ("w", data, 3, "<f4", (6,), "n1@1"),
        ("w", data, 3, "<f4", (2, 3), "n1@1", sgd(0.1), array),
        ("bytes", memoryview(b""), 0, None, None, "n2@5", None, None),
        ("ünï\x00#1", data, 2**31 - 1, "<f4", (), "", Held(), None),
    ]


@pytest.mark.parametrize("args", values(), ids=["plain", "rule-array", "bytes", "odd"])
def test_a_made_entry_is_the_one_its_class_makes(args: tuple[Any, ...]) -> None:
    made, made_by_class = table._MAKE_ENTRY(*args), Entry(*args)
    assert type(made) is Entry
    assert made == made_by_class and hash(made) == hash(made_by_class)
    for f in dataclasses.fields(Entry):
        assert getattr(made, f.name) is getattr(made_by_class, f.name), f.name
    assert repr(made) == repr(made_by_class)
    assert made.nbytes == made_by_class.nbytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.version = 4  # type: ignore[misc]


def test_a_made_entry_holds_one_reference_to_each_value_and_lets_them_go() -> None:
    # (strings made here, not constants: "n" + "ame" is folded to "name", interned, and
    # another thread's references to it changed its count under the test)
    name, data, origin = "".join(("n", "ame")), memoryview(b"xyz"), "".join(("o", "rigin"))

    def counts() -> list[int]:
        return [sys.getrefcount(name), sys.getrefcount(data), sys.getrefcount(origin)]

    before = counts()
    made = [table._MAKE_ENTRY(name, data, 7, "<f4", (3,), origin) for _ in range(100)]
    assert [n - b for n, b in zip(counts(), before, strict=True)] == [100] * 3
    del made
    assert counts() == before


def test_a_made_entry_in_a_cycle_is_collected() -> None:
    held = Held()
    held.entry = table._MAKE_ENTRY("w", memoryview(b""), 1, None, None, "o", held)
    watched = weakref.ref(held)
    del held
    gc.collect()
    assert watched() is None


def test_a_push_folded_compiled_stores_entries_of_the_class() -> None:
    store = ParameterTable("n1@1")
    w = np.ones(1024, np.float32)
    p = to_parameter("w", w)
    p.rule = sgd(0.5)
    store.apply([p], 1)
    applied = store.fold([to_parameter("w", np.full(1024, 2, np.float32))], 2)
    (entry,) = applied.entries
    assert type(entry) is Entry and entry.version == 2 and entry.shape == (1024,)
    assert np.array_equal(np.frombuffer(entry.data, np.float32), w - 1.0)
    assert store.entry("w") is entry


@dataclasses.dataclass(frozen=True, slots=True)
class OtherSlots:
    name: str


class WithDict(Entry):  # (Entry's slots, and a __dict__)
    pass


class WithNew(Entry):
    __slots__ = ()

    def __new__(cls, *args: Any) -> WithNew:
        return super().__new__(cls)


@pytest.mark.parametrize("cls", [OtherSlots, WithDict, WithNew, dict, "Entry", Entry(
    "w", memoryview(b""), 1, None, None, "o")], ids=["other-slots", "dict", "new", "builtin",
    "str", "instance"])  # fmt: skip
def test_a_maker_refuses_a_class_it_cannot_make_objects_of(cls: Any) -> None:
    with pytest.raises(TypeError):
        table._centry.EntryMaker(cls)
