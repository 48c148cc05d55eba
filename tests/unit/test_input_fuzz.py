"""Every input surface, fuzzed (hypothesis): prompts files (JSONL and plain text), SamplingParams
and EngineConfig through the Python API, and ``shardgen run``'s flags.

The property: a bad input is refused with a clear one-line error (``JobError`` with the exit code
of the README's table, or a ``ValueError`` naming the field), never another exception, a hang or
a traceback; a good one validates. ``make test`` runs a short profile; ``make fuzz`` sets
``SHARDGEN_FUZZ_PROFILE=fuzz`` for 10,000 examples per surface.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shardgen.config import EngineConfig, JobConfig, SamplingParams
from shardgen.errors import ExitCode, JobError
from shardgen.jobs.prompts import read_prompts

settings.register_profile(
    "test", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("SHARDGEN_FUZZ_PROFILE", "test"))

NUMBERS = st.one_of(
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.0, 1e-300, 1e300, float("nan"), float("inf"), -float("inf")]),
)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    NUMBERS,
    st.text(max_size=20),
    st.lists(st.one_of(st.text(max_size=5), st.integers(-5, 100)), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
SAMPLING_FIELDS = ["max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop",
                   "eos_token_id", "pad_token_id", "logprobs", "raw_logprobs"]  # fmt: skip
ENGINE_NUMERIC = ["max_batch_size", "stall_timeout", "init_timeout", "bucket_mb", "chunk_mb",
                  "burst_steps", "gil_switch_interval", "memory_budget_gb", "max_prefill_tokens"]  # fmt: skip
FIELD_NAMES = {f for f in SAMPLING_FIELDS if f in SamplingParams.__dataclass_fields__}
ENGINE_NAMES = [f for f in ENGINE_NUMERIC if f in EngineConfig.__dataclass_fields__]


def _named(msg: str, names) -> str:
    """The first of ``names`` a message names (the field an outcome event is counted under)."""
    named = [n for n in names if n in msg]
    return min(named, key=msg.find) if named else "?"


def _finite_numbers(obj: object) -> bool:
    return not isinstance(obj, float) or math.isfinite(obj)


@given(st.dictionaries(st.sampled_from(sorted(FIELD_NAMES)), VALUES, max_size=5))
def test_sampling_params_refuse_with_a_value_error_naming_the_field(kw):
    try:
        p = SamplingParams(**kw)
        p.validate()
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and any(name in msg for name in kw), (kw, msg)
        event(f"refused: ValueError naming {_named(msg, kw)}")  # the outcomes (--hypothesis-show-statistics)
        return
    event("accepted")
    r = p.resolved()  # accepted: every number it decodes with is finite and in range
    assert isinstance(r.max_new_tokens, int) and r.max_new_tokens >= 1, kw
    assert 0 < float(r.top_p) <= 1 and _finite_numbers(r.temperature), kw
    assert not r.do_sample or float(r.temperature) > 0, kw


@given(st.dictionaries(st.sampled_from(ENGINE_NAMES), NUMBERS, max_size=4))
def test_engine_config_refuses_with_a_value_error_naming_the_field(kw):
    try:
        EngineConfig(**kw).validate()
    except ValueError as e:
        assert any(name in str(e) for name in kw), (kw, str(e))
        event(f"refused: ValueError naming {_named(str(e), kw)}")
        return
    event("accepted")
    for name, v in kw.items():  # accepted: finite, so every wait has a bound
        assert _finite_numbers(v), (name, v)


LINE = st.one_of(
    st.dictionaries(
        st.sampled_from(
            [
                "id",
                "prompt",
                "temperature",
                "max_new_tokens",
                "top_p",
                "top_k",
                "seed",
                "stop",
                "eos_token_id",
                "temprature",
                "do_sample",
                "raw_logprobs",
            ]
        ),  # fmt: skip
        VALUES,
        max_size=5,
    ).map(lambda d: json.dumps(d, allow_nan=True)),
    st.text(max_size=40),  # not JSON, or plain-text prompts
    st.sampled_from(["", "{", "[]", "null", '{"prompt": "x"}', '{"id": 1, "prompt": "count :"}', "\ufeff"]),
)


def _surface(data: bytes, suffix: str) -> None:
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as f:
        f.write(data)
    try:
        cfg = JobConfig(prompts=f.name, out="o.jsonl")
        records = read_prompts(f.name, cfg, SamplingParams(), vocab_size=72)
    except JobError as e:
        assert e.code in (ExitCode.NO_PROMPTS, ExitCode.BAD_PROMPTS), (e.code, str(e))
        assert "\n" not in str(e) and str(e), repr(str(e))
        event(f"refused: exit {int(e.code)}")
        return
    finally:
        os.remove(f.name)
    assert records  # an accepted file has prompts, each with a validated request
    event("read")
    for rec in records:
        rec.params.validate()
        assert _finite_numbers(rec.params.temperature) and isinstance(rec.prompt, str)


@given(st.lists(LINE, min_size=0, max_size=6), st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_prompts_files_are_read_or_refused_with_exit_3_or_4(lines, newline, bom):
    data = ("\ufeff" if bom else "") + newline.join(lines) + newline
    _surface(data.encode("utf-8", "surrogatepass"), ".jsonl")


@given(st.binary(max_size=200), st.sampled_from([".jsonl", ".txt"]))
def test_random_bytes_are_read_or_refused_with_exit_3_or_4(data, suffix):
    _surface(data, suffix)


def test_nan_temperature_is_refused_not_decoded(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "count :"}\n{"id": 2, "prompt": "x", "temperature": NaN}\n')
    with pytest.raises(JobError) as e:
        read_prompts(str(path), JobConfig(prompts=str(path), out="o"), SamplingParams())
    assert e.value.code == ExitCode.BAD_PROMPTS and ":2:" in str(e.value) and "temperature" in str(e.value)


FLAGS = ["--temperature", "--max-new-tokens", "--top-k", "--top-p", "--batch-size", "--seed",
         "--max-batch-size", "--stall-timeout", "--backend", "--gather", "--dtype", "--claim-order",
         "--nproc", "--shard-size", "--log-level", "--temprature", "--bogus"]  # fmt: skip


FLAG_VALUES = st.one_of(NUMBERS.map(str), st.text(max_size=8))


@given(st.lists(st.tuples(st.sampled_from(FLAGS), FLAG_VALUES), max_size=4))
def test_run_flags_are_refused_with_exit_2_or_reach_the_prompts_file(pairs):
    from shardgen.cli.command import main

    argv = ["run", "--prompts", "/nonexistent/prompts.jsonl", "--out", "/tmp/shardgen-fuzz-out.jsonl"]
    for flag, value in pairs:
        argv += [flag, value]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: usage line + one error line
            code = e.code
    said = [x for x in err.getvalue().split("\n") if x.strip()]  # a value may hold a \r
    # 2: a bad flag or value; 3: every flag was fine and the (missing) prompts file is next
    assert code in (ExitCode.USAGE, ExitCode.NO_PROMPTS), (argv, code, said)
    assert said and "Traceback" not in err.getvalue(), (argv, said)
    assert any(x.startswith(("shardgen run: error:", "shardgen: error:")) for x in said), (argv, said)
    event(f"exit {int(code)}")
