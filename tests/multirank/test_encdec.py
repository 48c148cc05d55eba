"""Encoder-decoders (T5, BART): the prompt is the encoder's input, the encoder runs once per
request (a tower) and its output stays with the row. The local backend with refills and mixed
encoder lengths against HF ``generate()``, then 2 and 3 ranks on FSDP2 and DeepSpeed with
requests starting while a peer decodes, uneven counts and a rank holding none; the tick's tower
agreement shown needed (off: the ranks' gathers part); ``from_pretrained`` on seq2seq checkpoints."""

from __future__ import annotations

import encdec_scenarios as sc
import pytest
import torch
from encdec_models import KIN, features, hf_teacher, hf_tokens, hf_whisper, tiny, tiny_scored, tiny_whisper
from score_scenarios import worst

import shardgen

_PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(3, 13)), [20], [30, 31, 32], [40, 41, 42, 43]]
_LENGTHS = [4, 10, 6, 12, 3, 9]  # rows ending at different steps: refills take their slots


@pytest.mark.parametrize("kind", ["t5", "bart", *KIN])
@pytest.mark.parametrize("max_batch_size", [None, 2])
def test_local_matches_hf_per_request(kind, max_batch_size):
    """Encoder inputs of 1 to 10 tokens in one batch; at 2 rows, refills start new encoders while
    the other rows decode (BART's learned decoder positions per row, its kin's learned or
    sinusoidal ones: without each row's own positions mBART, Marian and Pegasus fail here)."""
    model = tiny(kind)
    want = [hf_tokens(model, p, n) for p, n in zip(_PROMPTS, _LENGTHS, strict=True)]
    opts = {} if max_batch_size is None else {"max_batch_size": max_batch_size}
    with shardgen.Engine(model, backend="local", **opts) as eng:
        with eng.paused():  # every request queued before the first tick: the refills are the test's
            futs = [eng.submit(p, max_new_tokens=n) for p, n in zip(_PROMPTS, _LENGTHS, strict=True)]
        got = [f.result(timeout=60).token_ids for f in futs]
        stats = eng.stats()
    assert got == want
    assert stats["prefill_tokens"] == sum(map(len, _PROMPTS))  # each encoder run once
    if max_batch_size:
        assert stats["refills"] > 0


def test_n_samples_share_one_encoder_run_and_rollout():
    """The n rows of one prompt share its encoder run and first decoder step (one prefill): greedy
    rows equal HF; ``rollout_iter`` gives the same rows."""
    model = tiny("t5")
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    with shardgen.Engine(model, backend="local") as eng:
        b = eng.rollout(prompts, n=3, do_sample=False, max_new_tokens=6)
        stats = eng.stats()
        streamed = dict(eng.rollout_iter(prompts, n=3, do_sample=False, max_new_tokens=6))
    for i, p in enumerate(prompts):
        want = hf_tokens(model, p, 6)
        for j in range(3):
            r = b.response_lengths[3 * i + j]
            assert b.response_ids[3 * i + j, :r].tolist() == want
        assert streamed[i].response_ids[0, : len(want)].tolist() == want
    assert stats["prefill_tokens"] == sum(map(len, prompts))  # each encoder once, not n times


def test_sampled_rows_do_not_depend_on_the_batch():
    """A seeded sampled request draws the same tokens alone and beside other requests (other
    encoder lengths, refills at 2 rows)."""
    model = tiny("bart")
    p = [5, 6, 7, 8, 9]
    kw = {"do_sample": True, "temperature": 1.3, "top_p": 0.9, "max_new_tokens": 10}
    with shardgen.Engine(model, backend="local") as eng:
        alone = eng.generate([p], seed=11, **kw)[0].token_ids
    with shardgen.Engine(model, backend="local", max_batch_size=2) as eng:
        batch = eng.generate([[3, 4], p, [9] * 8, [20]], seed=[1, 11, 2, 3], **kw)
    assert batch[1].token_ids == alone
    assert len({tuple(c.token_ids) for c in batch}) > 1


