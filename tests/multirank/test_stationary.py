"""gather="stationary": weight-stationary forwards on FSDP2 and DeepSpeed (backends/stationary).

In-process: the layouts and the cut-row assembly; the tick's shapes; the decoder's forward
shape prediction. Gloo ranks (one World of 2 and one of 3 for the module, DeepSpeed's CPU
accelerator set): greedy token equality with HF on every tiny architecture (tied and untied,
sizes no world size divides, biases, GPT-2's Conv1D and Mixtral's MoE falling back), uneven work
(a rank prefilling while another decodes, refills, a rank with no requests); the collectives of
real and shadow forwards, recorded and against the plan's count; bfloat16 compute over fp32
weights (FSDP2 mixed precision, DeepSpeed's bf16) in every gather mode, tokens and
log-probabilities bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import shardgen.backends.stationary.shards as sh
from shardgen.backends.stationary.layout import Source
from shardgen.core.protocol import TickRow, TickState

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------- in-process
LAYOUTS = [(101, 36, 2), (101, 36, 3), (7, 5, 4), (3, 40, 8), (96, 32, 3), (2, 9, 3), (50, 1, 4)]


@pytest.mark.parametrize("rows,cols,world", LAYOUTS)
@pytest.mark.parametrize("flat", [True, False], ids=["deepspeed", "fsdp2"])
def test_every_row_has_one_owner_and_cut_rows_assemble_exactly(monkeypatch, rows, cols, world, flat):
    full = torch.randn(rows, cols)
    numel = rows * cols
    if flat:
        starts, sizes = sh.flat_layout(numel, -(-numel // world), world)
    else:
        starts, sizes = sh.dim0_layout((rows, cols), world)
    assert sum(sizes) == numel and all(
        starts[r] + sizes[r] == starts[r + 1] for r in range(world - 1) if sizes[r + 1]
    )
    flatw = full.reshape(-1)

    def fake_gather(items, group, rank, world_, device, dtypes):  # every rank's piece, read from `full`
        out = []
        for (piece_sizes, _), shard in zip(items, shards_now, strict=True):
            out.append([flatw[shard.starts[r] : shard.starts[r] + piece_sizes[r]] for r in range(world_)])
        return out

    monkeypatch.setattr(sh, "gather_pieces", fake_gather)
    owned = torch.zeros(rows, dtype=torch.long)
    for r in range(world):
        part = torch.zeros(max(sizes))
        part[: sizes[r]] = flatw[starts[r] : starts[r] + sizes[r]]
        shard = sh.FlatShard((rows, cols), starts, sizes, lambda p=part: p, full.dtype, r)
        shards_now = [shard]
        assert flat or not shard.has_cut_rows  # FSDP2 never cuts a row
        cut = sh.CutRows([shard])
        cut.ensure(None, torch.device("cpu"))
        a, b = shard.row_ranges()[r]
        got = sh.local_rows(shard, cut)
        assert sum(blk.shape[0] for _, blk in got) == b - a
        for first, blk in got:
            assert torch.equal(blk, full[first : first + blk.shape[0]])
            owned[first : first + blk.shape[0]] += 1
    assert owned.tolist() == [1] * rows


def test_tick_shapes_follow_the_agreed_admission():
    def row(tokens, head, held_tokens, held_head, pause):
        return TickRow(
            tokens=tokens, head_rows=head, held_tokens=held_tokens, held_head_rows=held_head, pause=pause
        )

    state = TickState([row(4, 9, 2, 1, 1), row(0, 0, 0, 0, 0)])
    assert state.admit and state.shapes() == [(4, 9), (0, 0)]
    state = TickState([row(4, 9, 2, 1, 1), row(3, 1, 3, 1, 1)])
    assert not state.admit and state.shapes() == [(2, 1), (3, 1)]


@pytest.mark.parametrize(
    "share,max_prefill_tokens", [(False, None), (True, None), (True, 7), (False, 5)], ids=str
)
def test_forward_plan_predicts_what_each_step_feeds(share, max_prefill_tokens, monkeypatch):
    """prefill (shared, chunked), refill and decode: the (tokens, head rows) the tick carries is
    what the forward feeds every layer and the LM head."""
    from concurrent.futures import Future

    from models import tiny_model

    from shardgen.config import EngineConfig, SamplingParams
    from shardgen.core.shared import EngineStats
    from shardgen.generation.plan import Access
    from shardgen.generation.requests import Request
    from shardgen.generation.scheduler import LocalWork
    from shardgen.generation.sequence import SeqState

    model = tiny_model("llama", seed=1)
    fed: list[tuple[int, int]] = []
    head_rows: list[int] = []
    forked: list[bool] = []  # the head saw other rows than the body: a shared prefill's fork
    hidden = model.config.hidden_size
    model.get_output_embeddings().register_forward_hook(  # after the decoder's own pre-hook
        lambda _m, args, _out: head_rows.append(args[0].numel() // hidden)
    )

    class Backend:
        def forward(self, plan, inputs):
            assert plan.access is Access.PER_LAYER, plan  # the agreed plan, apart from HF's inputs
            out = model(**inputs)
            fed.append((inputs["input_ids"].numel(), head_rows.pop()))
            forked.append(fed[-1][1] != inputs["input_ids"].shape[0])
            return out

    from shardgen.generation import scheduler

    planned = []  # every PrefillPlan computed: one per prefill, the one its batch then runs
    real_of = scheduler.PrefillPlan.of

    def counted(*args):
        planned.append(real_of(*args))
        return planned[-1]

    monkeypatch.setattr(scheduler.PrefillPlan, "of", staticmethod(counted))
    cfg = EngineConfig(max_batch_size=4, share_prefill=share, max_prefill_tokens=max_prefill_tokens)
    work = LocalWork(model, Backend(), torch.device("cpu"), cfg, EngineStats(), on_finished=lambda s: None)

    def req(n, new):
        seq = SeqState(list(range(3, 3 + n)), SamplingParams(max_new_tokens=new).resolved(), frozenset(), 0)
        r = Request.__new__(Request)
        r.seq, r.future = seq, Future()
        seq.tag = r
        return r

    # a group of 3 samples of one prompt, then single prompts: a shared prefill forks its rows
    lengths = [(4, 2), (4, 6), (4, 3), (6, 5), (2, 9), (5, 3), (7, 4), (7, 2), (3, 8)]
    work.pending.extend(req(n, new) for n, new in lengths)
    steps = 0
    while work.pending or work.batch is not None or work.prefilling is not None:
        admit = steps % 5 != 3  # a tick now and then without admission (everybody pausing)
        plan = work.plan(admit)
        want = plan.shape
        n = len(fed)
        assert work.step(plan.agreed(Access.PER_LAYER)) == (want != (0, 0))
        if plan.prefill is not None:  # the batch runs the very plan the tick carried
            assert work.prefilling is not None or work.batch is not None
            assert plan.prefill is planned[-1]
        assert (fed[n] if len(fed) > n else (0, 0)) == want, (steps, fed[n:], want)
        steps += 1
    assert any(t > h for t, h in fed[1:]), "no refill ran"
    if share:
        assert any(forked), "no shared prefill forked its rows"
    if max_prefill_tokens:
        assert work.stats.prefill_forwards > work.stats.prefills, "no prefill ran in chunks"
    assert len(planned) == work.stats.prefills, "a prefill was planned more than once"


# ----------------------------------------------------------------------------- gloo ranks
class _BySize:
    """The session's Worlds (conftest), run by size."""

    def __init__(self, handles: dict) -> None:
        self.handles = handles

    def run(self, n: int, fn, *args, timeout: float = 120.0):
        return self.handles[n].run(fn, *args, timeout=timeout)


