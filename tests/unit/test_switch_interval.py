"""The GIL switch interval while engines are open (``core/process.py``): lowered while any open
engine may run a forward, the interpreter's own while every open one is paused or none is open.
Pure unit tests (stand-in drivers); tests/helpers/engine_scenarios.py ``spinner`` checks a real engine."""

from __future__ import annotations

import sys

import pytest

from shardgen.core import process


class _Driver:
    """What ``process`` keeps of a driver: a weak reference."""


@pytest.fixture
def saved_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_lowered_unless_every_open_engine_is_paused(saved_interval):
    a, b = _Driver(), _Driver()
    process.opened(a, 0.0002)
    process.opened(b, 0.001)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0002, abs=1e-9)  # the lowest of the running ones
        process.paused(a, True)
        assert sys.getswitchinterval() == pytest.approx(0.001, abs=1e-9)  # b may still run forwards
        process.paused(b, True)
        assert sys.getswitchinterval() == pytest.approx(saved_interval, abs=1e-9)  # nobody to pace
        process.paused(a, False)
        assert sys.getswitchinterval() == pytest.approx(0.0002, abs=1e-9)
        process.closed(a)
        assert sys.getswitchinterval() == pytest.approx(saved_interval, abs=1e-9)  # b is still paused
        process.paused(b, False)
        assert sys.getswitchinterval() == pytest.approx(0.001, abs=1e-9)
    finally:
        process.closed(a)
        process.closed(b)
    assert sys.getswitchinterval() == pytest.approx(saved_interval, abs=1e-9)  # the last close restores it


def test_an_engine_that_leaves_the_interval_alone(saved_interval):
    a = _Driver()
    process.opened(a, None)
    try:
        assert sys.getswitchinterval() == pytest.approx(saved_interval, abs=1e-9)
        process.paused(a, True)
        process.paused(a, False)
        assert sys.getswitchinterval() == pytest.approx(saved_interval, abs=1e-9)
    finally:
        process.closed(a)
    assert sys.getswitchinterval() == pytest.approx(saved_interval, abs=1e-9)
