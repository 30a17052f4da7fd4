"""The per-forward caches hold under threads: two threads decoding at once each get the answer for their own mask.

Every layer of a forward gets the same mask (and ``position_ids``) object, so what is derived from it -- the lean
path's additive bias (:mod:`hf_qknorm.attention.lean`), whether packed sequences restart
(:mod:`hf_qknorm.portable.masks`) -- is kept in one module-level entry. A thread that checks that entry's key and then
reads its value in a second step can read another thread's value in between. Such a race is rare when left to the
scheduler, so the test makes it certain: one thread is stopped before each line of the package it runs in turn (a
trace function), the other thread runs a whole call with a different mask meanwhile, and the first thread's answer
must still be its own -- at every line, with the cache holding the first thread's entry beforehand or another one.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

import hf_qknorm
from hf_qknorm.attention import lean
from hf_qknorm.portable import masks

PACKAGE = os.path.dirname(hf_qknorm.__file__) + os.sep
MAX_LINES = 1000  # a call runs far fewer lines of the package; more means the stepping never ends
WAIT_S = 60


def _interleaved(first, second, line: int):
    """Run ``first()`` on a new thread stopped before its ``line``-th line of the package, ``second()`` on this one
    meanwhile, then let ``first`` finish. Returns both results, or ``None`` when ``first`` ran fewer lines."""
    stopped, ready, resume = threading.Event(), threading.Event(), threading.Event()
    results, seen = {}, [0]

    def step(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == line:
                stopped.set()
                ready.set()
                resume.wait(WAIT_S)
        return step

    def enter(frame, event, arg):
        return step if frame.f_code.co_filename.startswith(PACKAGE) else None

    def run():
        sys.settrace(enter)
        try:
            results["first"] = first()
        except BaseException as error:  # handed to the test's thread
            results["error"] = error
        finally:
            sys.settrace(None)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(WAIT_S), "the first thread neither stopped nor finished"
        if stopped.is_set():
            results["second"] = second()
    finally:
        resume.set()
        thread.join(WAIT_S)
    assert not thread.is_alive(), "the first thread did not finish"
    if "error" in results:
        raise results["error"]
    return (results["first"], results["second"]) if stopped.is_set() else None


def _check_every_line(first, second, warm_ups, same):
    """``first`` stopped at each of its lines in turn while ``second`` runs (:func:`_interleaved`), after each of
    ``warm_ups`` has set the cache; ``same(got, whose)`` says whether a result is ``whose``'s own answer."""
    for warm_up in warm_ups:
        for line in range(1, MAX_LINES):
            warm_up()
            got = _interleaved(first, second, line)
            if got is None:
                break
            mine, theirs = same(got[0], "first"), same(got[1], "second")
            assert theirs, f"the second thread got another answer (the first stopped at line {line})"
            assert mine, f"the first thread got the second's answer (stopped at line {line})"
        else:
            raise AssertionError(f"the first thread ran more than {MAX_LINES} lines")
        assert line > 2, "the first thread ran no line of the package: nothing was interleaved"


def test_lean_bias_is_each_threads_own():
    """Two threads in :func:`~hf_qknorm.attention.lean.lean_attention` with different masks (one hides keys) get the
    outputs they get alone, whichever line the first is stopped at."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((2, 4, 1, 8), (2, 2, 6, 8), (2, 2, 6, 8)))
    mine = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    theirs = mine.clone()
    theirs[..., 3:] = False
    other = mine.clone()

    def attend(mask):
        return lean.lean_attention(q, k, v, scaling=0.35, softcap=None, mask=mask, causal=False, sliding_window=None)

    alone = {"first": attend(mine), "second": attend(theirs)}
    assert not torch.equal(alone["first"], alone["second"])
    _check_every_line(
        lambda: attend(mine),
        lambda: attend(theirs),
        warm_ups=(lambda: attend(mine), lambda: attend(other)),  # the first thread's entry cached, or another
        same=lambda got, whose: torch.equal(got, alone[whose]),
    )


def test_restart_flag_is_each_threads_own():
    """Two threads in :func:`~hf_qknorm.portable.masks.packed_sequence_mask`, one with packed sequences (a mask) and
    one without (``None``), get the answers they get alone, whichever line the first is stopped at."""
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    plain = torch.arange(6)[None]
    other = packed.clone()

    def mask_of(position_ids):
        return masks.packed_sequence_mask(position_ids, 6, 6)

    alone = {"first": mask_of(packed), "second": mask_of(plain)}
    assert alone["first"] is not None and alone["second"] is None

    def same(got, whose):
        want = alone[whose]
        return got is None if want is None else got is not None and torch.equal(got, want)

    _check_every_line(
        lambda: mask_of(packed),
        lambda: mask_of(plain),
        warm_ups=(lambda: mask_of(packed), lambda: mask_of(other)),
        same=same,
    )
