"""One GPU: what a context-parallel attention schedule's compute alone costs, before any link.

Each rank of a ring (or all-gather) schedule runs a list of block attentions (ring.py's plans)
and merges them by lse.  Here one GPU runs, for every rank of a simulated world in turn, that
rank's blocks exactly as the schedule would (local.attend_fwd + merge.merge_, attend_bwd +
the fp32 sums), with no communication.  The slowest rank bounds the schedule from below, so

    efficiency_bound = single_gpu_full_ms / (world * slowest_rank_ms)

is the best efficiency (issue 6's figure) the schedule can reach with perfectly hidden
transfers.  Also timed: the whole-sequence attention per local backend (flash, cuDNN,
memory-efficient, and SDPA's own pick), the backend that `auto` picks, and each backend's
numerics against an fp32 math reference on a small shape.

    python benchmarks/probe_attention_blocks.py OUTDIR [--seq 16384,32768,65536,131072] [--world 2,4]

Writes OUTDIR/attention_blocks_<card>x1_<date>.json/.md after every measurement (a run cut short
keeps what it measured) and prints one line per measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.common import result_stem, write_report  # noqa: E402
from torch_commopt.kernels.attention import local  # noqa: E402
from torch_commopt.kernels.attention.local import attend_bwd, attend_fwd, default_scale  # noqa: E402
from torch_commopt.kernels.attention.merge import Accumulator  # noqa: E402
from torch_commopt.kernels.attention.ring import GradRing, LocalSum, contiguous_plan, zigzag_plan  # noqa: E402
from torch_commopt.kernels.attention.schedules import _gathered_blocks  # noqa: E402

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn, repeats: int = 5, target_ms: float = 100.0) -> float:
    """Median ms of `fn` over `repeats` rounds of enough calls to fill ~target_ms."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    calls = max(1, min(50, int(target_ms / max(once, 1e-3))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / calls)
    return statistics.median(rounds)


