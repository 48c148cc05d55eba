"""The model a user hands the engine is checked against the backend at construction, before any
collective, and ``backend=None`` picks the backend from the model; a local path that does not
exist is named as one from Python too. Pure unit tests: no process group."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model

import shardgen
from shardgen.backends import kinds


def _zero3_module() -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    m.weight.ds_id = 0  # what zero.Init leaves on every partitioned parameter
    return m


def _fsdp2_module() -> torch.nn.Module:
    from torch.distributed.fsdp import FSDPModule

    m = torch.nn.Linear(2, 2)
    m.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # as fully_shard does
    return m


def _deepspeed_engine():
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine.__new__(DeepSpeedEngine)  # the class alone: no init, no process group


def test_each_kind_of_model_is_told_apart():
    assert kinds.model_kind(torch.nn.Linear(2, 2)) == kinds.PLAIN
    assert kinds.model_kind(_zero3_module()) == kinds.ZERO3_MODULE
    assert kinds.model_kind(_fsdp2_module()) == kinds.FSDP2_MODULE
    assert kinds.model_kind(_deepspeed_engine()) == kinds.DEEPSPEED_ENGINE


@pytest.mark.parametrize(
    "make,backend,kind",
    [
        (_deepspeed_engine, "fsdp2", "a DeepSpeedEngine"),
        (_deepspeed_engine, "local", "a DeepSpeedEngine"),
        (_zero3_module, "fsdp2", "a ZeRO-3-partitioned module"),
        (_fsdp2_module, "deepspeed", "a module sharded with fully_shard"),
        (_fsdp2_module, "local", "a module sharded with fully_shard"),
    ],
)
def test_a_backend_that_cannot_run_the_model_is_refused_at_construction(make, backend, kind):
    """Before this check a DeepSpeedEngine given backend='fsdp2' was constructed and the first
    generate() died in backends/replica.py with a TypeError from DeepSpeedEngine.__init__."""
    with pytest.raises(ValueError) as e:
        shardgen.Engine(make(), backend=backend)
    msg = str(e.value)
    assert f"backend={backend!r}" in msg and kind in msg and "backend=None" in msg, msg


def test_backend_none_picks_the_models_own():
    assert kinds.backend_for(None, _deepspeed_engine()) == "deepspeed"
    assert kinds.backend_for(None, _zero3_module()) == "deepspeed"
    assert kinds.backend_for(None, _fsdp2_module()) == "fsdp2"
    assert kinds.backend_for(None, torch.nn.Linear(2, 2)) == "fsdp2"
    assert kinds.backend_for(None, torch.nn.Linear(2, 2), distributed=False) == "local"
    for name in ("fsdp2", "deepspeed", "local"):  # a plain module runs on any
        assert kinds.backend_for(name, torch.nn.Linear(2, 2)) == name


def test_backend_none_runs_a_plain_model_on_one_process():
    model = tiny_model("llama", seed=1)
    with shardgen.Engine(model, backend=None) as eng:
        assert eng.config.backend == "local"  # one process, no process group: nothing to shard
        out = eng.generate([[3, 4, 5]], max_new_tokens=3, pad_token_id=0)
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("path", ["/no/such/dir", "./no-such-model", "~/nope", "a/b/c"])
def test_from_pretrained_names_a_missing_local_path(path):
    """The hub's "Repo id must be in the form ..." is not what a user with a typo needs."""
    with pytest.raises(FileNotFoundError, match=f"model path {path} does not exist"):
        shardgen.Engine.from_pretrained(path)


def test_from_pretrained_and_the_cli_say_the_same_of_a_missing_path(tmp_path):
    """One rule, one message, from Python and from ``shardgen run --model`` (the CLI's own words
    were the reference: "model path ... does not exist")."""
    from shardgen.errors import ExitCode, JobError
    from shardgen.jobs.run import check_model

    for path in ["/no/such/dir", "./nope", "a/b/c", "C:\\models\\x"]:
        with pytest.raises(FileNotFoundError) as py:
            shardgen.Engine.from_pretrained(path)
        with pytest.raises(JobError) as cli:
            check_model(path)
        assert cli.value.code == ExitCode.BAD_MODEL and str(py.value) == str(cli.value), (py, cli)


def test_a_path_under_home_is_found_from_python_and_the_cli(tmp_path, monkeypatch):
    """``~/models/toy`` is the user's home, as a shell reads it: it was "does not exist" (Python)
    and the hub's repo-id error before."""
    import shutil

    from shardgen.config import JobConfig
    from shardgen.jobs.run import check_model
    from shardgen.toy import toy_model_path

    shutil.copytree(toy_model_path(), tmp_path / "models" / "toy")
    monkeypatch.setenv("HOME", str(tmp_path))
    job = JobConfig(prompts="p.jsonl", out="o.jsonl", model="~/models/toy")
    check_model(job.model_path)  # no JobError
    with shardgen.Engine.from_pretrained("~/models/toy", backend="local") as eng:
        out = eng.generate(["count from 3 to 5 :"])[0]
    assert out.text == "3 4 5", out
