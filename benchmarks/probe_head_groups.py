"""One GPU: what Ulysses's head groups cost the local attention kernels, MHA against GQA.

bench_attention (2x H200, session 46) measured `ulysses` at 16K tokens, causal fwd+bwd, 0.49 ms
over half the single-GPU time with MHA (32/32) and 0.74 ms with GQA (32/8), though GQA moves
less data and its whole-sequence kernel is ~2% faster than MHA's.  After the all-to-all a rank
of W runs H/W query heads (H_kv/W key heads) over the whole sequence, in G head groups of
H/(W G) and H_kv/(W G) heads.  This times, on one GPU with no link, one rank's kernels exactly
as the schedule calls them (local.attend_fwd / attend_bwd, the `auto` backend), per G, against
the whole-sequence kernels over W: where the group form is slower than 1/W of the whole, the
difference is a kernel cost no transfer schedule can hide.

    python benchmarks/probe_head_groups.py OUTDIR [--seq 16384,32768] [--heads 32/32,32/8]
        [--world 2] [--groups 1,2,4] [--splits 1:3,1:2:1]

Variants per (heads, seq): "whole" (B, H, S) once, divided by W; "g<G>" the rank's G groups in
turn on one stream; "g<G>x" the same with K/V expanded to the query heads inside the rank (the
link still carries H_kv heads; the expanded dK/dV summed back per key head) -- GQA only;
"s<a>-<b>..." uneven groups, the rank's heads split in the ratio a:b:... (session 52: what a
small first / last group, which would halve the exposed first and last transfers, costs the
kernels; a split whose query or key heads do not divide is skipped).
Writes OUTDIR/head_groups.json and prints one line per measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
from probe_attention_blocks import timed  # noqa: E402

from torch_commopt.attention.local import attend_bwd, attend_fwd, default_scale, pick  # noqa: E402


def _ms(fn) -> float:
    """Median ms per call of fn (probe_attention_blocks.timed: rounds of back-to-back calls)."""
    return timed(fn, repeats=7, target_ms=60.0)


def tensors(h: int, h_kv: int, s: int, d: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, h_kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v, dout


def passes(groups: list[tuple], scale: float, expand: bool):
    """(fwd, bwd) closures over the groups' tensors, one stream, in turn; the backward takes the
    forward's out and lse, as the kept training form does."""
    kept = []
    for q, k, v, dout in groups:
        rep = q.shape[1] // k.shape[1]
        kx, vx = (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if expand else (k, v)
        out, lse = attend_fwd(q, kx, vx, scale=scale, mask="causal")
        kept.append((q, k, v, kx, vx, dout, out, lse, rep))

    def fwd():
        for q, k, v, kx, vx, _, _, _, rep in kept:
            if expand:  # the expansion is part of the group's work
                kx, vx = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            attend_fwd(q, kx, vx, scale=scale, mask="causal")

    def bwd():
        for q, k, v, kx, vx, dout, out, lse, rep in kept:
            dq, dk, dv = attend_bwd(dout, q, kx, vx, out, lse, scale=scale, mask="causal")
            if expand and rep > 1:
                dk = dk.unflatten(1, (k.shape[1], rep)).sum(2)
                dv = dv.unflatten(1, (v.shape[1], rep)).sum(2)
    return fwd, bwd


def uneven(hq: int, hk: int, weights: list[int]) -> list[tuple[int, int]] | None:
    """(query heads, key heads) per group: a rank's hq / hk heads in the ratio `weights`, or
    None where either count does not divide."""
    total = sum(weights)
    if total <= 0 or hq % total or hk % total:
        return None
    return [(hq * w // total, hk * w // total) for w in weights]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seq", default="16384,32768")
    ap.add_argument("--heads", default="32/32,32/8")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--splits", default="", help="uneven head groups, e.g. 1:3,1:2:1 (ratios of the rank's heads)")
    ap.add_argument("--head-dim", dest="head_dim", type=int, default=128)
    ap.add_argument("--commit", default="?")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w, d = args.world, args.head_dim
    records = []
    for s in (int(x) for x in args.seq.split(",")):
        for pair in args.heads.split(","):
            h, h_kv = (int(x) for x in pair.split("/"))
            scale = default_scale(d, None)
            whole = tensors(h, h_kv, s, d, seed=1)
            f, b = passes([whole], scale, expand=False)
            base = {"fwd": _ms(f) / w, "bwd": _ms(b) / w}
            rec = {"H": h, "H_kv": h_kv, "S": s, "D": d, "world": w,
                   "backend": pick(whole[0], whole[1]).name, "whole_over_w_ms": base}
            del whole, f, b
            for g in (int(x) for x in args.groups.split(",")):
                if h % (w * g) or h_kv % (w * g):
                    continue
                for expand in ((False, True) if h_kv < h else (False,)):
                    groups = [tensors(h // (w * g), h_kv // (w * g), s, d, seed=10 + i) for i in range(g)]
                    f, b = passes(groups, scale, expand)
                    name = f"g{g}{'x' if expand else ''}"
                    ms = {"fwd": _ms(f), "bwd": _ms(b)}
                    rec[name] = ms
                    print(f"S {s} H {h}/{h_kv} {name}: fwd {ms['fwd']:.3f} ({ms['fwd'] / base['fwd']:.3f}x whole/W) "
                          f"bwd {ms['bwd']:.3f} ({ms['bwd'] / base['bwd']:.3f}x); whole/W fwd {base['fwd']:.3f} "
                          f"bwd {base['bwd']:.3f}", flush=True)
                    del groups, f, b
            for split in (x for x in args.splits.split(",") if x):
                sizes = uneven(h // w, h_kv // w, [int(x) for x in split.split(":")])
                if sizes is None:
                    continue
                groups = [tensors(hq, hk, s, d, seed=30 + i) for i, (hq, hk) in enumerate(sizes)]
                f, b = passes(groups, scale, expand=False)
                name = "s" + split.replace(":", "-")
                ms = rec[name] = {"fwd": _ms(f), "bwd": _ms(b), "heads": sizes}
                print(f"S {s} H {h}/{h_kv} {name} {sizes}: fwd {ms['fwd']:.3f} ({ms['fwd'] / base['fwd']:.3f}x "
                      f"whole/W) bwd {ms['bwd']:.3f} ({ms['bwd'] / base['bwd']:.3f}x)", flush=True)
                del groups, f, b
            records.append(rec)
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit,
            "cudnn": torch.backends.cudnn.version()}
    (out / "head_groups.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
