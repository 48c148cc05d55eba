"""RL rollouts: ``n`` samples per prompt, returned as padded tensors ready for a trainer.

    batch = engine.rollout(prompts, n=4, max_new_tokens=64, temperature=0.7, seed=step)
    # batch.input_ids [R, P + G], batch.response_mask [R, G], batch.logprobs [R, G], R = 4 * len(prompts)

Not collective: ``rollout`` only submits requests to the engine and waits for them, like
``generate()``; any rank may call it any number of times with any number of prompts (zero
included: an empty batch comes back at once). Rows are grouped by prompt: rows
``i * n .. i * n + n - 1`` are the samples of prompt ``i``.

Seeds: sample ``j`` of prompt ``p`` whose seed is ``s`` decodes with ``sample_seed(s, j, p)``, so
the same prompt and seed give the same rows on any rank, in any batch (a prompt given as text
and the same prompt given as token ids are different keys). A scalar ``seed`` is the seed of
every prompt of the call (a step number, say); a list gives one per prompt; None draws one.

The ``n`` rows of a prompt go to the engine as consecutive requests with the same prompt: they
join a batch together and the prompt is prefilled once, its KV cache forked into the n rows
(``EngineConfig.share_prefill``). ``rollout_iter`` streams the same rows, one prompt's group at a
time, as each group is done: ``for i, group in engine.rollout_iter(prompts, n=4): ...``, ``i``
the prompt's index in ``prompts``.

Multi-turn (``env=step_fn, max_turns=T``): each row is a conversation with an environment that
replies in token ids; ``turns.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import random
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from shardgen.config import SAMPLING_RULES, SamplingParams
from shardgen.generation import partial, turns
from shardgen.generation.requests import Completion
from shardgen.generation.sequence import resolve_special_ids

#: Rollouts sample by default (``n`` greedy samples would all be equal), with logprobs.
ROLLOUT_DEFAULTS = SamplingParams(do_sample=True, logprobs=True)


@dataclass
class RolloutBatch:
    """The samples of one ``rollout()`` call, ``n`` consecutive rows per prompt.

    With P the longest prompt and G the longest response of the batch:
    """

    input_ids: torch.Tensor
    """[R, P + G] long: the prompt left-padded to P, then the response right-padded to G (pad id)."""
    attention_mask: torch.Tensor
    """[R, P + G] long: 1 on every real token (the prompt, the response), 0 on padding."""
    response_mask: torch.Tensor
    """[R, G] long: 1 on generated tokens up to and including the first stop (EOS id, the token
    completing a stop string), 0 after it; multi-turn, 1 on model tokens and 0 on the
    environment's."""
    logprobs: torch.Tensor
    """[R, G] float32: log p of each response token under ``softmax(logits / temperature)``
    (``raw_logprobs=True``: untempered); 0 where ``response_mask`` is 0."""
    prompt_lengths: torch.Tensor
    """[R] long: real (unpadded) prompt length of each row."""
    finish_reasons: list[str]
    """Per row: ``eos``, ``stop``, ``length``, or ``stale`` (a held row cut by ``max_staleness``)."""
    seeds: list[int | None]
    """Per row: the sampling seed of that sample (None for greedy rows)."""
    n: int = 1
    """Samples per prompt."""
    texts: list[str] | None = None
    """Per row: the generated text, when the engine has a tokenizer (``[]`` for zero rows either
    way, so ``zip(prompts, batch.texts)`` holds on a rank with no prompts)."""
    pad_id: int = 0
    """The id in padded positions of ``input_ids``."""
    turns: list[int] = dataclasses.field(default_factory=list)
    """Per row: its model turns (multi-turn, ``env=``: 1 to ``max_turns``; single-turn: 1)."""
    versions: torch.Tensor | None = None
    """[R, G] long: the weight version (``Engine.version``: the pauses before it) each response
    token was drawn under, so ``engine.version - versions`` is its staleness in steps; -1 where
    no token was drawn (padding, an environment's tokens)."""
    prompts: list[Any] = dataclasses.field(default_factory=list)
    """Per group of ``n`` rows: its prompt as the call was given it (a partial rollout's groups
    come from earlier calls too)."""

    @property
    def behaviour_logprobs(self) -> torch.Tensor:
        """``logprobs``: each token's under the weights that drew it (``versions``), which is
        what a decoupled or off-policy-corrected objective needs beside the trainer's own."""
        return self.logprobs

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        """P: the column where responses start."""
        return int(self.input_ids.shape[1] - self.response_mask.shape[1])

    @property
    def response_ids(self) -> torch.Tensor:
        """[R, G] the response columns of ``input_ids``."""
        return self.input_ids[:, self.prompt_width :]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[R] response tokens per row: generated (the stop included), and multi-turn the
        environment's too."""
        return self.attention_mask[:, self.prompt_width :].sum(-1)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with its tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def sample_seed(seed: int, index: int, prompt: str | Sequence[int]) -> int:
    """The seed of sample ``index`` of ``prompt`` in a request whose seed is ``seed`` (63 bits).

    The prompt is part of it, so one scalar seed for a whole call still gives every prompt its
    own draws (rows of different prompts would otherwise err at the same steps together).
    """
    key = prompt if isinstance(prompt, str) else ",".join(str(int(t)) for t in prompt)
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rollout(
    engine: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    *,
    n: int = 1,
    env: Any = None,
    max_turns: int | None = None,
    inputs: Sequence[dict[str, Any] | None] | None = None,
    groups: int | None = None,
    max_staleness: int | None = None,
    stale: str = "drop",
    tokens_per_call: int | None = None,
    **overrides: Any,
) -> RolloutBatch:
    """Generate ``n`` samples for each prompt and pack them as a ``RolloutBatch``. Not collective.

    ``groups=K``: a partial rollout, returned once K groups are whole, the others held by the
    engine for the next call (with ``max_staleness``, ``stale``, ``tokens_per_call``; with
    ``env``, held conversations: ``generation/partial.py``).

    ``params`` defaults to ``ROLLOUT_DEFAULTS`` (sampling, temperature 1); ``overrides`` are
    ``SamplingParams`` fields (``seed`` may be a list, one per prompt). Logprobs are always
    computed (the ``logprobs`` flag is forced on). ``env``: a ``step_fn(row, completion)`` that
    replies in token ids (None ends the row), for multi-turn rows of at most ``max_turns``
    model turns (``turns.py``); ``max_new_tokens`` is then per turn. ``inputs``: per prompt, the
    model's own forward inputs beside its ids (a VLM's images; ``Engine.submit``), shared by its
    ``n`` rows (one prefill); single-turn rollouts only.
    """
    quota = partial.Quota.of(groups, max_staleness, stale, tokens_per_call)
    if quota is not None:
        served = [
            g for _, g in _quota(engine, prompts, params, n, overrides, quota, (env, max_turns, inputs))
        ]
        return concat(served, n=n) if served else _Call(engine, [], params, n, {}).pack([], range(0))
    call, talks = _multi_turn(engine, prompts, params, n, overrides, env, max_turns, inputs)
    if talks is not None:
        groups = dict(talks)
        if not groups:  # no prompt: the empty batch
            return call.pack([], range(0))
        return concat([groups[i] for i in range(len(groups))])
    return call.pack([f.result() for f in call.futures], range(len(call.futures)))


