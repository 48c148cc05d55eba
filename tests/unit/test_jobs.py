"""Tier 1 (no processes): the prompts reader, journals and merge, claiming, flags built from the configs."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest

from shardgen import flags
from shardgen.cli import command as cli
from shardgen.config import EngineConfig, JobConfig, SamplingParams
from shardgen.errors import ExitCode, JobError
from shardgen.jobs import journal, progress, prompts
from shardgen.jobs import run as jobs
from shardgen.jobs.prompts import PromptRecord


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def jsonl(tmp_path, *objs, name: str = "p.jsonl") -> str:
    return write(tmp_path, name, "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def read_error(path: str, **kw) -> JobError:
    with pytest.raises(JobError) as info:
        prompts.read_prompts(path, **kw)
    assert "\n" not in str(info.value)  # one line
    return info.value


# ---------------------------------------------------------------- reading prompts


def test_read_jsonl_with_generation_fields(tmp_path):
    path = jsonl(
        tmp_path, {"id": "a", "prompt": "x"}, {"id": 7, "prompt": "y", "max_new_tokens": 3, "top_k": 2}
    )
    recs = prompts.read_prompts(path, base=SamplingParams(max_new_tokens=9, top_p=0.5))
    seed = prompts.derive_seed  # the model may sample: each request has its seed
    assert [(r.id, r.prompt, r.params, r.line) for r in recs] == [
        ("a", "x", SamplingParams(max_new_tokens=9, top_p=0.5, seed=seed(0, "a")), 1),
        (7, "y", SamplingParams(max_new_tokens=3, top_k=2, top_p=0.5, seed=seed(0, 7)), 2),
    ]


def test_read_plain_text_ids_are_line_numbers_blank_lines_skipped(tmp_path):
    path = write(tmp_path, "p.txt", "first prompt\n\nthird { line\n")
    recs = prompts.read_prompts(path)
    assert [(r.id, r.prompt) for r in recs] == [(1, "first prompt"), (3, "third { line")]


def test_jsonl_detected_by_first_line_without_suffix(tmp_path):
    path = write(tmp_path, "p.txt", '\n{"id": 1, "prompt": "x"}\n')
    assert prompts.read_prompts(path)[0].prompt == "x"


def test_id_defaults_to_line_number(tmp_path):
    assert prompts.read_prompts(jsonl(tmp_path, {"prompt": "x"}, {"prompt": "y"}))[1].id == 2


@pytest.mark.parametrize("text", ["", "\n \n"])
def test_empty_file(tmp_path, text):
    err = read_error(write(tmp_path, "p.jsonl", text))
    assert err.code == ExitCode.NO_PROMPTS and "empty" in str(err)


def test_missing_file(tmp_path):
    err = read_error(str(tmp_path / "nope.jsonl"))
    assert err.code == ExitCode.NO_PROMPTS and "not found" in str(err)


def test_unreadable_file(tmp_path):
    err = read_error(str(tmp_path))  # a folder
    assert err.code == ExitCode.NO_PROMPTS and "cannot read" in str(err)


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"id": 2, "prompt": "b",}', ["p.jsonl:2:", "malformed JSON"]),
        ('["a list"]', ["p.jsonl:2:", "JSON object", "array"]),
        ('{"id": 2}', ["p.jsonl:2:", "missing 'prompt'"]),
        ('{"id": 2, "prompt": 5}', ["p.jsonl:2:", "'prompt' must be a string", "number"]),
        ('{"id": 2, "prompt": null}', ["p.jsonl:2:", "'prompt' must be a string", "null"]),
        ('{"id": 1, "prompt": "again"}', ["p.jsonl:2:", "duplicate id 1", "line 1"]),
        ('{"id": "1", "prompt": "same key"}', ["p.jsonl:2:", "duplicate id '1'"]),
        ('{"id": 2.5, "prompt": "b"}', ["p.jsonl:2:", "'id' must be a string or an integer"]),
        ('{"id": 2, "prompt": "b", "temp": 1, "colour": 2}', ["p.jsonl:2:", "'colour', 'temp'"]),
        ('{"id": 2, "prompt": "b", "max_new_tokens": "ten"}', ["p.jsonl:2:", "'max_new_tokens'", "integer"]),
        ('{"id": 2, "prompt": "b", "do_sample": 1}', ["p.jsonl:2:", "'do_sample'", "true/false"]),
        ('{"id": 2, "prompt": "b", "top_p": 1.5}', ["p.jsonl:2:", "top_p must be in (0, 1]"]),
    ],
)
def test_bad_line(tmp_path, line, words):
    path = jsonl(tmp_path, {"id": 1, "prompt": "a"}, line)
    err = read_error(path, cfg=JobConfig(prompts=path, out="o"), base=SamplingParams())
    assert err.code == ExitCode.BAD_PROMPTS
    for w in words:
        assert w in str(err), str(err)


def test_every_bad_line_is_named_up_to_a_cap(tmp_path):
    """Several bad lines: each named with file:line in the one error (exit code 4), not only the
    first; past 20, "and N more"."""
    lines = [{"id": 1, "prompt": "a"}, {"id": 2}, {"id": 3, "prompt": "c"}, {"id": 1, "prompt": "again"}]
    path = jsonl(tmp_path, *lines)
    err = read_error(path)
    assert err.code == ExitCode.BAD_PROMPTS
    assert str(err) == (
        f"2 bad lines: {path}:2: missing 'prompt' | {path}:4: duplicate id 1 (first on line 1)"
    ), str(err)
    bad = [{"id": i, "prompt": i} for i in range(25)]  # 25 non-string prompts, one good line first
    err = read_error(jsonl(tmp_path, {"id": "ok", "prompt": "a"}, *bad))
    said = str(err)
    assert err.code == ExitCode.BAD_PROMPTS, said
    assert said.startswith(f"25 bad lines: {path}:2: 'prompt' must be a string, got number | "), said
    assert [f"p.jsonl:{n}:" in said for n in range(2, 27)] == [True] * 20 + [False] * 5, said
    assert said.endswith(" | and 5 more"), said


def test_empty_prompt_is_not_a_file_error(tmp_path):
    """An empty prompt is a bad single request: it gets an error field at run time, the job goes on."""
    assert prompts.read_prompts(jsonl(tmp_path, {"id": 1, "prompt": ""}))[0].prompt == ""


# ---------------------------------------------------------------- per-request settings


def params(options: dict, **job) -> SamplingParams:
    return prompts.request_params(SamplingParams(max_new_tokens=9), options, "a", **job)


def test_the_model_decides_by_default_greedy_at_temperature_zero():
    p = params({})
    assert p.do_sample is None and p.max_new_tokens == 9  # the model's generation_config decides
    assert p.seed == prompts.derive_seed(0, "a")  # in case the model samples
    p = params({}, temperature=0.0)
    assert p.do_sample is False and p.seed is None and p.temperature is None


def test_temperature_means_sampling_with_a_seed_from_job_seed_and_id():
    p = params({}, temperature=0.7, seed=3)
    assert p.do_sample and p.temperature == 0.7 and p.seed == prompts.derive_seed(3, "a")
    assert params({"temperature": 0.5}).do_sample  # a line's own temperature
    assert not params({"temperature": 0.5, "do_sample": False}).do_sample
    assert not params({"temperature": 0.0}, temperature=0.7).do_sample  # the line wins
    assert params({"seed": 11}, temperature=0.7).seed == 11


def test_derived_seeds_differ_by_id_and_base_and_are_stable():
    assert prompts.derive_seed(0, "a") == prompts.derive_seed(0, "a")
    assert len({prompts.derive_seed(b, i) for b in (0, 1) for i in ("a", "b", 1)}) == 6
    assert prompts.derive_seed(0, 1) == prompts.derive_seed(0, "1")  # ids compare as strings
    assert 0 <= prompts.derive_seed(5, "x") < 2**63


# ---------------------------------------------------------------- journals and merge


def result(rid, text="t", **extra):
    return {"id": rid, "text": text, **extra}


def records(*ids):
    return [PromptRecord(i, f"p{i}", SamplingParams(), n) for n, i in enumerate(ids, start=1)]


def test_journal_appends_durably(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(jobs.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = str(tmp_path / "o.rank0.journal.jsonl")
    j = journal.Journal(path, header={"include_out": False})
    j.append(result(1))
    j.append(result(2))
    assert len(synced) >= 3  # the header and each result, before append returns
    with open(path) as f:  # readable by another process right away
        assert [json.loads(x) for x in f] == [{"_job": {"include_out": False}}, result(1), result(2)]
    j.close()


def test_journal_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "o.rank1.journal.jsonl"
    path.write_text(json.dumps(result(1)) + "\n" + '{"id": 2, "te')
    assert [r["id"] for r in journal.read_jsonl(str(path))] == [1]  # torn line skipped by readers
    j = journal.Journal(str(path))
    j.append(result(3))
    j.close()
    assert [r["id"] for r in journal.read_jsonl(str(path))] == [1, 3]
    assert path.read_text().count("\n") == 2


def test_merge_input_order_dedupe_and_journals_removed(tmp_path):
    out = str(tmp_path / "o.jsonl")
    for rank, rows in enumerate([[result("c"), result("a", "first")], [result("b"), result("a", "again")]]):
        j = journal.Journal(journal.journal_path(out, rank))
        for r in rows:
            j.append(r)
        j.close()
    assert jobs.merge_results(records("a", "b", "c"), out, include_out=False) == 3
    lines = [json.loads(x) for x in open(out)]
    assert [r["id"] for r in lines] == ["a", "b", "c"]
    assert lines[0]["text"] == "first"  # a result journaled twice is written once
    assert journal.journal_paths(out) == [] and not os.path.exists(out + ".tmp")


def test_merge_with_a_missing_result_writes_nothing(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text("old\n")
    j = journal.Journal(journal.journal_path(str(out), 0))
    j.append(result("a"))
    j.close()
    with pytest.raises(JobError) as info:
        jobs.merge_results(records("a", "b"), str(out), include_out=False)
    assert info.value.code == ExitCode.FAILED and "'b'" in str(info.value)
    assert out.read_text() == "old\n" and len(journal.journal_paths(str(out))) == 1


def test_merge_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    out.write_text("old\n")
    j = journal.Journal(journal.journal_path(str(out), 0))
    j.append(result("a"))
    j.close()

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(jobs.os, "replace", crash)
    with pytest.raises(OSError):
        jobs.merge_results(records("a"), str(out), include_out=False)
    assert out.read_text() == "old\n"  # never half-written
    assert len(journal.journal_paths(str(out))) == 1  # and nothing lost


def test_resume_takes_results_from_out_and_journals(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps(result("a", "from out")) + "\n" + '{"id": "b", "tor')
    j = journal.Journal(journal.journal_path(str(out), 3))
    j.append(result("c"))
    j.close()
    done = journal.load_results(str(out), include_out=True)
    assert sorted(done) == ["a", "c"] and done["a"]["text"] == "from out"
    assert sorted(journal.load_results(str(out), include_out=False)) == ["c"]


def test_plan(tmp_path):
    out = str(tmp_path / "o.jsonl")
    recs = records("a", "b", "c")
    assert jobs._plan(JobConfig(prompts="p", out=out), recs) == {
        "pending": [0, 1, 2],
        "include_out": False,
        "error": None,
    }
    j = journal.Journal(journal.journal_path(out, 0), header={"include_out": False})
    j.append(result("b"))
    j.close()
    assert "pass --resume" in jobs._plan(JobConfig(prompts="p", out=out), recs)["error"]
    with open(out, "w") as f:  # a stale --out from before the fresh run that wrote the journal
        f.write(json.dumps(result("a")) + "\n")
    plan = jobs._plan(JobConfig(prompts="p", out=out, resume=True), recs)
    assert plan == {"pending": [0, 2], "include_out": False, "error": None}
    os.remove(journal.journal_path(out, 0))
    plan = jobs._plan(JobConfig(prompts="p", out=out, resume=True), recs)  # a finished run's out counts
    assert plan == {"pending": [1, 2], "include_out": True, "error": None}


# ---------------------------------------------------------------- claiming


class DictStore:
    def __init__(self):
        self.values: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.values[key] = self.values.get(key, 0) + n
            return self.values[key]


def test_claims_are_consecutive_and_cut_at_n():
    c = jobs.Claimer(DictStore(), "k", 5)
    assert list(c.claim(2)) == [0, 1] and not c.exhausted
    assert list(c.claim(2)) == [2, 3]
    assert list(c.claim(2)) == [4] and c.exhausted
    assert list(c.claim(2)) == []
    assert list(jobs.Claimer(DictStore(), "k", 0).claim(3)) == []


@pytest.mark.parametrize("store_kind", ["dict", "c10d"])
def test_concurrent_claimers_get_every_index_exactly_once(store_kind):
    if store_kind == "c10d":
        torch_dist = pytest.importorskip("torch.distributed")
        store = torch_dist.HashStore()
    else:
        store = DictStore()
    n, got = 500, [[] for _ in range(4)]

    def worker(r: int) -> None:
        c = jobs.Claimer(store, "job/next", n)
        while not c.exhausted:
            got[r].extend(c.claim(1 + r))  # ranks ask for different amounts

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(i for g in got for i in g) == list(range(n))


def test_claims_go_longest_first_input_order_among_equals():
    recs = [
        PromptRecord("a", "short", SamplingParams(max_new_tokens=8), 1),
        PromptRecord("b", "a longer prompt", SamplingParams(max_new_tokens=8), 2),
        PromptRecord("c", "x", SamplingParams(max_new_tokens=64), 3),
        PromptRecord("d", "short", SamplingParams(max_new_tokens=8), 4),
    ]
    assert jobs.longest_first(recs, [0, 1, 2, 3]) == [2, 1, 0, 3]
    assert jobs.longest_first(recs, [0, 3]) == [0, 3]  # only what is pending


def test_plan_orders_pending_by_claim_order(tmp_path):
    recs = [PromptRecord(i, "p" * (i + 1), SamplingParams(), i + 1) for i in range(4)]
    out = str(tmp_path / "o.jsonl")
    assert jobs._plan(JobConfig(prompts="p", out=out), recs)["pending"] == [3, 2, 1, 0]
    assert jobs._plan(JobConfig(prompts="p", out=out, claim_order="input"), recs)["pending"] == [0, 1, 2, 3]


# ---------------------------------------------------------------- CLI flags from the dataclasses


def test_every_flag_comes_from_a_field_with_its_default_and_docstring():
    parser = cli.make_parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in run._actions if a.dest != "help"}
    expected = {f.name for f in dataclasses.fields(JobConfig)}
    expected |= {"backend", "gather", "max_batch_size", "refill", "stall_timeout"}
    expected |= {"share_prefill", "max_prefill_tokens", "numerics"}
    expected |= {"speculate", "speculate_history_tokens", "speculate_share"}
    expected |= {"max_new_tokens", "top_k", "top_p"}
    assert set(actions) == expected
    docs = flags.field_docs(EngineConfig)
    assert actions["max_batch_size"].option_strings == ["--batch-size", "--max-batch-size"]
    assert actions["max_batch_size"].default == EngineConfig().max_batch_size
    assert actions["max_batch_size"].help.startswith(flags.help_text(docs["max_batch_size"]))
    assert actions["top_p"].default == SamplingParams().top_p
    assert actions["prompts"].required and actions["resume"].default is False
    assert actions["no_claim_ranks"].help == "==SUPPRESS=="  # demo/test knob, hidden
    for command, codes in cli.EXIT_CODES.items():  # each command's table: its own codes only
        epilog = parser._subparsers._group_actions[0].choices[command].epilog  # type: ignore[union-attr]
        for code in ExitCode:
            assert (f"  {int(code)}  " in epilog) == (code in codes), (command, code, epilog)
    assert set(cli.EXIT_CODES["run"]) == set(ExitCode) - {ExitCode.WRONG_ANSWERS, ExitCode.TIMEOUT}


def test_prefill_flags_reach_the_engine_config_and_the_ranks_argv():
    # --no-share-prefill and --max-prefill-tokens come from EngineConfig's fields: parsed into the
    # config, passed on to the spawned ranks, and checked with the flag's own name in the message.
    parser = cli.make_parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in run._actions}
    docs = flags.field_docs(EngineConfig)
    for name in ("share_prefill", "max_prefill_tokens"):
        assert actions[name].default == getattr(EngineConfig(), name)
        assert actions[name].help.startswith(flags.help_text(docs[name]))
    ns = parser.parse_args(["run", "--prompts", "p", "--out", "o"])
    _, eng, _ = (flags.build(cls, ns, names) for cls, names in cli.RUN_FIELDS)
    assert eng.share_prefill is True and eng.max_prefill_tokens is None
    argv = ["run", "--prompts", "p", "--out", "o", "--no-share-prefill", "--max-prefill-tokens", "1024"]
    ns = parser.parse_args(argv)
    _, eng, _ = (flags.build(cls, ns, names) for cls, names in cli.RUN_FIELDS)
    assert eng == EngineConfig(share_prefill=False, max_prefill_tokens=1024)
    child = flags.to_argv(eng, cli.RUN_FIELDS[1][1])
    assert child == ["--no-share-prefill", "--max-prefill-tokens", "1024"]
    with pytest.raises(ValueError) as err:
        EngineConfig(max_prefill_tokens=0).validate()
    said = flags.flag_names(str(err.value), cli.RUN_FIELDS)
    assert said == "--max-prefill-tokens must be an integer >= 1, got 0"


def test_child_argv_round_trips():
    job = JobConfig(
        prompts="p.jsonl", out="o.jsonl", nproc=4, resume=True, temperature=0.5, no_claim_ranks=[3]
    )
    eng, base = EngineConfig(max_batch_size=3, gather="once", refill=False), SamplingParams(top_k=5)
    argv = ["run"]
    for obj, (_, names) in zip((job, eng, base), cli.RUN_FIELDS, strict=True):
        argv += flags.to_argv(obj, names, skip=cli.LAUNCHER_ONLY)
    assert "--nproc" not in argv and "--batch-size" in argv
    ns = cli.make_parser().parse_args(argv)
    rebuilt = [flags.build(cls, ns, names) for cls, names in cli.RUN_FIELDS]
    assert rebuilt == [dataclasses.replace(job, nproc=None), eng, base]
    ns = cli.make_parser().parse_args(["run", "--prompts", "p", "--out", "o", "--max-batch-size", "5"])
    assert ns.max_batch_size == 5 and ns.refill is True


def test_flag_names_in_messages():
    said = flags.flag_names("max_batch_size must be >= 1, got 0", cli.RUN_FIELDS)
    assert said == "--batch-size must be >= 1, got 0"


# ---------------------------------------------------------------- model check, summary


def test_check_model(tmp_path):
    from shardgen.toy import toy_model_path

    jobs.check_model(toy_model_path())
    for bad in (str(tmp_path / "nope"), str(tmp_path)):  # missing; a folder without config.json
        with pytest.raises(JobError) as info:
            jobs.check_model(bad)
        assert info.value.code == ExitCode.BAD_MODEL


def test_summary_numbers():
    def rep(rank, prompts, busy, fwd, shadow):
        stats = {"busy_s": busy, "forwards": fwd, "shadow_forwards": shadow, "ticks": fwd + shadow}
        stats["gather"] = "once"  # engine.stats(): what gather="auto" chose
        return {"rank": rank, "prompts": prompts, "errors": 0, "tokens": 10 * prompts, "stats": stats}

    s = progress.summarize(
        [rep(0, 5, 2.0, 8, 2), rep(1, 5, 1.8, 7, 3), rep(2, 0, 0.0, 0, 10)],
        prompts=10,
        resumed=0,
        wall_s=2.5,
        load_s=1.0,
        out="o",
        engine_cfg=EngineConfig(),
    )
    assert s["generated_tokens"] == 100 and s["tokens_per_s"] == 40.0 and s["ticks"] == 10
    assert s["busy_spread"] == pytest.approx(0.1)  # the idle rank does not count
    assert s["shadow_forward_share"] == pytest.approx(15 / 30)
    assert sum(r["busy_share"] for r in s["ranks"]) == pytest.approx(1.0)
    table = progress.format_summary(s)
    assert "tokens/s" in table and "busy share" in table
    assert s["gather"] == "auto" and s["gather_used"] == "once"
    assert "x fsdp2 (gather auto (chose once), batch" in table, table
    assert "prompts per replica" not in table  # one engine: no replicas to show


def test_summary_per_replica():
    stats = {"busy_s": 1.0, "forwards": 4, "shadow_forwards": 1, "ticks": 5}
    reports = [
        {
            "rank": r,
            "engine_ranks": [r // 2 * 2, r // 2 * 2 + 1],
            "prompts": p,
            "errors": 0,
            "tokens": 3 * p,
            "stats": stats,
        }  # fmt: skip
        for r, p in enumerate([4, 3, 1, 2])
    ]
    s = progress.summarize(
        reports,
        prompts=10,
        resumed=0,
        wall_s=1.0,
        load_s=0.0,
        out="o",
        shard_size=2,
        engine_cfg=EngineConfig(),
    )
    assert s["replicas"] == [
        {"ranks": [0, 1], "prompts": 7, "tokens": 21},
        {"ranks": [2, 3], "prompts": 3, "tokens": 9},
    ]
    table = progress.format_summary(s)
    line = next(x for x in table.splitlines() if x.startswith("prompts per replica"))
    assert line.endswith(" 2 x 2 ranks: 7 (ranks [0, 1]), 3 (ranks [2, 3])"), table


def test_shard_size_must_divide_the_launched_world():
    JobConfig(prompts="p", out="o", nproc=4, shard_size=2).validate()
    with pytest.raises(ValueError, match="--shard-size 3 must divide the world of 4 ranks"):
        JobConfig(prompts="p", out="o", nproc=4, shard_size=3).validate()


def test_readme_lists_every_exit_code():
    readme = str(Path(__file__).resolve().parents[2] / "README.md")
    if not os.path.exists(readme):
        pytest.skip("no README.md")
    text = open(readme, encoding="utf-8").read()
    section = text.split("## Batch jobs: shardgen run", 1)[1].split("\n## ", 1)[0]
    rows = {
        int(line.split("|")[1])
        for line in section.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    }
    assert rows == {int(c) for c in ExitCode}


# ---------------------------------------------------------------- a newcomer's first hour (issue 20)


def _help(command: str) -> str:
    sub = cli.make_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return sub.format_help()


def test_help_shows_choices_defaults_and_plain_words():
    text = _help("run")
    for shown in (
        "--backend {fsdp2,deepspeed,local}",
        "--gather {per-layer,stationary,once,auto}",
        "--dtype {auto,float32,bfloat16,float16,float64}",
        "--claim-order {longest,input}",
        "--log-level {debug,info,warning,error,critical}",
    ):
        assert shown in text, shown
    assert "None" not in text and "Unset: the model's, else 64" in " ".join(text.split())
    options = text.split("\njob:\n", 1)[1]
    seed = " ".join(options.split("--seed SEED", 1)[1].split("--shard-size", 1)[0].split())
    assert seed.endswith("(default: 0)"), seed  # a falsy default is a default too
    assert "settings:" not in text and "JobConfig" not in text  # sections named for the user
    assert "\njob:\n" in text and "\nengine (" in text and "\nsampling (" in text
    for command in ("run", "demo", "bench"):  # HF's eos_token_id=None (a method of bench) aside
        assert "None" not in _help(command).replace("eos_token_id=None", ""), command


def test_bench_help_is_its_own():
    text = _help("bench")
    flat = " ".join(text.split("options:", 1)[1].split())
    assert "--prompts-per-rank PROMPTS_PER_RANK" in text and "--prompts PROMPTS" not in text
    for wrong in ("journals", "--resume", "demo only", "prompts file"):  # run's exit codes
        assert wrong not in text, wrong
    methods = flat.split("--methods METHOD [METHOD ...]", 1)[1].split("--prompts-per-rank", 1)[0]
    assert "(default: all)" in methods and "hf_synced" not in methods  # the default once, as a word
    from shardgen.bench.methods import DESCRIPTIONS, METHODS

    assert set(DESCRIPTIONS) == set(METHODS)
    for name in METHODS:  # each method described under "methods:"
        assert f"  {name}  " in text.split("methods:", 1)[1] and DESCRIPTIONS[name].split()[0] in text
    assert " ".join(_help("demo").split()).count("exit codes:") == 1 and "journals" not in _help("demo")


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == ExitCode.USAGE
    return capsys.readouterr().err


def test_unknown_flag_is_reported_by_the_subcommand_with_a_suggestion(capsys):
    err = _usage_error(["run", "--prompts", "p", "--out", "o", "--temprature", "0.5"], capsys)
    assert err.startswith("usage: shardgen run ") and "{run,demo,bench}" not in err, err
    said = "shardgen run: error: unrecognized arguments: --temprature 0.5 (did you mean --temperature?)"
    assert said in err, err
    err = _usage_error(["run", "--prompts", "p", "--out", "o", "--batchsize", "2", "--tempo", "1"], capsys)
    assert "--batchsize (did you mean --batch-size?)" in err, err
    assert "--tempo (did you mean --temperature?)" in err, err
    err = _usage_error(["bench", "--world-szes", "2"], capsys)
    assert err.startswith("usage: shardgen bench ") and "did you mean --world-sizes?" in err, err
    err = _usage_error(["demo", "--noproc", "2"], capsys)
    assert "shardgen demo: error:" in err and "did you mean --nproc?" in err, err
    err = _usage_error(["run", "--temprature", "0.5"], capsys)  # the typo first, then what is missing
    assert "error: unrecognized arguments: --temprature (did you mean --temperature?); " in err, err
    assert "required: --prompts, --out" in err, err
    err = _usage_error(["run", "--prompts", "p", "--out", "o", "--backend", "fsdp"], capsys)
    assert "invalid choice: 'fsdp'" in err and "'fsdp2'" in err, err


def test_log_level_flags():
    parse = cli.make_parser().parse_args
    assert cli._log_level(parse(["run", "--prompts", "p", "--out", "o"])) is None  # the default
    assert cli._log_level(parse(["run", "--prompts", "p", "--out", "o", "--quiet"])) == "error"
    loud = ["--quiet", "--log-level", "info"]  # an explicit level wins over --quiet's
    assert cli._log_level(parse(["run", "--prompts", "p", "--out", "o", *loud])) == "info"
    assert cli._log_level(parse(["demo", "--quiet"])) == "error"
    assert cli._log_level(parse(["bench", "--log-level", "debug"])) == "debug"
    assert cli._log_level(parse(["bench", "--quiet"])) == "error"  # every command's --quiet
    from shardgen import config, log

    assert config.LOG_LEVELS == log.LEVELS


def test_unknown_field_gets_a_suggestion(tmp_path):
    err = read_error(jsonl(tmp_path, {"id": 1, "prompt": "a", "temprature": 0.5}))
    assert err.code == ExitCode.BAD_PROMPTS
    assert "'temprature' (did you mean temperature?)" in str(err), str(err)


def test_every_problem_of_a_line_at_once(tmp_path):
    line = {"id": 2.5, "prompt": 5, "temprature": 1, "max_new_tokens": "x", "top_p": 1.5, "top_k": -1}
    err = read_error(jsonl(tmp_path, line), vocab_size=72)
    for said in (
        "p.jsonl:1:",
        "'temprature' (did you mean temperature?)",
        "'prompt' must be a string, got number",
        "'id' must be a string or an integer",
        "field 'max_new_tokens' must be an integer",
        "top_p must be in (0, 1], got 1.5",
        "top_k must be an integer >= 0, got -1",
    ):
        assert said in str(err), (said, str(err))
    err = read_error(jsonl(tmp_path, {"id": 1, "prompt": "a"}, {"id": 1, "eos_token_id": 999}), vocab_size=72)
    for said in ("p.jsonl:2:", "missing 'prompt'", "duplicate id 1", "eos_token_id 999 is outside"):
        assert said in str(err), (said, str(err))


def test_special_ids_are_checked_against_the_vocabulary(tmp_path):
    path = jsonl(
        tmp_path, {"id": 1, "prompt": "a", "eos_token_id": 71}, {"id": 2, "prompt": "b", "eos_token_id": 999}
    )
    assert prompts.read_prompts(path)[1].params.eos_token_id == 999  # no model known: nothing to check
    err = read_error(path, vocab_size=72)
    assert err.code == ExitCode.BAD_PROMPTS
    said = "p.jsonl:2: eos_token_id 999 is outside the model's vocabulary [0, 72)"
    assert str(err).endswith(said), str(err)
    path = jsonl(tmp_path, {"prompt": "a", "eos_token_id": [3, 72], "pad_token_id": -1})
    said = str(read_error(path, vocab_size=72))
    # the pad id's own rule (the same at every door) and the vocabulary's: both named at once
    assert "eos_token_id 72 is outside" in said, said
    assert "pad_token_id must be an integer >= 0, got -1" in said, said


def test_the_cli_checks_special_ids_against_the_model_before_any_rank(tmp_path, capsys):
    path = jsonl(tmp_path, {"id": 1, "prompt": "count from 1 to 3 :", "eos_token_id": 999})
    rc = cli.main(["run", "--prompts", path, "--out", str(tmp_path / "o.jsonl"), "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == ExitCode.BAD_PROMPTS and "vocabulary [0, 72)" in err, err  # the toy model's 72 tokens
    assert not list(tmp_path.glob("o.jsonl*"))


def test_sampling_params_name_every_problem():
    with pytest.raises(ValueError) as info:
        SamplingParams(max_new_tokens=0, top_p=0.0, top_k=-2).validate()
    said = str(info.value)
    assert "max_new_tokens" in said and "top_p" in said and "top_k" in said, said
    assert SamplingParams(eos_token_id=[1, 80], pad_token_id=3).token_id_problems(72) == [
        "eos_token_id 80 is outside the model's vocabulary [0, 72)"
    ]
    assert SamplingParams(eos_token_id=80).token_id_problems(None) == []


def test_model_path_messages(tmp_path):
    def said(path: str) -> str:
        with pytest.raises(JobError) as info:
            jobs.check_model(path)
        assert info.value.code == ExitCode.BAD_MODEL
        return str(info.value)

    assert said(str(tmp_path / "nope")) == f"model path {tmp_path / 'nope'} does not exist"
    assert said("./nope").endswith("does not exist")
    folder = said(str(tmp_path))
    assert "no config.json" in folder and "Errno" not in folder, folder
    (tmp_path / "config.json").write_text("{")
    assert "not valid JSON" in said(str(tmp_path))


def test_a_claim_leaves_the_others_their_share():
    """20 prompts, 2 ranks, 16 free slots each: 10 and 5 first, not 16 and 4; every prompt once."""
    store = DictStore()
    c0, c1 = (jobs.Claimer(store, "k", 20, ranks=2) for _ in range(2))
    got = [len(c0.claim(16)), len(c1.claim(16)), len(c0.claim(16)), len(c1.claim(16))]
    assert got == [10, 5, 3, 1], got
    while not (c0.exhausted and c1.exhausted):
        got += [len(c0.claim(16)), len(c1.claim(16))]
    assert sum(got) == 20
    assert len(jobs.Claimer(DictStore(), "k", 20, ranks=1).claim(16)) == 16  # alone: all it asks for
    assert len(jobs.Claimer(DictStore(), "k", 2000, ranks=4).claim(16)) == 16  # plenty left: no cap


def test_numerics_flag_reaches_the_engine_config_and_the_ranks_argv():
    parser = cli.make_parser()
    ns = parser.parse_args(["run", "--prompts", "p", "--out", "o", "--numerics", "invariant"])
    _, eng, _ = (flags.build(cls, ns, names) for cls, names in cli.RUN_FIELDS)
    assert eng == EngineConfig(numerics="invariant")
    assert flags.to_argv(eng, cli.RUN_FIELDS[1][1]) == ["--numerics", "invariant"]
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--prompts", "p", "--out", "o", "--numerics", "exact"])