def test_generate_ids_returns_hf_shaped_decoder_sequences():
    """``generate_ids`` on an encoder-decoder: the decoder's sequences as HF ``generate()`` returns
    them for the same batch (the start token first, finished rows padded)."""
    import torch

    model = tiny("t5")
    ids = torch.tensor([[5, 6, 7, 8], [10, 11, 12, 13], [20, 21, 22, 23]])
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, synced_gpus=False)
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate_ids(ids, max_new_tokens=8)
    assert got.tolist() == want.tolist()


TOL = 2e-5  # as tests/unit/test_score.py: padded rows of a batch against one unpadded row each


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_score_matches_hf_teacher_forcing(kind):
    """Encoder inputs of 1 to 10 tokens and responses of 0 to 7 in runs of 3 rows: each row within
    TOL of HF ``model(input_ids=prompt, decoder_input_ids=[start] + response[:-1])``, at T = 0.7
    with top-k and logits; one row alone bit for bit (HF's shapes). BART's forced tokens do not
    apply: the model's own logprobs of an EOS where no limit forces it are scored."""
    model = tiny_scored(kind)
    ps = [[5, 6, 7, 8, 9], [10, 11], list(range(3, 13)), [20], [30, 31, 32]]
    rs = [[7, 8, 9], [3], [4, 5, 6, 7, 8, 9, 10], [], [2, 2, 11, 12]]
    with shardgen.Engine(model, backend="local", max_batch_size=3) as eng:
        sb = eng.score(ps, rs, temperature=0.7, top_k=3, logits=True)
        one = eng.score(ps[2:3], rs[2:3])
        stats = eng.stats()
    assert worst(sb, hf_teacher(model, ps, rs, 0.7, 3), top_k=3) < TOL
    assert sb.logprobs.shape == (5, 7) and sb.logits.shape == (5, 7, 48)
    assert torch.equal(one.logprobs[0], hf_teacher(model, ps[2:3], rs[2:3])[0]["logprobs"])
    assert stats["prefill_forwards"] == 3  # runs of 3 and 2 rows, then the one row: one forward each
    assert stats["prefill_tokens"] == sum(map(len, ps + rs)) + len(ps[2]) + len(rs[2])  # no padding


def test_score_a_rollout_batch_splits_its_rows_at_the_prompt_width():
    """``score(batch)`` of an enc-dec rollout: ``input_ids`` are prompt (encoder) + response
    (decoder) tokens, split at ``prompt_width``. BART forces BOS first and EOS at the length limit:
    the rollout's logprobs are the model's for the forced tokens, which score() gives too."""
    model = tiny("bart")
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    with shardgen.Engine(model, backend="local") as eng:
        b = eng.rollout(prompts, n=2, max_new_tokens=6, seed=3)
        sb = eng.score(b)
    rs = [b.response_ids[i, : int(g)].tolist() for i, g in enumerate(b.response_lengths)]
    ps = [p for p in prompts for _ in range(2)]
    assert worst(sb, hf_teacher(model, ps, rs)) < TOL
    assert [r[0] for r in rs] == [0] * 4  # the forced BOS
    assert (sb.logprobs - b.logprobs).abs().max() < TOL


def test_whisper_score_matches_hf_teacher_forcing():
    """Whisper: each row's ``input_features`` the encoder's input, its prompt the decoder's
    prefix; prefixes of 1 to 4 tokens and responses of 0 to 3 in runs of 3 rows, each within TOL
    of HF ``model(input_features=x, decoder_input_ids=(prompt + response)[:-1])``; one row alone
    bit for bit; other features score differently (they are used)."""
    model = tiny_whisper()
    ps, rs = [[1, 5, 6], [1], [1, 7], [1, 8, 9, 10]], [[7, 8, 9], [3, 4], [], [11]]
    xs = [features(i) for i in range(4)]
    with shardgen.Engine(model, backend="local", max_batch_size=3) as eng:
        sb = eng.score(ps, rs, inputs=xs, logits=True)
        one = eng.score(ps[:1], rs[:1], inputs=xs[:1])
        other = eng.score(ps[:1], rs[:1], inputs=[features(9)])
        assert eng.stats()["prefill_forwards"] == 4  # runs of 3 and 1 rows, then two of 1
    assert worst(sb, hf_whisper(model, ps, rs, xs)) < TOL
    assert torch.equal(one.logprobs[0], hf_whisper(model, ps[:1], rs[:1], xs[:1])[0]["logprobs"])
    assert (other.logprobs[0] - one.logprobs[0]).abs().max() > 1e-2


