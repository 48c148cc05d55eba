"""Tier 1: what shardgen prints: the log level and its controls, which ranks print, and the
third-party warnings silenced at shardgen's own calls only."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest

from shardgen import log

DEPRECATED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. "
    "Please use `torch.distributed.all_gather_single` instead."
)


def _record(rank: str, level: int, monkeypatch, everyone: bool = False) -> bool:
    monkeypatch.setenv("RANK", rank)
    if everyone:
        monkeypatch.setenv("SHARDGEN_LOG_ALL", "1")
    else:
        monkeypatch.delenv("SHARDGEN_LOG_ALL", raising=False)
    record = logging.LogRecord("shardgen", level, __file__, 1, "x", None, None)
    return log._RankFilter().filter(record)


def test_rank_0_prints_at_the_level_the_others_warnings_only(monkeypatch):
    assert _record("0", logging.INFO, monkeypatch)
    assert not _record("1", logging.INFO, monkeypatch)
    assert _record("1", logging.WARNING, monkeypatch)
    assert _record("3", logging.INFO, monkeypatch, everyone=True)


def test_level_from_the_environment(monkeypatch):
    monkeypatch.delenv("SHARDGEN_LOG_LEVEL", raising=False)
    assert log._env_level() == (logging.WARNING, None)  # like Hugging Face libraries: warnings
    monkeypatch.setenv("SHARDGEN_LOG_LEVEL", "INFO")
    assert log._env_level() == (logging.INFO, None)
    monkeypatch.setenv("SHARDGEN_LOG_LEVEL", "loud")
    level, complaint = log._env_level()
    assert level == logging.WARNING and "SHARDGEN_LOG_LEVEL='loud' is not a level" in complaint


def test_set_level_this_process_and_the_ranks_it_launches(monkeypatch):
    logger = log.get_logger()
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    monkeypatch.setenv("SHARDGEN_LOG_LEVEL", "warning")  # recorded: undone after the test
    log.set_level("ERROR")
    assert logger.level == logging.ERROR and os.environ["SHARDGEN_LOG_LEVEL"] == "error"
    with pytest.raises(ValueError, match="log level must be one of debug, info"):
        log.set_level("loud")


def test_the_library_logger_is_named_and_a_users_level_wins():
    """``logging.getLogger("shardgen").setLevel(...)`` before importing shardgen is kept."""
    code = (
        "import logging; logging.getLogger('shardgen').setLevel(logging.DEBUG)\n"
        "from shardgen.log import get_logger\n"
        "assert get_logger() is logging.getLogger('shardgen')\n"
        "get_logger().debug('said at debug')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDGEN_LOG", "RANK"))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "[shardgen rank 0] DEBUG said at debug\n", done.stderr


def _shown(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # a user's filter set before (or after) the engine started
        fn()
    return [str(w.message) for w in seen]


def test_the_gather_deprecation_is_silenced_inside_shardgen_calls_only():
    def inside():
        with log.quiet_deprecated_gathers():
            warnings.warn(DEPRECATED, FutureWarning, stacklevel=1)
            warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning, stacklevel=1)

    assert _shown(inside) == ["`torch.distributed.something_else` is deprecated."]  # narrow: that one only
    assert _shown(lambda: warnings.warn(DEPRECATED, FutureWarning, stacklevel=1)) == [DEPRECATED]  # outside

    def other_thread_meanwhile():  # a user thread (a training step) while the driver gathers
        entered, leave = threading.Event(), threading.Event()

        def driver():
            with log.quiet_deprecated_gathers():
                entered.set()
                leave.wait(10)

        t = threading.Thread(target=driver)
        t.start()
        entered.wait(10)
        warnings.warn(DEPRECATED, FutureWarning, stacklevel=1)
        leave.set()
        t.join(10)

    assert _shown(other_thread_meanwhile) == [DEPRECATED]


def test_no_global_filter_at_import():
    code = (
        "import warnings, shardgen, shardgen.cli.command, shardgen.backends.chunked\n"
        "assert not [f for f in warnings.filters if 'all_gather' in str(f[1])], warnings.filters\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_unsharded_load_does_not_say_shards(monkeypatch):
    import shardgen
    from shardgen.toy import toy_model_path

    logger = log.get_logger()
    monkeypatch.setattr(logger, "level", logging.INFO)
    seen = _Lines()
    logger.addHandler(seen)
    try:
        with shardgen.Engine.from_pretrained(toy_model_path(), backend="local") as engine:
            assert engine.generate(["count from 1 to 3 :"], max_new_tokens=8)[0].text == "1 2 3"
    finally:
        logger.removeHandler(seen)
    loaded = [x for x in seen.lines if x.startswith("loaded ")]
    assert len(loaded) == 1 and "unsharded (backend local)" in loaded[0] and "shards" not in loaded[0], loaded