@pytest.fixture(scope="module")
def worlds(worlds):
    return _BySize(worlds)


ALL = ["llama-odd", "llama-tied", "qwen2", "gpt2", "mixtral", "opt", "gemma"]
# At 2 ranks in `make test`, each architecture on one backend (llama-odd, whose rows are cut across
# DeepSpeed's partitions, on both); the rest of the cross product runs in `make fuzz`.
SPLIT = {
    "fsdp2": ["llama-odd", "qwen2", "mixtral", "gemma"],
    "deepspeed": ["llama-odd", "llama-tied", "gpt2", "opt"],
}
REST = {b: [a for a in ALL if a not in SPLIT[b]] for b in SPLIT}
GREEDY_CASES = [
    *[pytest.param(b, 2, SPLIT[b], id=f"w2-{b}") for b in SPLIT],
    *[pytest.param(b, 3, ["llama-odd", "mixtral"], id=f"w3-{b}") for b in SPLIT],
    *[pytest.param(b, 2, REST[b], id=f"w2-rest-{b}", marks=pytest.mark.long) for b in SPLIT],
]


@pytest.mark.multirank
@pytest.mark.parametrize("backend,world,archs", GREEDY_CASES)
def test_greedy_matches_hf(worlds, backend, world, archs):
    import stationary_scenarios as sc

    out = worlds.run(world, sc.greedy_matches_hf, archs, backend, timeout=300)
    for name in archs:
        per = [o[name] for o in out]
        assert all(p["policy"] == "stationary" for p in per)
        # every forward was stationary, and ranks shadowed for each other (no work on rank 2)
        assert all(p["chosen"] == {"per-layer": 0, "stationary": p["stats"]["forward_ticks"]} for p in per)
        assert per[0]["stats"]["shadow_forwards"] > 0 and per[1]["stats"]["refills"] > 0
        if world == 3:
            assert per[2]["stats"]["forwards"] == 0 and per[2]["stats"]["shadow_forwards"] > 0
        plan = per[0]["plan"]
        if name == "gpt2":
            assert any("Conv1D" in why for why in plan["fallbacks"].values()), plan
        elif name == "opt":  # its learned positions (an nn.Embedding subclass) are looked up from the shards
            assert plan["fallbacks"] == {} and len(plan["groups"]) == 2, plan
            assert plan["embeddings"] == ["model.decoder.embed_tokens", "model.decoder.embed_positions"], plan
        elif name == "mixtral":
            assert sorted(plan["fallbacks"]) == ["model.layers.0.mlp", "model.layers.1.mlp"], plan
            assert plan["groups"] and plan["linears"] == 9, plan  # q/k/v/o and the head stay
        else:
            assert plan["fallbacks"] == {} and len(plan["groups"]) == 4, plan  # q/k/v and gate/up per layer
            assert plan["embeddings"] == ["model.embed_tokens"], plan  # gemma: its scaled subclass too
        if name == "llama-odd":
            assert per[0]["cut"] == (backend == "deepspeed"), per[0]  # rows cut across partitions