def test_whisper_mistakes_are_value_errors():
    model = tiny_whisper()
    x = features(0)
    with shardgen.Engine(model, backend="local") as eng:
        with pytest.raises(ValueError, match=r"row 0: a whisper row needs inputs=\{'input_features'"):
            eng.score([[1, 5]], [[6]])
        with pytest.raises(
            ValueError, match=r"row 1: input_features of shape \(8, 11\): the encoder takes \[8, 12\]"
        ):
            eng.score([[1], [1]], [[6], [6]], inputs=[x, {"input_features": x["input_features"][:, :11]}])
        with pytest.raises(
            ValueError, match="row 0: 30 prompt \\+ 3 response tokens exceed the context length 32"
        ):
            eng.score([[1] * 30], [[6] * 3], inputs=[x])
        with pytest.raises(ValueError, match="generate\\(\\) is not built for whisper"):
            eng.generate([[1, 5]], inputs=[x], max_new_tokens=2)
        assert eng.score([[1, 5]], [[6]], inputs=[x]).logprobs.shape == (1, 1)  # still serves


def test_what_an_encoder_decoder_does_not_take_is_a_value_error():
    import torch
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration

    model = tiny("bart")
    with shardgen.Engine(model, backend="local") as eng:
        with pytest.raises(ValueError, match="inputs= is not taken"):
            eng.generate([[5, 6]], inputs=[{"pixel_values": torch.zeros(1)}], max_new_tokens=2)
        with pytest.raises(ValueError, match="encoder's context of 64"):
            eng.generate([[5] * 65], max_new_tokens=2)
        with pytest.raises(ValueError, match="decoder's context of 64"):
            eng.generate([[5]], max_new_tokens=64)
        with pytest.raises(
            ValueError, match="row 1: a prompt of 65 tokens exceeds the encoder's context of 64"
        ):
            eng.score([[5], [5] * 65], [[7], [7]])
        with pytest.raises(ValueError, match="row 0: 65 response tokens exceed the decoder's context of 64"):
            eng.score([[5]], [[7] * 65])
        with pytest.raises(ValueError, match="row 0: the prompt is empty"):
            eng.score([[]], [[7]])
        with pytest.raises(ValueError, match="inputs= is not taken"):
            eng.score([[5, 6]], [[7]], inputs=[{"pixel_values": torch.zeros(1)}])
        with pytest.raises(ValueError, match="multi-turn"):
            eng.rollout([[5, 6]], n=1, env=lambda row, c: None, max_turns=2)
    tiny_blenderbot = BlenderbotForConditionalGeneration(
        BlenderbotConfig(vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=16,
                         decoder_ffn_dim=16, encoder_attention_heads=2, decoder_attention_heads=2)
    )  # fmt: skip
    with pytest.raises(ValueError, match="'blenderbot' is not supported"):
        shardgen.Engine(tiny_blenderbot, backend="local")


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_stationary_plan_sizes_the_encoder_at_the_call_and_gates_the_cross_attention(kind):
    """The stationary plan of an encoder-decoder, over one rank's whole shards: the encoder's
    modules sized at the call, the cross-attention keys and values gated by the encoder (their
    follower: the attention's output). A prefill forward from the shards (the modules' own weights
    zeroed) equals HF's; a shadow forward that runs no encoder computes the cross-attention
    locally; a real forward calling it without the agreed encoder is a RuntimeError."""
    import torch

    from shardgen.backends.seq2seq_inputs import shadow_inputs
    from shardgen.backends.stationary import Source, Stationary
    from shardgen.backends.stationary import shards as sh
    from shardgen.backends.towers import towers_of

    class Whole(Source):  # every parameter whole on one rank, read from a copy
        def shard(self, module, name):
            p = module._parameters[name]
            v = p.detach().clone().reshape(-1)
            return sh.FlatShard(tuple(p.shape), [0], [p.numel()], lambda v=v: v, p.dtype, 0, key=id(p))

    model = tiny(kind)
    mode = Stationary.create(model, Whole(None, 0, 1, torch.device("cpu")), towers_of(model))
    plan = mode.layout
    gated = [s for s in plan.linears.values() if s.gated]
    assert len(gated) == 4 and plan.describe()["fallbacks"] == {}, plan.describe()
    encoder = {
        s.name for s in plan.linears.values() if f".{s.name}".startswith((".encoder.", ".model.encoder."))
    }
    assert len(encoder) == {"t5": 14, "bart": 12}[kind] and encoder <= set(plan.describe()["free"]), encoder
    outs = {plan.groups[g][0].name for _, gs in plan.followers.items() for g in gs}
    assert outs == {s.name for s in gated if s.name.endswith(("k", "k_proj"))}, outs
    followers = {s.name for s in plan.linears.values() if id(s.module) in plan.followers}
    assert followers == {n.rsplit(".", 1)[0] + (".o" if kind == "t5" else ".out_proj") for n in outs}
    enc = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]])
    mask = (enc != 0).long()
    start = torch.full((2, 1), model.config.decoder_start_token_id)
    kw = {"input_ids": enc, "attention_mask": mask, "decoder_input_ids": start, "use_cache": False}
    with torch.no_grad():
        want = model(**kw).logits
        for p in model.parameters():
            p.zero_()
        got = mode.forward([(2, 2)], lambda: model(**kw), towers=1).logits
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        shadow = shadow_inputs(model, torch.device("cpu"))
        mode.forward([(0, 0)], lambda: model(**shadow), towers=0)  # gated: zeros, no exchange
        with pytest.raises(RuntimeError, match="runs no encoder"):
            mode.forward([(1, 1)], lambda: model(**shadow), towers=0)