def inputs(b, h, h_kv, s, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, h_kv, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v, dout


def full_sdpa(q, k, v, dout, causal: bool, backend: str | None, bwd: bool):
    """A closure running whole-sequence SDPA (fwd, or fwd+bwd) with one backend (None: its pick)."""
    leaves = [t.detach().requires_grad_(bwd) for t in (q, k, v)]

    def run():
        ctx = sdpa_kernel([SDPA[backend]]) if backend else torch.enable_grad()
        with ctx:
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
            if bwd:
                torch.autograd.grad(out, leaves, dout)
    return run


def rank_blocks(schedule: str, p: int, world: int, s_loc: int, causal: bool):
    """Rank p's blocks per step [[(query slice, key slice into the keys this rank sees, mask)]]
    (the all-gather schedule: one step), the keys a step sees, and the ring's plan (None for
    the all-gather schedule)."""
    if schedule == "allgather":
        return [[(slice(None), ks, mask) for ks, mask in _gathered_blocks(p, s_loc, causal)]], world * s_loc, None
    plan = (zigzag_plan if schedule == "ring_zigzag" else contiguous_plan)(causal)
    return [plan(p, (p - i) % world, world, s_loc) for i in range(world)], s_loc, plan  # keys: one rank's block


def rank_compute(q, k, v, dout, steps, scale, bwd: bool, backend: str = "auto", plan=None, rank: int = 0):
    """A closure doing rank p's block attentions and merges (and backward) as ring.py does:
    with a ring `plan`, the dK/dV sums of each step as ring.GradRing forms them (what arrives
    from the previous rank simulated by an uninitialized buffer of the hop's dtype); without,
    the all-gather schedule's fp32 sums."""
    blocks = [blk for step in steps for blk in step]
    n, p = len(steps), rank

    def run():
        acc = Accumulator(q, v.shape[-1], torch.float32)
        for j, (qs, ks, mask) in enumerate(blocks):
            acc.add(qs, *attend_fwd(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale=scale, mask=mask, backend=backend),
                    last=j == len(blocks) - 1)
        out, lse = acc.result()
        out = out.to(q.dtype)  # as ring_fwd returns it
        if not bwd:
            return
        dq, j = LocalSum(q, torch.float32), 0  # as ring_bwd
        dkv = GradRing(plan, n, q.shape[2], (k, v), None) if plan is not None else None
        sums = [torch.zeros_like(t, dtype=torch.float32) for t in (k, v)] if plan is None else None
        for i, step in enumerate(steps):
            terms = []
            for qs, ks, mask in step:
                g = attend_bwd(dout[:, :, qs], (q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                                lse[:, :, qs].contiguous()), scale=scale, mask=mask, backend=backend)
                dq.add(qs, g[0], last=j == len(blocks) - 1)
                terms.append((ks, g[1:]))
                j += 1
            if dkv is None:
                for ks, (dk_b, dv_b) in terms:
                    sums[0][:, :, ks].add_(dk_b)
                    sums[1][:, :, ks].add_(dv_b)
                continue
            s = (p - i) % n
            incoming = None if i == 0 else [torch.empty_like(t, dtype=dkv.dtype(s, i - 1)) for t in (k, v)]
            sums = dkv.step(i, s, incoming, terms)
        dq.result(q.dtype), sums[0].to(k.dtype), sums[1].to(v.dtype)  # the op's outputs
    return run


def numerics(record) -> None:
    """Each CUDA backend's block fwd/bwd against fp32 math, causal and full, GQA 4/2, S 1000."""
    q, k, v, dout = inputs(1, 4, 2, 1000, 128, seed=3)
    for mask in ("full", "causal"):
        truth = attend_fwd(q.float(), k.float(), v.float(), scale=0.09, mask=mask, backend="math")
        tg = attend_bwd(dout.float(), (q.float(), k.float(), v.float(), *truth), scale=0.09, mask=mask,
                        backend="math")
        for name in ("flash", "cudnn", "efficient", "flash_attn"):
            try:
                out, lse = attend_fwd(q, k, v, scale=0.09, mask=mask, backend=name)
                g = attend_bwd(dout, (q, k, v, out, lse), scale=0.09, mask=mask, backend=name)
            except Exception as e:  # noqa: BLE001  (a refusal or a kernel error is the finding)
                record({"kind": "numerics", "backend": name, "mask": mask, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            errs = {n: float((a.double() - b.double()).norm() / b.double().norm())
                    for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(g), truth + tuple(tg))}
            record({"kind": "numerics", "backend": name, "mask": mask, **errs})


def report(data: dict) -> str:
    """Markdown: per shape and pass the whole-sequence times per backend, and per world and
    schedule the slowest rank's compute and the efficiency bound."""
    m = data["meta"]
    lines = [f"# Attention block compute on one GPU ({m['device']})", "",
             f"torch {m['torch']}, cuDNN {m['cudnn']}, commit {m.get('commit', '?')}, {m.get('date', '?')}; "
             f"command: `{m.get('command', '?')}`", "",
             "Numerics (block fwd/bwd vs fp32 math, B1 H4/2 S1000 D128 bf16, rel. error):", "",
             "| backend | mask | out | lse | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
    for r in data["records"]:
        if r["kind"] == "numerics":
            cells = ([r.get("error", "")[:60]] if "error" in r
                     else [f"{r[k]:.1e}" for k in ("out", "lse", "dq", "dk", "dv")])
            lines.append(f"| {r['backend']} | {r['mask']} | " + " | ".join(cells) + " |")
    lines += ["", "Whole sequence on one GPU (ms) and each schedule's slowest rank computing alone "
              "(efficiency bound = full / (world x slowest)):", "",
              "| S_total | H/H_kv | causal | pass | sdpa | flash | cudnn | efficient | auto | world | schedule | "
              "slowest rank ms | bound |", "|" + "---|" * 13]
    full = {}
    for r in data["records"]:
        key = (r.get("S_total"), r.get("H"), r.get("H_kv"), r.get("causal"), r.get("pass"))
        if r["kind"] == "single_gpu":
            full[key] = r
        elif r["kind"] == "rank_compute":
            f = full.get(key, {"ms": {}, "auto": "?"})
            ms = [f"{f['ms'][b]:.2f}" if isinstance(f["ms"].get(b), float) else "-" for b in
                  ("sdpa", "flash", "cudnn", "efficient")]
            lines.append(f"| {r['S_total']} | {r['H']}/{r['H_kv']} | {r['causal']} | {r['pass']} | " + " | ".join(ms)
                         + f" | {f['auto']} | {r['world']} | {r['schedule']} | {max(r['per_rank_ms']):.2f} | "
                         f"{r['efficiency_bound']:.3f} |")
    return "\n".join(lines) + "\n"


def merge_cost(record) -> None:
    """The merge of one bf16 partial into an fp32 accumulator (B1 H32 S8K D128): the Triton
    kernel against the torch formula it replaced."""
    import importlib

    merge_mod = importlib.import_module("torch_commopt.kernels.attention.merge")  # the package exports a merge function
    from torch_commopt.kernels.attention import merge_triton

    out = torch.randn(1, 32, 8192, 128, device="cuda")
    lse = torch.randn(1, 32, 8192, device="cuda")
    out_b, lse_b = torch.randn_like(out).bfloat16(), torch.randn_like(lse)
    torch_ms = timed(lambda: merge_mod._merge_torch(out.clone(), lse.clone(), out_b, lse_b))
    triton_ms = timed(lambda: merge_triton.merge_(out.clone(), lse.clone(), out_b, lse_b))
    clone_ms = timed(lambda: (out.clone(), lse.clone()))
    record({"kind": "merge", "shape": [1, 32, 8192, 128], "torch_ms": torch_ms - clone_ms,
            "triton_ms": triton_ms - clone_ms})


def profile(out: pathlib.Path, s_total: int, h: int, h_kv: int) -> None:
    """torch.profiler's kernel tables of ring_zigzag's two ranks (world 2, causal), forward
    alone and forward+backward, on contiguous per-rank shards (what the op gets), and the
    cuDNN forward on a sequence slice of q with and without a contiguous copy."""
    q, k, v, dout = (t[:, :, : s_total // 2].contiguous() for t in inputs(1, h, h_kv, s_total, 128))
    s_loc, scale, text = s_total // 2, default_scale(128, None), []
    for p in (0, 1):
        steps, _, plan = rank_blocks("ring_zigzag", p, 2, s_loc, True)
        for bwd in (False, True):
            run = rank_compute(q, k, v, dout, steps, scale, bwd, plan=plan, rank=p)
            run()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
            wall = timed(run, repeats=3)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=80)
            text.append(f"## ring_zigzag rank {p}, world 2, S_total {s_total}, H {h}/{h_kv}, causal "
                        f"{'fwd+bwd' if bwd else 'fwd'}: {wall:.3f} ms per call; profile of 3 calls\n"
                        f"blocks {steps}\n{table}")
            print(text[-1], flush=True)
    # cuDNN on a strided sequence slice (the zigzag s > p block's queries) vs a contiguous copy
    c = s_loc // 2
    fused_cudnn = local.backends()["cudnn"].fwd
    ref = fused_cudnn(q[:, :, c:].contiguous(), k, v, scale, False)
    try:
        strided = torch.ops.aten._scaled_dot_product_cudnn_attention(q[:, :, c:], k, v, None, True, 0.0, False, False,
                                                                      scale=scale)
        err = float((strided[0].float() - ref[0].float()).norm() / ref[0].float().norm())
        t_strided = timed(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q[:, :, c:], k, v, None, True, 0.0, False, False, scale=scale))
        msg = f"strided q slice: rel err {err:.2e} vs contiguous, out strides {strided[0].stride()}, {t_strided:.3f} ms"
    except Exception as e:  # noqa: BLE001
        msg = f"strided q slice refused: {type(e).__name__}: {str(e)[:200]}"
    t_contig = timed(lambda: fused_cudnn(q[:, :, c:].contiguous(), k, v, scale, False))
    t_causal = timed(lambda: fused_cudnn(q, k, v, scale, True))
    text.append(f"## cuDNN fwd pieces (S_loc {s_loc}): {msg}; contiguous copy + kernel {t_contig:.3f} ms; "
                f"causal S_loc x S_loc {t_causal:.3f} ms")
    print(text[-1], flush=True)
    text.append(gqa_native_check(scale))
    print(text[-1], flush=True)
    (out / "attention_profile.txt").write_text("\n\n".join(text) + "\n")


def gqa_native_check(scale: float) -> str:
    """Whether aten's cuDNN ops take K/V with fewer heads than q (H_kv < H) directly, and
    their result and time against the expanded K/V our adapter passes today."""
    q, k, v, dout = inputs(1, 32, 8, 8192, 128, seed=4)
    expanded = [t.repeat_interleave(4, dim=1) for t in (k, v)]
    zero = torch.zeros((), dtype=torch.int64, device="cuda")
    aten = torch.ops.aten

    def fwd(kk, vv):
        return aten._scaled_dot_product_cudnn_attention(q, kk, vv, None, True, 0.0, True, False, scale=scale)

    def bwd(kk, vv, res):
        return aten._scaled_dot_product_cudnn_attention_backward(dout, q, kk, vv, res[0], res[1], zero, zero, None,
                                                                  None, None, 8192, 8192, 0.0, True, scale=scale)
    ref = fwd(*expanded)
    ref_g = bwd(*expanded, ref)
    try:
        got = fwd(k, v)
        got_g = bwd(k, v, got)
    except Exception as e:  # noqa: BLE001  (a refusal is the finding)
        return f"## cuDNN GQA native (H 32 / H_kv 8, S 8192, causal): refused: {type(e).__name__}: {str(e)[:300]}"
    err = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    folded = [g.float().view(1, 8, 4, 8192, 128).sum(2) for g in ref_g[1:]]
    msg = (f"out err {err(got[0], ref[0]):.2e}, dq {err(got_g[0], ref_g[0]):.2e}, dk {err(got_g[1], folded[0]):.2e}, "
           f"dv {err(got_g[2], folded[1]):.2e}; dk shape {tuple(got_g[1].shape)}")
    t_native = timed(lambda: bwd(k, v, fwd(k, v)))
    t_expanded = timed(lambda: bwd(*[t.repeat_interleave(4, dim=1) for t in (k, v)],
                                   fwd(*[t.repeat_interleave(4, dim=1) for t in (k, v)])))
    return (f"## cuDNN GQA native (H 32 / H_kv 8, S 8192, causal): {msg}; fwd+bwd {t_native:.3f} ms native vs "
            f"{t_expanded:.3f} ms with expanded K/V (expansion included, fold not)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seq", default="16384,32768,65536,131072")
    ap.add_argument("--world", default="2,4")
    ap.add_argument("--heads", default="32/32,32/8")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--commit", default="?")
    ap.add_argument("--profile", action="store_true", help="kernel table of one zigzag rank (first --seq)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, t_start = [], time.perf_counter()

    def record(r):
        records.append(r)
        print(json.dumps(r), flush=True)
        data = {"meta": meta, "records": records}
        write_report(out, result_stem("attention_blocks", meta["device"], 1, meta["date"]), data, report(data))

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "commit": args.commit,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    numerics(record)
    merge_cost(record)
    if args.profile:
        profile(out, int(args.seq.split(",")[0]), 32, 32)
    b, d = 1, 128
    for s_total in (int(x) for x in args.seq.split(",")):
        for heads in args.heads.split(","):
            h, h_kv = (int(x) for x in heads.split("/"))
            q, k, v, dout = inputs(b, h, h_kv, s_total, d)
            for causal in (True, False):
                if time.perf_counter() - t_start > args.budget_s:
                    record({"kind": "stopped", "reason": f"budget {args.budget_s} s spent"})
                    return
                shape = {"B": b, "H": h, "H_kv": h_kv, "D": d, "S_total": s_total, "causal": causal}
                auto = local.pick(q, k).name
                for bwd in (False, True):
                    full = {}
                    for name in (None, "flash", "cudnn", "efficient"):
                        try:
                            full[name or "sdpa"] = timed(full_sdpa(q, k, v, dout, causal, name, bwd))
                        except Exception as e:  # noqa: BLE001
                            full[name or "sdpa"] = f"{type(e).__name__}: {str(e)[:160]}"
                    record({"kind": "single_gpu", **shape, "pass": "fwd+bwd" if bwd else "fwd", "auto": auto,
                            "ms": full})
                    best_full = min(x for x in full.values() if isinstance(x, float))
                    for world in (int(x) for x in args.world.split(",")):
                        s_loc = s_total // world
                        scale = default_scale(d, None)
                        for sched in ("allgather", "ring", "ring_zigzag"):
                            per_rank = []
                            for p in range(world):
                                steps, s_k, plan = rank_blocks(sched, p, world, s_loc, causal)
                                shard = [t[:, :, :n].contiguous() for t, n in ((q, s_loc), (k, s_k), (v, s_k),
                                                                              (dout, s_loc))]
                                per_rank.append(timed(rank_compute(*shard, steps, scale, bwd, plan=plan, rank=p),
                                                      repeats=3))
                                if not causal:
                                    per_rank *= world  # every rank does the same work
                                    break
                            slowest = max(per_rank)
                            record({"kind": "rank_compute", **shape, "pass": "fwd+bwd" if bwd else "fwd",
                                    "world": world, "schedule": sched, "per_rank_ms": per_rank,
                                    "single_gpu_full_ms": best_full,
                                    "efficiency_bound": best_full / (world * slowest)})
            del q, k, v, dout
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