# the all-gather's name as recorded: torch 2.13's all_gather_single (what shardgen calls), or the
# older all_gather_into_tensor
_GATHERS = ("all_gather_single", "all_gather_into_tensor")


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
@pytest.mark.parametrize("world,arch", [(2, "llama-odd"), (3, "llama-odd"), (3, "mixtral"), (3, "opt")])
def test_real_and_shadow_forwards_issue_the_planned_collectives(worlds, backend, world, arch):
    import stationary_scenarios as sc

    out = worlds.run(world, sc.collectives_real_vs_shadow, arch, backend, timeout=180)
    for r, o in enumerate(out):
        assert all(d <= 1e-5 for d in o["diffs"]), (r, o["diffs"])
        assert o["first"] and all(c[0] in _GATHERS for c in o["first"][:1])
        for i, seq in enumerate(o["seqs"]):
            assert seq and {c[1] for c in seq} == {"param"}, seq
            # the same collectives, in the same order, on every rank: real and shadow alike
            assert [c[:2] for c in seq] == [c[:2] for c in out[0]["seqs"][i]], (r, i)
            gathers = [c for c in seq if c[0] in _GATHERS]
            assert gathers == [c for c in out[0]["seqs"][i] if c[0] in _GATHERS]
            assert (len(seq), sum(c[2] for c in seq)) == o["plans"][i], (r, i, o["plans"][i])
        assert o["kept_bytes"] == 0  # closed: nothing kept


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["fsdp2-user", "deepspeed-init"])
@pytest.mark.parametrize("name", ["llama-odd", "gemma"])  # gemma: its scaled embedding, tied
def test_user_sharded_models_match_hf(worlds, kind, name):
    import stationary_scenarios as sc

    for o in worlds.run(2, sc.user_sharded_greedy, kind, name, timeout=180):
        assert o["stats"]["forwards"] > 0 and o["plan"]["exchanges"] == 9, o
        assert o["plan"]["embeddings"] == ["model.embed_tokens"] and o["plan"]["fallbacks"] == {}, o