# FSDP2 per layer and stationary (both at 3 ranks below in `make test`) in `make fuzz` here.
@pytest.mark.multirank
@pytest.mark.parametrize(
    "backend, gather, bucket_mb, kinds",
    [
        pytest.param("fsdp2", "per-layer", None, ("t5", "bart"), marks=pytest.mark.long),
        ("fsdp2", "once", None, ("t5", "bart")),
        pytest.param("fsdp2", "stationary", None, ("t5", "bart"), marks=pytest.mark.long),
        ("deepspeed", "per-layer", 0.001, ("t5", "bart")),
        ("deepspeed", "once", None, ("t5", "bart")), ("deepspeed", "stationary", None, ("t5",)),
    ],
)  # fmt: skip
def test_two_ranks_requests_starting_while_the_peer_decodes(ds_world2, backend, gather, bucket_mb, kinds):
    """Rank 0's refills start encoders while rank 1 decodes, and rank 1's later calls start while
    rank 0 decodes; rank 1 makes more calls. DeepSpeed with each unit a bucket (its gathers per
    module: the cross-attention gathered whole). ``stationary``: every forward stationary, the
    encoder's and the cross-attention's exchanges sized at the call, nothing gathered."""
    for kind in kinds:
        out = ds_world2.run(sc.encdec_equal, kind, backend, gather, 2, bucket_mb, timeout=240)
        for r, res in enumerate(out):
            assert res["bad"] == [], f"{kind}, rank {r}: {res['bad']}"
            assert res["policy"] == gather
            if gather == "stationary":
                assert_stationary(res, kind)
        assert out[0]["refills"] > 0
        if gather != "once":
            assert out[1]["shadows"] > 0  # rank 1 waited on rank 0's forwards, encoder included


KIN_CASES = [("fsdp2", "stationary", None), ("deepspeed", "per-layer", 0.001)]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "rest", [pytest.param(False, id="test"), pytest.param(True, id="rest", marks=pytest.mark.long)]
)
def test_two_ranks_bart_kin_and_mt5(ds_world2, rest):
    """mBART, Marian, Pegasus and mT5 as above: FSDP2 stationary (the encoder's exchanges sized at
    the call) and DeepSpeed with a bucket per unit. In `make test` each kind on one of the two
    (alternating), the other in `make fuzz` (``rest``)."""
    for i, kind in enumerate(KIN):
        for j, (backend, gather, bucket_mb) in enumerate(KIN_CASES):
            if ((i + j) % 2 == 1) != rest:
                continue
            out = ds_world2.run(sc.encdec_equal, kind, backend, gather, 2, bucket_mb, timeout=240)
            for r, res in enumerate(out):
                assert res["bad"] == [], f"{kind} {backend}, rank {r}: {res['bad']}"
                if gather == "stationary":
                    assert_stationary(res, kind)
            assert out[0]["refills"] > 0 and out[1]["shadows"] > 0, kind