def rollout_iter(
    engine: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    *,
    n: int = 1,
    env: Any = None,
    max_turns: int | None = None,
    inputs: Sequence[dict[str, Any] | None] | None = None,
    groups: int | None = None,
    max_staleness: int | None = None,
    stale: str = "drop",
    tokens_per_call: int | None = None,
    **overrides: Any,
) -> Iterator[tuple[int | None, RolloutBatch]]:
    """``rollout()``, streamed: ``(i, group)`` for each prompt as soon as its ``n`` samples are
    done, in the order groups finish: ``i`` is the prompt's index in ``prompts`` (``prompts[i]``),
    ``group`` a ``RolloutBatch`` of that prompt's n rows, padded on its own (its prompt, its
    longest response). Not collective.

    The requests are submitted (and the arguments checked) by the call itself, before the first
    group is asked for; the groups are the rows ``rollout()`` returns for the same arguments:
    ``concat`` of them in prompt order is ``rollout()``'s batch. Leaving the loop early does
    not cancel the rest: the engine still decodes them (their results are dropped). With
    ``env``, a group is prompt ``i``'s n conversations once every one has ended; leaving the loop
    early starts no further turns.

    ``groups=K``: the first K groups to be whole, held groups of earlier calls first (``i`` None
    for those: ``group.prompts[0]`` says which); leaving the loop early holds the rest.
    """
    quota = partial.Quota.of(groups, max_staleness, stale, tokens_per_call)
    if quota is not None:
        return _quota(engine, prompts, params, n, overrides, quota, (env, max_turns, inputs))
    call, talks = _multi_turn(engine, prompts, params, n, overrides, env, max_turns, inputs)
    if talks is not None:
        return talks
    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    for k, f in enumerate(call.futures):
        f.add_done_callback(lambda _f, i=k // n: done.put(i))  # runs in the driver: only a put
    return _groups(call, done)


def _quota(
    engine: Any, prompts: Any, params: Any, n: int, overrides: dict[str, Any], quota: Any, extra: Any
) -> Iterator[tuple[int | None, RolloutBatch]]:
    """A partial rollout's groups as they are served (``partial.py``); with ``env``, held
    conversations (``turns.Talk``)."""
    env, max_turns, inputs = extra
    most = _turn_limit(env, max_turns)

    def submit(holding: Any, now: int) -> tuple[_Call, turns.Talk | None]:
        call = _Call(engine, prompts, params, n, overrides, holding=holding)
        return call, None if most is None else turns.Talk(engine, call, env, most, holding, now)

    return partial.quota_groups(engine, prompts, n, quota, inputs, submit)


def _multi_turn(
    engine: Any,
    prompts: Any,
    params: SamplingParams | None,
    n: int,
    overrides: dict[str, Any],
    env: Any,
    max_turns: int | None,
    inputs: Sequence[dict[str, Any] | None] | None = None,
) -> tuple[_Call, Iterator[tuple[int, RolloutBatch]] | None]:
    """The call's checked arguments and rows (its first turns submitted), and with ``env`` its conversations
    (``turns.py``); None for a single-turn call."""
    if env is not None and getattr(engine.model.config, "is_encoder_decoder", False):
        raise ValueError(
            "env= (a multi-turn rollout) needs a decoder-only model: an encoder-decoder's next turn "
            "would be a new encoder input, not the conversation's continuation"
        )
    most = _turn_limit(env, max_turns)
    call = _Call(engine, prompts, params, n, overrides, inputs)
    return call, None if most is None else turns.conversations(engine, call, env, most)


def _turn_limit(env: Any, max_turns: int | None) -> int | None:
    """A multi-turn call's most model turns (``turns.check_turn_args``); None for a single-turn
    call (``max_turns`` without ``env`` refused). Both doors, plain and partial, check this way."""
    if env is None:
        if max_turns is not None:
            raise ValueError("max_turns goes with env= (a multi-turn rollout)")
        return None
    return turns.check_turn_args(env, max_turns)


def _groups(call: _Call, done: queue.SimpleQueue[int]) -> Iterator[tuple[int, RolloutBatch]]:
    n, count = call.n, [0] * call.prompts
    for _ in range(len(call.futures)):
        i = done.get()
        count[i] += 1
        if count[i] == n:
            rows = range(i * n, i * n + n)
            yield i, call.pack([call.futures[r].result() for r in rows], rows)


def concat(groups: Sequence[RolloutBatch], pad_id: int = 0, n: int = 1) -> RolloutBatch:
    """One batch of ``groups``' rows, in order, re-padded to their common widths: ``concat`` of
    ``rollout_iter``'s groups in prompt order equals ``rollout()``'s batch, tensor for tensor.
    ``pad_id``, ``n``: zero groups' (else the first group's)."""
    done, seeds, masks, turns, prompts = [], [], [], [], []
    for g in groups:  # single-turn masks are all ones: passing them on changes nothing
        p_width = g.prompt_width
        for i in range(len(g)):
            p, r = int(g.prompt_lengths[i]), int(g.response_lengths[i])
            masks.append(g.response_mask[i, :r].tolist())
            done.append(
                Completion(
                    token_ids=g.response_ids[i, :r].tolist(),
                    finish_reason=g.finish_reasons[i],
                    prompt_token_ids=g.input_ids[i, p_width - p : p_width].tolist(),
                    text=None if g.texts is None else g.texts[i],
                    logprobs=g.logprobs[i, :r].tolist(),
                    versions=None if g.versions is None else g.versions[i, :r].tolist(),
                )
            )
        seeds += g.seeds
        turns += g.turns
        prompts += g.prompts
    first = groups[0] if groups else None
    device = first.input_ids.device if first is not None else "cpu"
    pad = first.pad_id if first is not None else pad_id
    n = first.n if first is not None else n
    return pack(done, pad_id=pad, n=n, seeds=seeds, device=device, masks=masks, turns=turns, prompts=prompts)


class _Call:
    """The checked arguments of one rollout call, its rows (``n`` per prompt, seeded by
    ``sample_seed``) submitted to the engine in one go: the rows of a prompt are consecutive
    requests with the same prompt, which the engine batches together and prefills once."""

    def __init__(
        self,
        engine: Any,
        prompts: Any,
        params: SamplingParams | None,
        n: int,
        overrides: dict[str, Any],
        inputs: Sequence[dict[str, Any] | None] | None = None,
        holding: Any = None,
    ) -> None:
        """``holding``: a partial rollout's rows (``sequence.Holding``)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            raise ValueError("rollout() takes a list of prompts (strings or token-id lists), not one prompt")
        overrides = dict(overrides)
        seeds = overrides.pop("seed", None if params is None else params.seed)
        base = (params if params is not None else ROLLOUT_DEFAULTS).replace(**overrides)
        gen_config = getattr(engine.model, "generation_config", None)
        base = base.resolved(gen_config)  # as every request will be
        base.validate()  # the caller's values (logprobs too) by the rules of every door
        base = base.replace(logprobs=True)  # then forced on: a rollout always returns them
        prompts = list(prompts)
        if isinstance(seeds, (list, tuple)):
            if len(seeds) != len(prompts):
                raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        else:
            seeds = [seeds] * len(prompts)
        bad = [said for s in seeds if (said := SAMPLING_RULES["seed"].problem("seed", s)) is not None]
        if bad:  # checked greedy too: the same value gets the same answer whatever it decodes
            raise ValueError(bad[0])
        if base.do_sample:
            rng = random.SystemRandom()
            seeds = [rng.randrange(2**63) if s is None else int(s) for s in seeds]
            self.seeds: list[int | None] = [
                sample_seed(s, j, p) for s, p in zip(seeds, prompts, strict=True) for j in range(n)
            ]
        else:
            self.seeds = [None] * (len(prompts) * n)
        rows = [p for p in prompts for _ in range(n)]
        options = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "seed"}
        self.options = options  # every row's settings but its seed (a multi-turn row's next turns)
        # One submission: a prompt's rows reach the queue together and consecutive (shared prefill).
        self.futures: list[Future] = []
        if inputs is not None and (not isinstance(inputs, (list, tuple)) or len(inputs) != len(prompts)):
            got = len(inputs) if isinstance(inputs, (list, tuple)) else type(inputs).__name__
            raise ValueError(
                f"inputs must be a list of one dict (or None) per prompt: got {got} for {len(prompts)}"
            )
        each = None if inputs is None else [x for x in inputs for _ in range(n)]  # one dict per prompt's rows
        self.inputs = each  # a multi-turn row's next turns carry its prompt's images again
        self.seqs: list[Any] = []  # a partial rollout's rows, whose parking its call watches
        if rows and holding is not None:
            reqs = engine._submit_many(
                rows, None, {**options, "seed": self.seeds}, inputs=each, holding=holding, as_requests=True
            )
            self.futures, self.seqs = [r.future for r in reqs], [r.seq for r in reqs]
        elif rows:
            self.futures = engine.submit_many(rows, None, inputs=each, seed=self.seeds, **options)
        self.n, self.prompts, self.device = n, len(prompts), engine.device
        self.given = prompts  # as the call gave them: each group's batch names its own
        _, self.pad = resolve_special_ids(base, gen_config, engine.tokenizer)

    def pack(self, done: list[Completion], rows: range, **multi_turn: Any) -> RolloutBatch:
        seeds = [self.seeds[r] for r in rows]
        prompts = [self.given[r // self.n] for r in rows[:: self.n]]
        return pack(
            done, pad_id=self.pad, n=self.n, seeds=seeds, device=self.device, prompts=prompts, **multi_turn
        )

    def seed_of(self, row: int, turn: int, prompt_ids: list[int]) -> int | None:
        """The seed of a multi-turn row's turn ``turn`` (its first: the row's own seed), keyed by
        the conversation so far; None for greedy rows."""
        seed = self.seeds[row]
        return None if seed is None else sample_seed(seed, turn, prompt_ids)


def pack(
    done: list[Completion],
    *,
    pad_id: int,
    n: int,
    seeds: list[int | None],
    device: torch.device | str = "cpu",
    masks: list[list[int]] | None = None,
    turns: list[int] | None = None,
    prompts: list[Any] | None = None,
) -> RolloutBatch:
    """Completions -> padded tensors (prompt left-padded, response right-padded). ``masks``: per
    row, the response mask of its tokens (multi-turn: 0 on the environment's); None: all 1.
    ``turns``: per row, its model turns; None: 1 each. ``prompts``: per group, its prompt as given.
    Zero rows give ``[0, 0]`` tensors and
    empty lists, never None: a rank with no prompts runs the same code as the others."""
    rows = len(done)
    p_width = max((len(c.prompt_token_ids) for c in done), default=0)
    g_width = max((len(c.token_ids) for c in done), default=0)
    # Each tensor from one list of rows (a row's slices assigned one by one cost about 8 ms per
    # 64 rows, paid at the end of every call).
    ids, attn, resp, lps, versions = [], [], [], [], []
    for i, c in enumerate(done):
        p, g = len(c.prompt_token_ids), len(c.token_ids)
        tail = g_width - g
        ids.append([pad_id] * (p_width - p) + list(c.prompt_token_ids) + list(c.token_ids) + [pad_id] * tail)
        attn.append([0] * (p_width - p) + [1] * (p + g) + [0] * tail)
        resp.append(([1] * g if masks is None or not g else list(masks[i])) + [0] * tail)
        assert not g or (c.logprobs is not None and len(c.logprobs) == g), "rollout rows carry logprobs"
        lps.append((list(c.logprobs) if g else []) + [0.0] * tail)
        has = c.versions is not None and len(c.versions) == g
        versions.append((list(c.versions) if has else [-1] * g) + [-1] * tail)
    width = p_width + g_width
    texts = [c.text for c in done] if all(c.text is not None for c in done) else None
    batch = RolloutBatch(
        # (viewed: zero rows make [0, width], not the [0] of an empty list)
        input_ids=torch.tensor(ids, dtype=torch.long).view(rows, width),
        attention_mask=torch.tensor(attn, dtype=torch.long).view(rows, width),
        response_mask=torch.tensor(resp, dtype=torch.long).view(rows, g_width),
        logprobs=torch.tensor(lps, dtype=torch.float32).view(rows, g_width),
        prompt_lengths=torch.tensor([len(c.prompt_token_ids) for c in done], dtype=torch.long),
        finish_reasons=[c.finish_reason for c in done],
        seeds=list(seeds),
        n=n,
        texts=texts,
        pad_id=pad_id,
        turns=[1] * rows if turns is None else list(turns),
        versions=torch.tensor(versions, dtype=torch.long).view(rows, g_width),
        prompts=[] if prompts is None else list(prompts),
    )
    return batch.to(device)