# Each backend and gather mode once in `make test` (llama-odd or gemma, alternating), the other
# model of each in `make fuzz`.
BF16_CASES = [
    pytest.param(name, gather, kind, marks=[pytest.mark.long] if (i + j + (name == "gemma")) % 2 else [])
    for i, kind in enumerate(["fsdp2", "deepspeed"])
    for j, gather in enumerate(["stationary", "per-layer", "once"])
    for name in ["llama-odd", "gemma"]
]


@pytest.mark.multirank
@pytest.mark.parametrize("name, gather, kind", BF16_CASES)
def test_bf16_over_fp32_weights_matches_hf(worlds, kind, gather, name):
    import stationary_scenarios as sc

    for o in worlds.run(2, sc.mixed_precision_greedy, kind, gather, name, timeout=180):
        assert o["policy"] == gather and o["stats"]["forwards"] > 0, o


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from loading_scenarios import write_checkpoint

    return write_checkpoint(
        str(tmp_path_factory.mktemp("stationary") / "odd"), tied=False, shards=True, vocab=101
    )


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_from_pretrained_matches_hf(worlds, ckpt, backend):
    import stationary_scenarios as sc

    for o in worlds.run(2, sc.pretrained_greedy, ckpt, backend, timeout=180):
        assert o["policy"] == "stationary" and o["forwards"] > 0, o


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fsdp2-user", "fsdp2", "deepspeed"])
def test_training_between_rollouts(worlds, mode):
    """Losses identical with and without the engine; after every training step the rollout's
    logprobs are the trained model's: the kept parameters were gathered again (with the stale
    ones, ``train_between(refresh=False)``, the diffs after a step were 2e-4 to 1e-2; fresh: <= 5e-7)."""
    import stationary_scenarios as sc

    for r, o in enumerate(worlds.run(2, sc.train_between, mode, timeout=240)):
        assert o["losses"] == o["base"], (r, o)
        assert len(o["diffs"]) == 3 and all(d < 1e-5 for d in o["diffs"]), (r, o["diffs"])
        assert o["stationary"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["explicit_groups", "hsdp", "deepspeed_subgroup"])
def test_engines_over_shard_groups(worlds, scenario):
    """4 ranks, one engine per shard group of 2 (explicit groups as ``--shard-size 2`` makes them,
    an HSDP mesh, a DeepSpeed data-parallel subgroup), all stationary: greedy == HF (asserted in
    the ranks), each engine's exchanges on its own group."""
    import group_scenarios as gs

    if scenario == "deepspeed_subgroup":
        worlds.run(4, gs.deepspeed_subgroup, "zero_init", 0.5, "stationary", timeout=300)
    else:
        worlds.run(4, getattr(gs, scenario), 0.5, "llama", "stationary", timeout=300)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_auto_mixes_per_layer_and_stationary_forwards_in_one_engine(worlds, backend):
    import stationary_scenarios as sc

    out = worlds.run(2, sc.auto_mixes_modes, backend, timeout=180)
    for o in out:
        assert o["policy"] == "auto", o
        assert o["chosen"]["per-layer"] > 0 and o["chosen"]["stationary"] > 0, o
        assert sum(o["chosen"].values()) == o["stats"]["forward_ticks"], o
        st, pl = o["chosen"]["stationary"], o["chosen"]["per-layer"]
        mix = f"auto per forward: {st} stationary, {pl} per-layer"
        assert o["stats"]["gather"] == mix, o  # stats() says what auto chose
    assert out[0]["chosen"] == out[1]["chosen"]  # the same choice on every rank, every tick


class _Whole(Source):
    """Every parameter laid out as FSDP2 would over ``world`` ranks, rank 0's view; a shard reads a
    copy taken when the plan is built, so a module's own weight can be cleared to show what reads it."""

    def shard(self, module, name):
        p = module._parameters[name]
        starts, sizes = sh.dim0_layout(tuple(p.shape), self.world)
        v = p.detach().clone().reshape(-1)
        return sh.FlatShard(tuple(p.shape), starts, sizes, lambda v=v: v, p.dtype, 0, key=id(p))