def assert_stationary(res: dict, kind: str) -> None:
    """Every forward of the rank ran stationary, the encoder's exchanges and the cross-attention
    keys / values (gated: with the encoder) among them, and no module fell back to gathers."""
    st = res["stationary"]
    assert st is not None and st["forwards"] == res["forwards"] > 0, (kind, st, res["forwards"])
    assert st["free_exchanges"] > 0 and st["fallbacks"] == [], (kind, st)
    assert len(st["gated"]) == 4, (kind, st["gated"])  # k and v of 2 decoder layers
    assert any(".encoder." in n or n.startswith("encoder.") for n in st["free"]), (kind, st["free"])


@pytest.mark.multirank
@pytest.mark.parametrize("backend, bucket_mb", [("fsdp2", None), ("deepspeed", 0.001)])
def test_score_two_ranks_while_the_peer_decodes(ds_world2, backend, bucket_mb):
    """Rank 0 scores 5 rows in runs of 2 while rank 1 decodes, then rank 1 scores one row while
    rank 0 idles: each row within TOL of HF teacher forcing, rank 1's tokens HF's. Per layer
    (FSDP2; DeepSpeed with each unit a bucket): every score forward runs the encoder, so the
    tick runs it on both ranks."""
    for kind in ("t5", "bart"):
        out = ds_world2.run(sc.encdec_score, kind, backend, "per-layer", bucket_mb, timeout=180)
        for r, res in enumerate(out):
            assert res["diff"] < TOL and res["bad"] == [], f"{kind}, rank {r}: {res}"
            assert res["policy"] == "per-layer"
        assert out[0]["forwards"] == 3 + 0 and out[1]["forwards"] == 1 + 1  # 3 runs; a prefill + 1 run
        assert out[0]["shadows"] > 0  # rank 0 idle while rank 1 scores or decodes


@pytest.mark.multirank
@pytest.mark.parametrize("backend, bucket_mb", [("fsdp2", None), ("deepspeed", 0.001)])
def test_whisper_score_two_ranks(ds_world2, backend, bucket_mb):
    """Whisper rows on rank 0 (runs of 2), one row on rank 1 later: each within TOL of HF; the
    idle rank's shadows run the encoder on zero features (checked by hand: with the tick's tower
    agreement off, gloo aborts)."""
    out = ds_world2.run(sc.whisper_score, backend, "per-layer", bucket_mb, timeout=180)
    for r, res in enumerate(out):
        assert res["diff"] < TOL, f"rank {r}: {res}"
    assert [res["forwards"] for res in out] == [2, 1]


