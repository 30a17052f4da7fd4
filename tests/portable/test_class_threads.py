"""Two threads patching models of one family at once get the same patched classes (hooks.attention_class and
hooks.projection_class make each once, under a lock)."""

from __future__ import annotations

import threading
import time

import pytest
from torch import nn

from hf_qknorm.portable import hooks


def _slow_to_subclass(name: str) -> type:
    """A fresh module class whose subclasses take a while to make: a thread that made one hands the interpreter to
    the other in the middle, where an unlocked check-then-store lets both make their own."""

    def init_subclass(cls, **kwargs):
        time.sleep(0.05)

    return type(name, (nn.Module,), {"__init_subclass__": classmethod(init_subclass)})


@pytest.mark.parametrize("maker", ["attention", "capped attention", "projection"])
def test_threads_get_one_patched_class(maker):
    base = _slow_to_subclass(f"Slow{maker.title().replace(' ', '')}ForThreads")
    make = {
        "attention": lambda: hooks.attention_class(base, capped=False),
        "capped attention": lambda: hooks.attention_class(base, capped=True),
        "projection": lambda: hooks.projection_class(base),
    }[maker]
    start, got = threading.Barrier(4), []

    def run():
        start.wait()
        got.append(make())

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(cls is got[0] for cls in got), got
    assert make() is got[0] and issubclass(got[0], base)