def test_embedding_subclasses_look_up_from_the_shards_unless_they_read_their_weight_otherwise():
    """An ``nn.Embedding`` subclass's own forward runs with its lookups (``F.embedding``,
    ``torch.embedding``) taken from the shards: Gemma's scaled embedding, two lookups in one call.
    One that indexes its weight falls back (gathered for its call). The modules' own weights are
    zeroed after the plan is built, so an output equal to the reference came from the shards."""
    import torch.nn.functional as F
    from torch import nn

    from shardgen.backends.stationary import Stationary

    class Scaled(nn.Embedding):  # Gemma's pattern
        def forward(self, ids):
            return super().forward(ids) * torch.tensor(2.5).to(self.weight.dtype)

    class Twice(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight) + torch.embedding(self.weight, ids.flip(-1))

    class Indexed(nn.Embedding):
        def forward(self, ids):
            return self.weight[ids]

    class Net(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb, self.head = emb, nn.Linear(8, 11, bias=False)

        def forward(self, input_ids, **_):
            return self.head(self.emb(input_ids))

    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    for cls, calls, why in [(Scaled, 1, None), (Twice, 2, None), (Indexed, 1, "__getitem__")]:
        torch.manual_seed(0)
        net = Net(cls(11, 8)).eval()
        with torch.no_grad():
            exp = net(ids)
        mode = Stationary.create(net, _Whole(None, 0, 1, torch.device("cpu")))
        plan = mode.layout.describe()
        if why is None:
            assert plan["embeddings"] == ["emb"] and plan["fallbacks"] == {}, plan
            assert [(s.subclass, s.calls) for s in mode.layout.embeddings.values()] == [(True, calls)]
        else:
            assert plan["embeddings"] == [] and why in plan["fallbacks"]["emb"], plan
            assert [s.calls for s in mode.layout.fallbacks.values()] == [calls]
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        assert torch.equal(mode.forward([(10, 10)], lambda net=net: net(ids)), exp), cls.__name__


def test_a_stationary_forward_on_the_cpu_gives_the_freed_heap_back(monkeypatch):
    """Each stationary forward on the CPU ends with ``buffer_pool.trim_heap`` (glibc's ``malloc_trim``,
    looked up once): its temporaries would otherwise stay on a fragmented heap (PERFORMANCE 15)."""
    from torch import nn

    import shardgen.backends.buffer_pool as buffer_pool
    from shardgen.backends.stationary import Stationary
    from shardgen.backends.stationary import runner as mode_module

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(11, 8), nn.Linear(8, 11, bias=False)

        def forward(self, input_ids, **_):
            return self.head(self.emb(input_ids))

    net = Net().eval()
    calls = []
    monkeypatch.setattr(mode_module, "trim_heap", lambda: calls.append(1) or True)
    mode = Stationary.create(net, _Whole(None, 0, 1, torch.device("cpu")))
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    for n in range(1, 4):
        mode.forward([(10, 10)], lambda: net(ids))
        assert len(calls) == n
    assert buffer_pool.trim_heap() is True  # glibc here
    hits = buffer_pool._malloc_trim.cache_info().hits
    assert all(buffer_pool.trim_heap() for _ in range(100))
    assert buffer_pool._malloc_trim.cache_info().hits == hits + 100


def test_cost_model_decodes_stationary_and_gathers_for_a_long_prefill():
    """The plan of a Llama layer at hidden 1024 as 2 ranks would hold it (built in-process from the
    layouts; the probe is local): auto's choice flips between decode and a long prefill."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardgen.backends.stationary import Stationary, gathered_cost, link_for, stationary_cost

    cfg = LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                      num_attention_heads=16, num_key_value_heads=16)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()

    mode = Stationary.create(model, _Whole(None, 0, 2, torch.device("cpu")))
    full = sum(p.numel() * 4 for p in model.parameters())
    per_layer = gathered_cost(4, full, 2).seconds(link_for("cpu"))  # a layer, embeddings, head, root
    decode = stationary_cost(mode.layout, [(8, 1), (8, 1)], 0)
    assert decode.collectives == 8 + 2 + 2  # q/k/v, o, gate/up, down: 2 each; embedding; head
    assert decode.seconds(link_for("cpu")) < per_layer
    assert stationary_cost(mode.layout, [(1, 4096), (1, 4096)], 0).seconds(link_for("cpu")) > per_layer