# At 3 ranks, the cases of `make test`, then those of `make fuzz` (each gather mode and DeepSpeed's
# bucket settings also at 2 ranks: test_two_ranks_requests_starting_while_the_peer_decodes).
ENCDEC3 = [
    ("t5", "fsdp2", "per-layer", None),
    ("bart", "deepspeed", "per-layer", 0),
    ("bart", "fsdp2", "stationary", None),
]
ENCDEC3_REST = [
    ("bart", "fsdp2", "per-layer", None),
    ("bart", "fsdp2", "once", None),
    ("t5", "deepspeed", "per-layer", 0.001),
]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "cases", [pytest.param(ENCDEC3, id="test"), pytest.param(ENCDEC3_REST, id="rest", marks=pytest.mark.long)]
)
def test_three_ranks_uneven_and_a_rank_holding_none(ds_world3, cases):
    """Rank 2 holds no request: its shadows run the encoder whenever a peer starts one. FSDP2
    per-layer, once and stationary; DeepSpeed with a bucket per unit and module by module (its
    own hooks)."""

    world = ds_world3
    for kind, backend, gather, bucket_mb in cases:
        out = world.run(sc.encdec_equal, kind, backend, gather, 2, bucket_mb, timeout=240)
        for r, res in enumerate(out):
            assert res["bad"] == [], f"{kind} {backend} {gather} {bucket_mb}, rank {r}: {res['bad']}"
            if gather == "stationary":
                assert_stationary(res, kind)
        if gather != "once":
            assert out[2]["shadows"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize("backend, bucket_mb", [("fsdp2", None), ("deepspeed", 0.001)])
def test_every_rank_gathers_the_same_units(ds_world2, backend, bucket_mb):
    """``debug_collectives``: each forward's gathered units, folded into the tick, are the same on
    both ranks (a prefill's encoder against a peer's decode step and shadow encoder)."""
    out = ds_world2.run(sc.encdec_equal, "bart", backend, "per-layer", 2, bucket_mb, debug_collectives=True)
    assert [res["bad"] for res in out] == [[], []]


@pytest.mark.multirank
@pytest.mark.parametrize("backend, bucket_mb", [("fsdp2", None), ("deepspeed", 0.001)])
def test_without_the_tower_agreement_the_ranks_part(backend, bucket_mb):
    """The same run with the tick's tower agreement switched off fails: the encoder's gathers of
    a rank starting a request meet its peer's decoder gathers (gloo aborts, or a hang, killed)."""
    from rollout_scenarios import ds_world
    from world import WorldError, WorldHang

    with ds_world(2) as world:
        with pytest.raises((WorldError, WorldHang)):
            world.run(sc.without_agreement, "t5", backend, bucket_mb, timeout=60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind in ("t5", "bart", "whisper", *KIN):
        path = tmp_path_factory.mktemp(kind)
        (tiny_whisper() if kind == "whisper" else tiny(kind)).save_pretrained(path)
        out[kind] = str(path)
    return out


def test_whisper_from_pretrained_scores_as_hf(checkpoints):
    """A saved Whisper loads as the speech seq2seq class (``AutoModelForSpeechSeq2Seq``)."""
    ref, xs = tiny_whisper(), [features(0), features(1)]
    ps, rs = [[1, 5, 6], [1]], [[7, 8], [3, 4, 5]]
    with shardgen.Engine.from_pretrained(checkpoints["whisper"], backend="local") as eng:
        assert type(eng.model) is type(ref)
        sb = eng.score(ps, rs, inputs=xs)
    assert worst(sb, hf_whisper(ref, ps, rs, xs)) < TOL


@pytest.mark.parametrize("kind", ["t5", "bart", *KIN])
def test_from_pretrained_picks_the_seq2seq_class(checkpoints, kind):
    """Against HF's own ``from_pretrained`` of the checkpoint: Marian's sinusoidal positions are
    not saved (``_keys_to_ignore_on_save``), both make them at load."""
    ref = type(tiny(kind)).from_pretrained(checkpoints[kind]).eval()
    with shardgen.Engine.from_pretrained(checkpoints[kind], backend="local") as eng:
        assert type(eng.model) is type(ref)
        got = eng.generate([[5, 6, 7], [9, 10, 11, 12]], max_new_tokens=8)
    assert [c.token_ids for c in got] == [hf_tokens(ref, p, 8) for p in ([5, 6, 7], [9, 10, 11, 12])]


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_from_pretrained_two_ranks(ds_world2, checkpoints, backend):
    """Loaded straight into each rank's shards (tied embeddings and head included); a Whisper
    (the speech seq2seq class) scores as HF; Marian's unsaved positions made into the shards."""
    for kind in ("t5", "bart", "marian"):
        out = ds_world2.run(sc.encdec_from_pretrained, kind, backend, checkpoints[kind], timeout=240)
        assert out == [[], []], kind
    diffs = ds_world2.run(sc.whisper_from_pretrained, backend, checkpoints["whisper"], timeout=240)
    assert max(diffs) < TOL, diffs


@pytest.mark.multirank
def test_score_without_the_tower_agreement_the_ranks_part(ds_world2):
    """``test_score_two_ranks_while_the_peer_decodes`` on FSDP2 with the tick's tower agreement off
    fails: rank 0's score forward gathers the encoder, rank 1's decode step does not (gloo
    aborts, or a hang, killed). Last in the module: the World does not survive it."""
    from world import WorldError, WorldHang

    with pytest.raises((WorldError, WorldHang)):
        ds_world2.run(sc.score_without_agreement, "t5", "fsdp2", timeout=30)
