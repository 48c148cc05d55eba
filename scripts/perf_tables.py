"""Render the benchmarks' ``--json`` output as the markdown tables of docs/PERFORMANCE.md.

    python scripts/perf_tables.py overhead out.json      # one benchmark's table
    python scripts/perf_tables.py headline perf-headline/ # the headline table (benchmarks/headline.sh)
    python scripts/perf_tables.py fill docs/PERFORMANCE.md perf-headline/   # rewrite the doc's tables
    python scripts/perf_tables.py --list                  # the benchmark names

A section's table is what this script prints for that section's command; the headline table is
what it prints over the folder that ``benchmarks/headline.sh`` fills. ``fill`` rewrites every
block of a markdown file between ``<!-- perf_tables: NAME FILE.json -->`` (or
``<!-- perf_tables: headline -->``) and ``<!-- /perf_tables -->`` from the folder's JSON; a block
whose file is missing is left as it is. Nothing here measures.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Table = Callable[[dict[str, Any]], str]


def _md(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def overhead(d: dict[str, Any]) -> str:
    return _md(
        ["method", "tokens/s"],
        [
            ["HF `generate(synced_gpus=True)`", _f(d["hf_synced_gpus_tok_s"])],
            ["shardgen `Engine`", _f(d["shardgen_tok_s"])],
            ["**ratio shardgen / HF**", f"**{d['ratio']:.2f}** (target >= 0.95)"],
        ],
    )


def skew(d: dict[str, Any]) -> str:
    names = {
        "hf_synced": "HF `generate(synced_gpus=True)`, equal call counts per rank",
        "hf_eos_none": "HF with `eos_token_id=None` (decode to max length, cut later)",
        "shardgen_waves": "shardgen, waves (`refill=False`)",
        "shardgen": "shardgen (continuous refill)",
    }
    tok, x = d["useful_tok_s"], d["ratio_shardgen_over"]
    return _md(
        ["method", "useful tokens/s", "shardgen is"],
        [[names.get(k, k), _f(tok[k]), f"{x[k]:.2f}x"] for k in names if k in tok],
    )


def rollout(d: dict[str, Any]) -> str:
    names = {
        "trl_generate": "TRL's path: `unwrap_model_for_generation` + HF `generate(synced_gpus=True)`",
        "eos_none": "the same with `eos_token_id=None`, masked after EOS",
        "shardgen": "shardgen `engine.rollout(prompts, n=...)`",
    }
    tok = d["useful_tok_s"]
    return _md(
        ["method", "useful tokens/s", "shardgen is"],
        [[names.get(k, k), _f(tok[k]), f"{tok['shardgen'] / tok[k]:.2f}x"] for k in tok],
    )


def hybrid(d: dict[str, Any]) -> str:
    tok = d["useful_tok_s"]
    first = next(iter(tok))
    return _md(
        ["layout", "useful tokens/s (world)", "ratio"],
        [[k, _f(v), f"{v / tok[first]:.2f}x"] for k, v in tok.items()],
    )


def loading(d: dict[str, Any]) -> str:
    rows = []
    for r in d["rows"]:
        within = "yes" if r["load_mb"] <= r["bound_mb"] else "no"
        gen_within = "yes" if r["generate_mb"] <= r["bound_mb"] else "no"
        rows.append(
            [
                r["backend"],
                r["nproc"],
                r["method"],
                _f(r["load_s"]),
                f"{r['load_mb']:.0f}",
                f"{r['generate_mb']:.0f}",
                f"{r['bound_mb']:.0f}",
                within,
                gen_within,
                _f(r["decode_ms"], 0),
            ]
        )
    head = [
        "backend",
        "N",
        "method",
        "load s",
        "load: MiB",
        "generate: MiB",
        "bound",
        "load within",
        "generate within",
        "decode ms",
    ]
    return f"{d['config']['dtype']}, model {d['model_mb']:.0f} MiB\n\n" + _md(head, rows)


def train_pause(d: dict[str, Any]) -> str:
    rows = []
    for mode, s in d.items():
        none, paused = s["arms"]["none"], s["arms"]["paused"]
        ci = paused["ratio_ci95"]
        width = f"{100 * (ci[1] - ci[0]):.1f}%" if ci else "-"
        rows.append(
            [
                mode,
                s["rounds"],
                f"{s['seconds'] / 60:.1f} min",
                f"{none['step_ms_median']:.1f} ({none['step_ms_q1']:.1f}-{none['step_ms_q3']:.1f})",
                f"{paused['step_ms_median']:.1f} ({paused['step_ms_q1']:.1f}-{paused['step_ms_q3']:.1f})",
                f"{paused['first_step_ms_median']:.1f} / {_f(paused['later_steps_ms_median'])}",
                f"**{paused['ratio_median']:.3f}**",
                f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-",
                width + (", reached" if s["reached"] else ", not reached"),
            ]
        )
    head = [
        "backend",
        "rounds",
        "run",
        "no engine, ms / step (IQR)",
        "in `paused()` (IQR)",
        "first / later step, paused",
        "median ratio",
        "95% CI",
        "width",
    ]
    return _md(head, rows)


def bench(d: dict[str, Any]) -> str:
    out = []
    for world, res in d["worlds"].items():
        rows = []
        for name, r in res["methods"].items():
            if "error" in r:
                rows.append([f"`{name}`", "error", "", "", "", "", ""])
                continue
            rows.append(
                [
                    f"`{name}`",
                    _f(r["useful_tok_s"]),
                    f"{r['wall_s']:.2f}",
                    r["forwards"],
                    r["wasted_forwards"],
                    f"{r['peak_param_mib']:.2f}",
                    _f(r.get("x_floor"), 2),
                ]
            )
        head = ["method", "useful tok/s", "wall s", "forwards", "wasted", "param MiB/rank", "x floor"]
        out.append(f"{world} ranks:\n\n" + _md(head, rows))
    return "\n\n".join(out)


def tail(d: dict[str, Any]) -> str:
    rows = []
    for workload, by_order in d["results"].items():
        for order, runs in by_order.items():
            fw = [f for r in runs for f in r["forwards"]]
            rows.append(
                [
                    workload,
                    order,
                    ", ".join(f"{100 * r['busy_spread']:.1f}%" for r in runs),
                    f"{min(fw)}-{max(fw)}",
                    ", ".join(f"{100 * r['forward_spread']:.1f}%" for r in runs),
                    ", ".join(f"{r['wall_s']:.1f}" for r in runs),
                ]
            )
    return _md(
        ["workload", "claim order", "busy spread (runs)", "forwards per rank", "forwards spread", "wall s"],
        rows,
    )


def ds_decode(d: dict[str, Any]) -> str:
    rows = []
    for r in d["results"]:
        ms, g = r["ms_per_step"], r["gathers_per_forward"]
        rows.append(
            [
                f"{r['size']} (hidden {r['hidden']}, {r['layers']} layers, {r['buckets']} buckets)",
                r["offload_param"],
                f"{ms['hf']:.0f}",
                f"{ms['shardgen']:.0f}",
                f"**{r['x_hf']['shardgen']:.2f}**",
                f"{ms['shardgen_per_module']:.0f}",
                f"{r['x_hf']['shardgen_per_module']:.2f}",
                f"{ms['floor']:.0f}",
                f"{r['x_floor']['shardgen']:.2f}",
                f"{g['shardgen']:.0f} / {g['shardgen_per_module']:.0f}",
            ]
        )
    head = [
        "model",
        "offload_param",
        "HF ms/step",
        "shardgen",
        "x HF",
        "per-module",
        "x HF",
        "floor",
        "shardgen x floor",
        "all-gathers/forward: plan / per-module",
    ]
    return _md(head, rows)


def _tok_table(tok: dict[str, float], refs: list[str], unit: str = "useful tok/s") -> str:
    refs = [r for r in refs if r in tok]
    rows = [[k, _f(v), *(f"{v / tok[r]:.2f}" for r in refs)] for k, v in tok.items()]
    return _md(["method", unit, *(f"x `{r}`" for r in refs)], rows)


def gather_once(d: dict[str, Any]) -> str:
    return _tok_table(d["useful_tok_s"], ["local", "per-layer-fsdp2"])


def stationary(d: dict[str, Any]) -> str:
    if d["part"] == "toy":
        return _tok_table(d["tok_s"], ["per-layer"])
    if d["part"] == "crossover":
        return _md(list(d["crossover"][0]), [list(r.values()) for r in d["crossover"]])
    out = _tok_table(d["tok_s"], ["per-layer-fsdp2", "local"], "tok/s")
    if "memory" in d:
        m = d["memory"]
        out += f"\n\nmemory growth while generating ({m['method']}): {m['growth_mib']:.1f} MiB, "
        out += f"bound {m['bound_mib']:.1f} MiB"
    return out


def sampling(d: dict[str, Any]) -> str:
    med = d["median"]
    vocabs = sorted({int(k.split("/")[1]) for k in med})
    rows = []
    for v in vocabs:
        o, n, p = (med[f"{m}/{v}"]["cpu_ms"] for m in ("old", "new", "plain"))
        rows.append([f"{v:,}", f"{o:.2f} ms", f"{n:.2f} ms", f"{p:.2f} ms", f"**{o / n:.1f}x**"])
    head = ["vocabulary", "old (row by row)", "new (batched)", "plain softmax + multinomial", "old / new"]
    return _md(head, rows)


def prefill(d: dict[str, Any]) -> str:
    out = []
    res = d["results"]
    if "share" in res:
        rows = []
        for key, r in res["share"].items():
            name, n, share = key.split("|")
            rows.append(
                [
                    name,
                    n[2:],
                    "on" if share.endswith("True") else "off",
                    f"{r['prefill_tokens']:.0f}",
                    f"{r['prefill_forwards']:.0f}",
                    f"{r['forwards']:.0f}",
                    f"{r['seconds']:.2f}",
                ]
            )
        head = [
            "workload",
            "n",
            "share_prefill",
            "prompt tokens prefilled",
            "prefill forwards",
            "forwards",
            "s / rollout",
        ]
        out.append(_md(head, rows))
    if "budget" in res:
        budgets = res["budget"]
        base = next(iter(budgets.values()))["useful_tok_s"]
        rows = [
            [
                "None (one-shot)" if b == "none" else b,
                f"{r['median_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['max_ms']:.1f}",
                f"{r['max_ms'] / r['median_ms']:.1f}",
                f"{r['ticks']:.0f}",
                f"{r['useful_tok_s']:.1f} ({r['useful_tok_s'] / base:.2f}x)",
            ]
            for b, r in budgets.items()
        ]
        head = [
            "max_prefill_tokens",
            "tick median ms",
            "p99 ms",
            "max ms",
            "max / median",
            "ticks",
            "useful tokens/s",
        ]
        out.append(_md(head, rows))
    return "\n\n".join(out)


def anchors(d: dict[str, Any]) -> str:
    out = []
    for key, r in d["results"].items():
        if not isinstance(r, dict):
            continue
        tok, sg, off = r["useful_tok_s"], r["shardgen"], r["shardgen_off"]
        base = tok.get("hybrid")
        rows = []
        for m, v in tok.items():
            x = f"{v / base:.2f}x" if base else "-"
            if m == "shardgen":
                pre = f"{sg['prefill_tokens']:.0f} (off: {off['prefill_tokens']:.0f})"
                fw = f"{sg['forwards']:.0f} (off: {off['forwards']:.0f})"
            else:
                pre, fw = f"{r['hf_prefill_tokens']:.0f}", f"{r['hf_forwards'][m]:.0f}"
            rows.append([m, _f(v), x, pre, fw])
        head = ["method", "useful tokens/s", "x hybrid", "prompt tokens prefilled", "forwards"]
        out.append(f"`{key.replace('|', '`, ')}:\n\n" + _md(head, rows))
    return "\n\n".join(out)


TABLES: dict[str, Table] = {
    "overhead": overhead,
    "skew": skew,
    "rollout": rollout,
    "hybrid": hybrid,
    "loading": loading,
    "train_pause": train_pause,
    "bench": bench,
    "tail": tail,
    "ds_decode": ds_decode,
    "gather_once": gather_once,
    "stationary": stationary,
    "sampling": sampling,
    "prefill": prefill,
    "anchors": anchors,
}


# The headline: (file in the folder, claim, the ratio from its JSON, earlier runs, command).
# "earlier runs" quotes the figures docs/PERFORMANCE.md and docs/history/performance-log.md record for the
# same claim; the lead's rerun adds one more.
def _x(a: float, b: float, nd: int = 2) -> str:
    return f"{a / b:.{nd}f}x"


def _bench_fw(d: dict[str, Any]) -> str:
    m = d["worlds"]["2"]["methods"]
    return _x(m["hf_synced"]["forwards"], m["sg_fsdp2"]["forwards"]) + (
        f" ({m['hf_synced']['forwards']} / {m['sg_fsdp2']['forwards']} forwards)"
    )


def _bench_once(d: dict[str, Any]) -> str:
    m = d["worlds"]["2"]["methods"]
    return f"{m['sg_fsdp2_once']['x_floor']:.2f} / {m['sg_ds_once']['x_floor']:.2f}"


def _tail(d: dict[str, Any]) -> str:
    b = d["results"]["bounded"]
    longest = max(f for r in b["longest"] for f in r["forwards"])
    first = max(f for r in b["input"] for f in r["forwards"])
    return f"{longest / first:.2f} ({longest} / {first} forwards, busiest rank)"


def _share(d: dict[str, Any]) -> str:
    s = d["results"]["share"]
    off, on = s["512-token prompts|n=4|share=False"], s["512-token prompts|n=4|share=True"]
    return (
        _x(off["seconds"], on["seconds"])
        + f" ({off['prefill_tokens']:.0f} -> {on['prefill_tokens']:.0f} tokens)"
    )


def _budget(d: dict[str, Any]) -> str:
    b = d["results"]["budget"]
    none, cap = b["none"], b["1024"]
    return (
        _x(none["max_ms"], cap["max_ms"], 1)
        + f" (tokens/s {cap['useful_tok_s'] / none['useful_tok_s']:.2f}x)"
    )


def _loading(d: dict[str, Any]) -> str:
    rows = {(r["backend"], r["method"]): r for r in d["rows"] if r["nproc"] == 2}
    parts = []
    for be in ("fsdp2", "deepspeed"):
        if (be, "full") in rows and (be, "sharded") in rows:
            full, sh = rows[be, "full"], rows[be, "sharded"]
            ratio = full["load_mb"] / sh["load_mb"]
            parts.append(f"{be} {ratio:.1f}x ({sh['load_mb']:.0f} MiB, bound {sh['bound_mb']:.0f})")
    return "; ".join(parts)


def _pause(d: dict[str, Any]) -> str:
    parts = []
    for mode, s in d.items():
        p = s["arms"]["paused"]
        ci = p["ratio_ci95"]
        parts.append(f"{mode} {p['ratio_median']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""))
    return "; ".join(parts)


def _anch(key: str) -> Callable[[dict[str, Any]], str]:
    def f(d: dict[str, Any]) -> str:
        t = d["results"][key]["useful_tok_s"]
        return _x(t["shardgen"], t["hybrid"])

    return f


def _stat(d: dict[str, Any]) -> str:
    t = d["tok_s"]
    st = t["stationary-fsdp2"]
    return f"{st / t['per-layer-fsdp2']:.2f}x per-layer, {st / t['local']:.2f}x `local`"


def _samp(d: dict[str, Any]) -> str:
    m = d["median"]
    return ", ".join(
        f"{m[f'old/{v}']['cpu_ms'] / m[f'new/{v}']['cpu_ms']:.1f}x at {v}"
        for v in (72, 32000)
        if f"old/{v}" in m
    )


@dataclass(frozen=True)
class Claim:
    file: str  # the JSON in headline.sh's folder
    section: int  # of docs/PERFORMANCE.md
    claim: str
    ratio: Callable[[dict[str, Any]], str]
    earlier: str  # the figures recorded before for the same claim (docs/history/performance-log.md)
    command: str  # as benchmarks/headline.sh runs it


def _ratio_over(key: str, num: str, den: str) -> Callable[[dict[str, Any]], str]:
    return lambda d: _x(d[key][num], d[key][den])


def _skew(d: dict[str, Any]) -> str:
    r = d["ratio_shardgen_over"]
    return f"{r['hf_synced']:.2f}x (`eos_token_id=None`: {r['hf_eos_none']:.2f}x)"


def _rollout(d: dict[str, Any]) -> str:
    t = d["useful_tok_s"]
    return (
        _x(t["shardgen"], t["trl_generate"]) + f" (`eos_token_id=None`: {_x(t['shardgen'], t['eos_none'])})"
    )


def _ds(d: dict[str, Any]) -> str:
    return " / ".join(f"{r['x_hf']['shardgen']:.2f}" for r in d["results"])


ANCHORS = "benchmarks/anchors.py --workloads toy medium --ns 4 --rounds 1"
BENCH = "shardgen bench --world-sizes 2"
# fmt: off
HEADLINE = [
    Claim("overhead", 1, "A tick costs next to nothing: shardgen / HF `synced_gpus`, same shapes",
          lambda d: f"{d['ratio']:.2f}x", "1.02-1.04 (3 runs)",
          "benchmarks/overhead.py --gather per-layer --rounds 4"),
    Claim("skew", 2, "Skewed answer lengths: shardgen / HF `synced_gpus`", _skew, "1.97x (2.74x), 1 run",
          "benchmarks/skew.py --gather per-layer --prompts 32 --rounds 2"),
    Claim("bench", 3, "Forwards: HF batched / shardgen's refill (exact counts)", _bench_fw,
          "2.04-2.06x (198 / 96 or 97: one shadow forward by timing)", BENCH),
    Claim("bench", 3, "`once` at the floor: wall time x `local`, fsdp2 / deepspeed", _bench_once,
          "0.95 / 0.86 idle; 0.71 / 3.39 loaded", BENCH),
    Claim("rollout", 4, "RL rollouts: shardgen / TRL's path (FSDP2)", _rollout,
          "4.06-4.13x (1.65-2.25x), 2 runs",
          "benchmarks/rollout_throughput.py --gather per-layer --prompts 32 --samples 2 --rounds 2"),
    Claim("anchors", 5, "ZeRO-3 rollouts: shardgen / `HybridEngineRollout`, toy, n=4", _anch("toy|n=4"),
          "1.23x (loaded), 4.49x", ANCHORS),
    Claim("anchors", 5, "the same, a model where per-row compute matters, n=4", _anch("medium|n=4"),
          "4.18-4.64x (3 runs)", ANCHORS),
    Claim("ds_decode", 6, "DeepSpeed per-layer step: shardgen x HF (lower is better), offload off / cpu",
          _ds, "0.56 / 0.36 (tiny); 0.60-0.70 (medium)",
          "benchmarks/ds_decode.py --sizes tiny --offload both --rounds 2"),
    Claim("gather_once", 7, "`once-fsdp2` x `local`, toy (target 0.9)",
          lambda d: f"{d['x_local']['once-fsdp2']:.2f}", "0.66, 0.74-0.84",
          "benchmarks/gather_once.py --rounds 2"),
    Claim("stationary_toy", 8, "`auto` (the default) / `per-layer` (the old default), toy",
          _ratio_over("tok_s", "auto", "per-layer"), "5.55x (loaded), 3.82x",
          "benchmarks/stationary.py --part toy --rounds 2"),
    Claim("stationary", 8, "Stationary decode, gather-bound model, pinned (targets 4x, 0.8x)", _stat,
          "3.0-3.3x, 0.80-0.90x (5 runs)",
          "benchmarks/stationary.py --part throughput --world 2 --rounds 2 --pin"),
    Claim("hybrid", 9, "Hybrid sharding, 4 ranks: 2x2 / 1x4", lambda d: f"{d['ratio']:.2f}x",
          "1.44-1.47x; 2.91x loaded", "benchmarks/hybrid.py --rounds 2"),
    Claim("tail", 10, "Batch job with known bounds: forwards, claim order `longest` / `input`", _tail,
          "0.58 (49 / 84)",
          "benchmarks/tail.py --prompts 400 --nproc 4 --rounds 1 --workloads bounded "
          "--extra --batch-size 16"),
    Claim("prefill_share", 11, "Shared prefill, 512-token prompts, n=4: time off / on", _share,
          "2.03x (n=8: 1.83x)",
          "benchmarks/prefill.py --part share --share-workloads 512-token --ns 4 --rounds 1"),
    Claim("prefill_budget", 11, "`max_prefill_tokens=1024`: worst tick, none / 1024", _budget,
          "7.1x (1.26x), 4.2x (0.98x)",
          "benchmarks/prefill.py --part budget --budgets none 1024 --rounds 2"),
    Claim("loading", 12, "Loading bf16 from fp32, 2 ranks: peak of a full copy / sharded", _loading,
          "5.7x / 5.7x", "benchmarks/loading.py --nproc 2 --methods full sharded --dtype bfloat16"),
    Claim("train_pause", 13, "A training step in `paused()` / with no engine (target 1.05)", _pause,
          "fsdp2 1.026-1.050, deepspeed 1.037-1.053",
          "benchmarks/train_pause.py --max-minutes 2.5 --until-ci 5"),
    Claim("sampling", 14, "Sampling step: row-by-row / batched (targets 10x, 3x)", _samp,
          "14.2-21.5x at 72, 3.1-7.7x at 32,000", "benchmarks/sampling.py --vocab 72,32000 --rounds 7"),
]
# fmt: on


def headline(folder: str) -> str:
    rows = []
    for c in HEADLINE:
        try:
            with open(os.path.join(folder, f"{c.file}.json"), encoding="utf-8") as f:
                value = c.ratio(json.load(f))
        except (OSError, KeyError, ValueError, ZeroDivisionError) as e:
            value = f"not run ({type(e).__name__})"
        rows.append([c.section, c.claim, value, c.earlier, f"`{c.command}`"])
    return _md(["§", "claim", "ratio (this run)", "earlier runs", "command"], rows)


_BLOCK = re.compile(r"(<!-- perf_tables: ([^>]*?) -->\n)(.*?)(<!-- /perf_tables -->)", re.S)


def fill(doc: str, folder: str) -> str:
    """``doc`` with each marked block re-rendered from ``folder``'s JSON (kept where it is missing)."""

    def one(m: re.Match[str]) -> str:
        what = m.group(2).split()
        if what[0] == "headline":
            body = headline(folder)
            run = os.path.join(folder, "run.txt")
            if os.path.exists(run):
                with open(run, encoding="utf-8") as f:
                    body += "\n\n" + f.read().strip()
        else:
            path = os.path.join(folder, what[1])
            if not os.path.exists(path):
                return m.group(0)
            with open(path, encoding="utf-8") as f:
                body = TABLES[what[0]](json.load(f))
        return m.group(1) + body + "\n" + m.group(4)

    return _BLOCK.sub(one, doc)


def main(argv: list[str]) -> int:
    if argv[:1] == ["fill"] and len(argv) == 3:
        with open(argv[1], encoding="utf-8") as f:
            text = fill(f.read(), argv[2])
        with open(argv[1], "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    if argv[:1] == ["--list"]:
        print("\n".join(TABLES))
        return 0
    if len(argv) != 2 or argv[0] not in [*TABLES, "headline"]:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "headline":
        print(headline(argv[1]))
        return 0
    with open(argv[1], encoding="utf-8") as f:
        print(TABLES[argv[0]](json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
