"""Prompts files: read one, check every line, and turn each into a validated ``SamplingParams``.

A prompts file is JSONL (one object a line: ``id``, ``prompt`` and optional generation fields
named like the ``SamplingParams`` fields) or plain text (one prompt a line; the ids are the line
numbers). Each line becomes a :class:`PromptRecord` whose ``params`` is the request's final
``SamplingParams`` (job flags, then the line's own fields), built and validated here once, by
``SamplingParams.replace`` and ``SamplingParams.problems``; the rest of the job passes that
object on unchanged. Bad lines raise ``JobError(BAD_PROMPTS)`` naming each (up to 20) by
``file:line`` with every problem of that line (an unknown field with the nearest known one).
Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

from shardgen.config import TEMPERATURE, JobConfig, SamplingParams
from shardgen.errors import ExitCode, JobError
from shardgen.jobs.journal import id_key
from shardgen.suggest import did_you_mean

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
ID_FIELDS = ("id", "prompt")


@dataclass
class PromptRecord:
    """One validated prompt line."""

    id: str | int
    prompt: str
    params: SamplingParams
    """The request's settings: job flags, then the line's own fields (validated)."""
    line: int


def read_prompts(
    path: str,
    cfg: JobConfig | None = None,
    base: SamplingParams | None = None,
    *,
    vocab_size: int | None = None,
) -> list[PromptRecord]:
    """Read and validate the whole prompts file; raise ``JobError`` naming each bad ``file:line``.

    ``cfg`` gives the job's ``temperature`` and ``seed`` (default: greedy, seed 0), ``base`` the
    job's sampling flags (default: ``SamplingParams()``), ``vocab_size`` the model's vocabulary
    (when known, a line's ``eos_token_id`` / ``pad_token_id`` must lie in it). Blank lines are
    skipped. A file is JSONL when its name ends in .jsonl/.ndjson/.json or its first non-blank
    line starts with ``{``; otherwise each line is one prompt. The error names every bad line
    (``bad_lines_message``) and every problem of each.
    """
    temperature, seed = (cfg.temperature, cfg.seed) if cfg is not None else (None, 0)
    base = base if base is not None else SamplingParams()
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise JobError(ExitCode.NO_PROMPTS, f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(ExitCode.NO_PROMPTS, f"cannot read prompts file {path}: {e}") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise JobError(ExitCode.NO_PROMPTS, f"prompts file is empty: {path}")
    is_jsonl = path.endswith(JSONL_SUFFIXES) or numbered[0][1].lstrip().startswith("{")
    seen: dict[str, int] = {}
    out: list[PromptRecord] = []
    bad: list[str] = []  # every bad line's message, to name them all at once
    for n, line in numbered:
        if is_jsonl:
            rid, prompt, options, problems = _parse_line(line, n, seen)
        else:
            rid, prompt, options, problems = n, line, {}, []
        params = None
        if rid is not None:
            try:
                params = request_params(
                    base, options, rid, temperature=temperature, seed=seed, vocab_size=vocab_size
                )
            except ValueError as e:
                problems.append(str(e))
        if problems:
            bad.append(f"{path}:{n}: {'; '.join(problems)}")
            continue
        assert params is not None and prompt is not None
        out.append(PromptRecord(id=rid, prompt=prompt, params=params, line=n))
    if bad:
        raise JobError(ExitCode.BAD_PROMPTS, bad_lines_message(bad))
    return out


#: How many bad lines a prompts file's error names (then "and N more").
MAX_BAD_LINES = 20


def bad_lines_message(bad: list[str]) -> str:
    """One line naming each bad line (``file:line: problems``), the first ``MAX_BAD_LINES`` of
    them: a file with many is fixed in one pass, not one line per run."""
    if len(bad) == 1:
        return bad[0]
    shown = " | ".join(bad[:MAX_BAD_LINES])
    more = f" | and {len(bad) - MAX_BAD_LINES} more" if len(bad) > MAX_BAD_LINES else ""
    return f"{len(bad)} bad lines: {shown}{more}"


def _parse_line(
    line: str, n: int, seen: dict[str, int]
) -> tuple[str | int | None, str | None, dict, list[str]]:
    """(id, prompt, generation fields, problems) of one JSONL line, its JSON types checked.

    Every problem of the line is listed; the fields with a problem are left out of the options.
    The id is None when the line has no object to read one from.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, None, {}, [f"malformed JSON: {e.msg} (column {e.colno})"]
    if not isinstance(obj, dict):
        return None, None, {}, [f"expected a JSON object, got {_json_type(obj)}"]
    problems = []
    hints = typing.get_type_hints(SamplingParams)
    allowed = set(ID_FIELDS) | set(hints)
    unknown = sorted(set(obj) - allowed)
    if unknown:
        named = ", ".join(f"{k!r}{did_you_mean(k, allowed)}" for k in unknown)
        problems.append(f"unknown field(s) {named} (allowed: {', '.join(sorted(allowed))})")
    if "prompt" not in obj:
        problems.append("missing 'prompt'")
    elif not isinstance(obj["prompt"], str):
        problems.append(f"'prompt' must be a string, got {_json_type(obj['prompt'])}")
    rid = obj.get("id", n)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        problems.append(f"'id' must be a string or an integer, got {_json_type(rid)}")
        rid = n
    else:
        key = id_key(rid)
        if key in seen:
            problems.append(f"duplicate id {rid!r} (first on line {seen[key]})")
        else:
            seen[key] = n
    options = {}
    for name, value in obj.items():  # JSON types only; the values are SamplingParams' to judge
        if name in ID_FIELDS or name not in hints:
            continue
        if _type_ok(value, hints[name]):
            options[name] = value
        else:
            problems.append(f"field {name!r} must be {_type_name(hints[name])}, got {_json_type(value)}")
    prompt = obj.get("prompt") if isinstance(obj.get("prompt"), str) else None
    return rid, prompt, options, problems


def request_params(
    base: SamplingParams,
    options: dict[str, Any],
    rid: str | int,
    *,
    temperature: float | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> SamplingParams:
    """A request's SamplingParams: the job's (``base``, ``temperature``, ``seed``), then ``options``.

    As with ``--temperature``, a ``temperature`` > 0 means sampling and 0 greedy, unless the line
    sets ``do_sample`` itself; with neither, the model's ``generation_config`` decides. A request
    that may sample and has no ``seed`` gets :func:`derive_seed` (unused if it turns out greedy).
    Raises ``ValueError`` naming every invalid setting (``SamplingParams.problems``, and the EOS
    and pad ids against ``vocab_size`` when given).
    """
    opts = dict(options)
    temperature = opts.pop("temperature", temperature)
    # The line's temperature is judged as given, by the rule every door applies (-1 is refused
    # here as by the API and --temperature, not taken for greedy); then 0 means greedy.
    said = TEMPERATURE.problem("temperature", temperature)
    early = [] if said is None else [said]
    if early:
        temperature = None  # named above; the line's other fields are still judged below
    do_sample = opts.pop("do_sample", None if temperature is None else temperature > 0)
    if temperature is not None and temperature <= 0 and not do_sample:
        temperature = None  # greedy: no temperature applies (sampling at 0 fails validation)
    params = base.replace(**opts, do_sample=do_sample, temperature=temperature)
    if params.do_sample is not False and params.seed is None:
        params = params.replace(seed=derive_seed(seed, rid))
    problems = early + params.problems() + params.token_id_problems(vocab_size)
    if problems:
        raise ValueError("; ".join(problems))
    return params


def derive_seed(base_seed: int, rid: str | int) -> int:
    """A request's sampling seed from the job seed and its id (63 bits; the same on every rank)."""
    digest = hashlib.blake2b(f"{base_seed}\0{id_key(rid)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _type_ok(value: Any, tp: Any) -> bool:
    """Does a JSON value fit a (simple) annotation: int, float, bool, str, X | None, list[int]?"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))
