"""One GPU: the per-rank compute of FlexAttention's ring schedule against the whole-sequence kernel (issue 70).

The bound that no transfer can beat: rank p of W computes its rows against every source's keys,
and the whole-sequence kernel computes every row against every key in one call.  Two ways of the
rank's (kernels/attention/flex.py: the cut block mask, one compiled kernel per direction):
- `ring`: block by block, one call per source with a kept tile, merged by LSE (flex_ring.py);
- `allgather`: one call of its rows against every key (flex_allgather.py, one head group).
Their work rates (tiles a millisecond) are compared with the whole kernel's, forward and
backward, for the last rank (the causal masks' busiest), with the forward checked against the
whole kernel's rows and dq against the whole backward's.  Masks: causal, documents of mean 1K / 4K / 16K tokens (lengths
drawn uniformly from [mean / 4, 7 mean / 4]), a 4K sliding window; bf16, B 1, H 32, H_kv 8, D 128.

    python3 -m benchmarks.probe_flex_blocks --out OUT [--seq 16384,32768] [--world 2] [--commit abc]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import fmt, machine_meta, result_stem, write_report

MASKS = ("causal", "docs 1K", "docs 4K", "docs 16K", "window 4K")
B, H, H_KV, D, BLOCK = 1, 32, 8, 128, 128


def documents(seq: int, mean: int, device) -> torch.Tensor:
    """Document ids over `seq` tokens, lengths uniform in [mean / 4, 7 mean / 4], seeded."""
    gen = torch.Generator().manual_seed(seq + mean)
    ids, pos, doc = torch.zeros(seq, dtype=torch.int32), 0, 0
    while pos < seq:
        pos += int(torch.randint(mean // 4, 7 * mean // 4 + 1, (1,), generator=gen))
        doc += 1
        ids[pos:] = doc
    return ids.to(device)


def tokens(text: str) -> int:
    """'4K' -> 4096, '256' -> 256."""
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def mask_mod(kind: str, seq: int, device):
    """causal, "docs N" (documents of mean N tokens, causal within each), "window N" (causal, N back)."""
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    name, size = kind.split()
    if name == "window":
        width = tokens(size)
        return lambda b, h, q, kv: (q >= kv) & (q - kv < width)
    if name != "docs":
        raise ValueError(f"unknown mask {kind!r} (causal, docs N, window N)")
    ids = documents(seq, tokens(size), device)
    return lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)


# GPU cycles of busy-waiting queued before each timed call (~1.5 ms on an H200): the host queues
# the call's kernels meanwhile, so the events time the device's work alone.  Without it a call of
# under a millisecond also counts its host time (0.1-0.15 ms a flex call, the same for the whole
# kernel and a rank's), which understates the ratios of the short masks' calls.
HOST_AHEAD_CYCLES = 3_000_000


def _ms(fn, reps: int) -> float:
    """Device ms of fn(): the median of `reps` calls, each queued behind a busy-wait."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Preloaded:
    """comm.ring_shift's interface over tensors already in place (no transfer): step i's current()
    is per_step[i]; each wait() moves to the next."""

    def __init__(self, per_step: list) -> None:
        self.per_step, self.i = per_step, 0

    def current(self) -> list:
        return self.per_step[self.i]

    def start(self) -> None:
        pass

    def wait(self) -> None:
        self.i += 1

    def finish(self) -> None:
        pass


def case(kind: str, seq: int, world: int, reps: int) -> dict:
    """One mask and length: the rank's and the whole kernel's ms and tiles, forward and backward."""
    from torch.nn.attention import flex_attention as fa

    from torch_commopt.kernels.attention import flex, flex_ring

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seq)
    q = torch.randn(B, H, seq, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, H_KV, seq, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn(B, H, seq, D, device=dev, dtype=torch.bfloat16, generator=gen)
    whole_mask = fa.create_block_mask(mask_mod(kind, seq, dev), None, None, seq, seq, device=dev, BLOCK_SIZE=BLOCK)
    blocks = flex.Blocks.of(whole_mask)
    scale, length, p = D ** -0.5, seq // world, world - 1
    rows = slice(p * length, (p + 1) * length)
    whole = torch.compile(fa.flex_attention, dynamic=False)
    aux = fa.AuxRequest(lse=True)

    def whole_fwd():
        return whole(q, k, v, block_mask=whole_mask, scale=scale, enable_gqa=True, return_aux=aux)

    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def whole_fwd_bwd():
        qa.grad = ka.grad = va.grad = None
        out, _ = whole(qa, ka, va, block_mask=whole_mask, scale=scale, enable_gqa=True, return_aux=aux)
        out.backward(dout)

    ring = flex_ring.RankBlocks(*flex_ring.steps_of(blocks, world, p), scale, p, world)
    live = [s for s in range(world) if ring.extents[s] is not None]
    keys = [(k[:, :, s * length:(s + 1) * length].contiguous(), v[:, :, s * length:(s + 1) * length].contiguous())
            for s in range(world)]
    q_rows, dout_rows = q[:, :, rows].contiguous(), dout[:, :, rows].contiguous()
    sums = [[torch.zeros(B, H_KV, length, D, device=dev) for _ in range(2)] for _ in range(world + 1)]
    t0 = time.perf_counter()
    out_w, aux_w = whole_fwd()
    out_rows, lse_rows = out_w[:, :, rows].contiguous(), aux_w.lse[:, :, rows].float().contiguous()

    def rank_fwd():  # the ring's own compute (flex_ring.forward_blocks), its K/V in place
        return flex_ring.forward_blocks(q_rows, D, Preloaded([keys[s] for s in ring.order()]), ring)

    def rank_bwd():
        saved = flex_ring.Saved(q_rows, *keys[p], out_rows, lse_rows)
        return flex_ring.backward_blocks(saved, dout_rows, (Preloaded([keys[s] for s in ring.order()]),
                                                            Preloaded(sums)), ring)

    every = flex.step_mask(blocks, p, None, world)

    def gather_fwd():
        return flex.block_forward(q_rows, k, v, every, scale)

    def gather_bwd():
        return flex.block_backward(q_rows, k, v, out_rows, lse_rows, dout_rows, every, scale)

    acc, lse = rank_fwd()
    dq = rank_bwd()[0].float()
    gathered_out, _ = gather_fwd()
    gathered_dq = gather_bwd()[0].float()
    whole_fwd_bwd()
    compile_s = time.perf_counter() - t0
    fwd_whole, both_whole = _ms(whole_fwd, reps), _ms(whole_fwd_bwd, reps)
    fwd_rank, bwd_rank = _ms(rank_fwd, reps), _ms(rank_bwd, reps)
    fwd_gather, bwd_gather = _ms(gather_fwd, reps), _ms(gather_bwd, reps)
    torch.cuda.synchronize()
    host = time.perf_counter()
    cut = [flex.step_mask(blocks, p, s, world) for s in range(world)]  # what a call builds for a new mask
    flex.extents(cut)
    steps_ms = (time.perf_counter() - host) * 1e3
    host = time.perf_counter()
    flex_ring.steps_of(blocks, world, p)  # what a call with a mask already cut (another layer's) finds
    cached_ms = (time.perf_counter() - host) * 1e3
    balanced = layouts(kind, seq, world, reps, [q, k, v, dout, out_w, aux_w.lse])
    own_step = ring.steps[p] if ring.extents[p] is not None else None
    kernels = {"whole fwd+bwd": _kernels(whole_fwd_bwd, reps), "rows, every key bwd": _kernels(gather_bwd, reps)}
    if own_step is not None:  # the rank's rows against its own share's keys alone: no key block left empty
        kernels["rows, own keys bwd"] = _kernels(lambda: flex.block_backward(
            q_rows, *keys[p], out_rows, lse_rows, dout_rows, own_step, scale), reps)
    tiles_whole = int(blocks.kv_num.sum()) + int(blocks.full_num.sum())
    tiles_rank = sum(ring.extents[s].tiles for s in live)
    return {"mask": kind, "seq": seq, "world": world, "rank": p, "tiles_whole": tiles_whole, "tiles_rank": tiles_rank,
            "blocks_computed": len(live), "ms": {"whole fwd": fwd_whole, "whole bwd": both_whole - fwd_whole,
                                                 "rank fwd": fwd_rank, "rank bwd": bwd_rank,
                                                 "allgather fwd": fwd_gather, "allgather bwd": bwd_gather},
            "fwd_error": float((acc.float() - out_rows.float()).abs().max()),
            "allgather_fwd_error": float((gathered_out.float() - out_rows.float()).abs().max()),
            "allgather_dq_error": float((gathered_dq - qa.grad[:, :, rows].float()).abs().max()),
            "lse_error": float((lse - lse_rows)[torch.isfinite(lse_rows)].abs().max()),
            "dq_error": float((dq - qa.grad[:, :, rows].float()).abs().max()),
            "dq_scale": float(qa.grad[:, :, rows].float().abs().max()), "compile_s": compile_s,
            "steps_host_ms": steps_ms, "steps_cached_ms": cached_ms, "layouts": balanced, "kernels": kernels,
            "tiles_own": ring.extents[p].tiles if own_step is not None else None}


def _kernels(fn, reps: int) -> dict:
    """Device ms a call of each CUDA kernel fn() launches, by name (the profiler's, over `reps` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name] = total.get(e.name, 0.0) + e.device_time_total / 1e3 / reps
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def layouts(kind: str, seq: int, world: int, reps: int, tensors: list) -> dict:
    """Every rank's all-gather compute (one call of its rows against every key) on the contiguous
    layout and on balance.choose's: {layout: {"tiles": per rank,
    "fwd": per rank ms, "bwd": ..., "ring": the ring's calls summed, "own": contiguous only}}; the
    ring's calls on every layout but by_work (whose scattered blocks reach every source).
    tensors: q, k, v, dout, and the whole kernel's out and lse (the backward's global rows)."""
    from torch.nn.attention import flex_attention as fa

    from torch_commopt.kernels.attention import balance, flex

    dev = tensors[0].device
    mod = mask_mod(kind, seq, dev)
    whole_mask = fa.create_block_mask(mod, None, None, seq, seq, device=dev, BLOCK_SIZE=BLOCK)
    rows = balance.row_work(whole_mask)
    dealt = [balance.contiguous(rows.numel(), world, BLOCK), balance.choose(whole_mask, world)]
    out = {}
    for lay in {lay.name: lay for lay in dealt}.values():
        # the mask over layout positions for every layout (one compiled kernel: the same mask code)
        blocks = flex.Blocks.of(fa.create_block_mask(lay.mask_mod(mod, dev), None, None, seq, seq, device=dev,
                                                     BLOCK_SIZE=BLOCK))
        q, k, v, dout, o, lse = (lay.rearrange(t, 2) for t in tensors)
        ranks = [_rank_times(blocks, p, world, (q, k, v, dout, o, lse.float()), reps, per_source=lay.name != "by_work")
                 for p in range(world)]
        out[lay.name] = {"tiles": lay.rank_work(rows), "fwd": [r["fwd"] for r in ranks], "bwd": [r["bwd"] for r in ranks]}
        if ranks[0].get("ring"):
            out[lay.name]["ring"] = {d: [sum(r["ring"][d]) for r in ranks] for d in ("fwd", "bwd")}
        if lay.name == "contiguous":
            out[lay.name]["own"] = {d: [r["ring"][d][0] for r in ranks] for d in ("fwd", "bwd")}
    return out


def _rank_times(blocks, p: int, world: int, tensors: tuple, reps: int, per_source: bool) -> dict:
    """Rank p's compute on a layout: its rows against every key in one call (fwd, bwd ms), and with
    per_source the ring's: its rows against each source's keys that its tiles reach, one call a
    source, its own first ({"ring": {"fwd": [ms a source], "bwd": [...]}}; merges not included).
    tensors: q, k, v, dout and the whole kernel's out and lse (natural log), in layout order."""
    from torch_commopt.kernels.attention import flex

    q, k, v, dout, o, lse = tensors
    scale, length = D ** -0.5, q.shape[2] // world
    mine = slice(p * length, (p + 1) * length)
    q_p, dout_p, o_p, lse_p = (t[:, :, mine].contiguous() for t in (q, dout, o, lse))
    step = flex.step_mask(blocks, p, None, world)
    got = {"fwd": _ms(lambda: flex.block_forward(q_p, k, v, step, scale), reps),
           "bwd": _ms(lambda: flex.block_backward(q_p, k, v, o_p, lse_p, dout_p, step, scale), reps)}
    if per_source:
        got["ring"] = {"fwd": [], "bwd": []}
        for s in [(p - i) % world for i in range(world)]:
            cut = flex.step_mask(blocks, p, s, world)
            if s != p and flex.extents([cut])[0] is None:
                continue  # no tile: the ring computes nothing
            keys = slice(s * length, (s + 1) * length)
            k_s, v_s = k[:, :, keys].contiguous(), v[:, :, keys].contiguous()
            got["ring"]["fwd"].append(_ms(lambda: flex.block_forward(q_p, k_s, v_s, cut, scale), reps))
            got["ring"]["bwd"].append(_ms(lambda: flex.block_backward(q_p, k_s, v_s, o_p, lse_p, dout_p, cut, scale),
                                          reps))
    return got


def derive(cases: list) -> list:
    """Each case's work-rate ratios (rank tiles per ms over the whole kernel's), from the raw times."""
    for c in cases:
        ms = c["ms"]
        for d in ("fwd", "bwd"):
            whole_rate = c["tiles_whole"] / ms[f"whole {d}"]
            c[f"{d}_ratio"] = (c["tiles_rank"] / ms[f"rank {d}"]) / whole_rate
            if f"allgather {d}" in ms:
                c[f"allgather_{d}_ratio"] = (c["tiles_rank"] / ms[f"allgather {d}"]) / whole_rate
        for lay in c.get("layouts", {}).values():
            # the efficiency no transfer can beat: the whole kernel over W times the busiest rank
            both = [f + b for f, b in zip(lay["fwd"], lay["bwd"], strict=True)]
            lay["bound"] = {"fwd": ms["whole fwd"] / (c["world"] * max(lay["fwd"])),
                            "bwd": ms["whole bwd"] / (c["world"] * max(lay["bwd"])),
                            "fwd+bwd": (ms["whole fwd"] + ms["whole bwd"]) / (c["world"] * max(both))}
            for key, name in (("own", "alone"), ("ring", "ring")):
                if key in lay:  # own: every rank's share alone, the kernel's own scaling from S to S / W tokens
                    each = [f + b for f, b in zip(lay[key]["fwd"], lay[key]["bwd"], strict=True)]
                    lay["bound"][name] = (ms["whole fwd"] + ms["whole bwd"]) / (c["world"] * max(each))
    return cases


def report(cases: list, meta: dict) -> str:
    lines = [f"# FlexAttention CP: per-rank compute against the whole-sequence kernel ({meta['device']})", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}. bf16, B {B}, H {H}, H_kv {H_KV}, D {D}, "
             f"{BLOCK}-token blocks; default kernels; "
             f"the last rank of W; ms: device time, the median of {meta['rounds']} calls, each "
             "queued behind a busy-wait (the host's time is not in it). Ratio: the rank's tiles "
             "per ms over the whole kernel's (1.0: the blocks run at the whole kernel's rate; the issue asks >= 0.95 "
             "at >= 8K tokens a rank).", "",
             "| mask | seq | W | tiles whole / rank | ring blocks | whole fwd ms | ring fwd ms | ring fwd ratio "
             "| allgather fwd ms | allgather fwd ratio | whole bwd ms | ring bwd ms | ring bwd ratio | allgather bwd ms "
             "| allgather bwd ratio | fwd err | dq err / max |dq| | ring's blocks, host ms: cut / cached |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        ms = c["ms"]
        errors = [c["fwd_error"], c.get("allgather_fwd_error", 0.0)], [c["dq_error"], c.get("allgather_dq_error", 0.0)]
        lines.append(f"| {c['mask']} | {c['seq']} | {c['world']} | {c['tiles_whole']} / {c['tiles_rank']} | "
                     f"{c['blocks_computed']} | {fmt(ms['whole fwd'], 3)} | {fmt(ms['rank fwd'], 3)} | "
                     f"{fmt(c['fwd_ratio'], 3)} | {fmt(ms.get('allgather fwd'), 3)} | {fmt(c.get('allgather_fwd_ratio'), 3)} | "
                     f"{fmt(ms['whole bwd'], 3)} | {fmt(ms['rank bwd'], 3)} | {fmt(c['bwd_ratio'], 3)} | "
                     f"{fmt(ms.get('allgather bwd'), 3)} | {fmt(c.get('allgather_bwd_ratio'), 3)} | "
                     f"{max(errors[0]):.1e} | {max(errors[1]):.1e} / {c['dq_scale']:.1e} | {fmt(c.get('steps_host_ms'), 2)} / "
                     f"{fmt(c.get('steps_cached_ms'), 3)} |")
    lines += ["", "The whole backward is the compiled fwd+bwd minus the forward (AOT autograd's compiled backward); "
              "the rank's backward is one make_fx + Inductor kernel per call (flex.block_backward). Errors: the larger of "
              "the two schedules'. Host ms: building the ring's blocks (the cut tables and their extents) for a new mask, and "
              "finding them cut for a mask another layer's call cut (flex.cached).", ""]
    lines += ["## The layouts: every rank's all-gather compute", "",
              "Each rank's rows against every key in one call (the all-gather schedule's compute), on the contiguous "
              "layout and on balance.choose's, both with the mask stated over layout positions. Bound: the whole "
              "kernel's ms over W times the busiest rank's, the efficiency no transfer can beat (the 2-GPU target is "
              ">= 0.90). Shares alone (contiguous only): each rank's rows against its own share's keys and nothing "
              "else, the whole kernel over W times the slowest share -- what the kernel itself loses going from S to "
              "S / W tokens: for documents cut at the shares' ends, the bound of a schedule that sends nothing. "
              "Ring (every layout but by_work): each rank's rows against each source's keys its tiles reach, one "
              "call a source (the ring's compute, its merges not included), the same bound over those calls.", "",
              "| mask | seq | W | layout | tiles per rank | busiest fwd ms | busiest bwd ms | bound fwd | bound bwd "
              "| bound fwd+bwd | shares alone fwd+bwd | ring fwd+bwd |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        for name, lay in c.get("layouts", {}).items():
            b = lay["bound"]
            lines.append(f"| {c['mask']} | {c['seq']} | {c['world']} | {name} | {' / '.join(map(str, lay['tiles']))} | "
                         f"{fmt(max(lay['fwd']), 3)} | {fmt(max(lay['bwd']), 3)} | {fmt(b['fwd'], 3)} | "
                         f"{fmt(b['bwd'], 3)} | {fmt(b['fwd+bwd'], 3)} | {fmt(b.get('alone'), 3)} | "
                         f"{fmt(b.get('ring'), 3)} |")
    lines += ["", "## Where the rank's backward goes: its kernels", "",
              "Device ms a call by kernel (the profiler's, the mean over "
              f"{meta['rounds']} calls): the backward's main kernel (flex's template: dK/dV programs per key block, "
              "dQ programs per row block) and the rest (its delta of out and dout, the conversions). Rows, every key: "
              "the all-gather's call of the last rank's rows against the whole sequence's keys; rows, own keys: the "
              "same rows against their own share's keys alone (the key blocks no row reaches gone: the tiles of "
              "documents crossing into the share before are not in it). Rate: tiles a ms of the main kernel over "
              "the whole backward's main kernel's.", "",
              "| mask | seq | W | whole bwd main ms | rest ms | rows, every key: main ms | rest ms | rate | "
              "rows, own keys: tiles | main ms | rate |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if "kernels" not in c:
            continue
        parts = {name: _main_and_rest(ks) for name, ks in c["kernels"].items()}
        whole_rate = c["tiles_whole"] / parts["whole fwd+bwd"][0]
        every, own = parts["rows, every key bwd"], parts.get("rows, own keys bwd")
        own_cells = ("- | - | -" if own is None else
                     f"{c['tiles_own']} | {fmt(own[0], 3)} | {fmt(c['tiles_own'] / own[0] / whole_rate, 3)}")
        lines.append(f"| {c['mask']} | {c['seq']} | {c['world']} | {fmt(parts['whole fwd+bwd'][0], 3)} | "
                     f"{fmt(parts['whole fwd+bwd'][1], 3)} | {fmt(every[0], 3)} | {fmt(every[1], 3)} | "
                     f"{fmt(c['tiles_rank'] / every[0] / whole_rate, 3)} | {own_cells} |")
    lines.append("")
    return "\n".join(lines)


def _main_and_rest(kernels: dict) -> tuple[float, float]:
    """(ms of flex's backward template kernel, ms of the other kernels a backward call launches; the
    whole fwd+bwd's forward template kernel left out)."""
    main = sum(ms for name, ms in kernels.items() if "flex_attention_backward" in name and "_tem_" in name)
    rest = sum(ms for name, ms in kernels.items() if "_tem_" not in name)
    return main, rest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seq", default="16384,32768")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting cases after this many seconds")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    # one compiled whole-sequence kernel per mask and length: past Dynamo's default limit of
    # recompiles, flex_attention would run eagerly (its dense math: 128 GiB of scores at 32K)
    torch._dynamo.config.recompile_limit = 64
    start, cases = time.perf_counter(), []
    for seq in (int(x) for x in args.seq.split(",")):
        for kind in args.masks.split(","):
            if time.perf_counter() - start > args.budget_s:
                print(f"budget spent: {kind} at {seq} not run", flush=True)
                continue
            c = case(kind, seq, args.world, args.reps)
            cases.append(c)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()}, flush=True)
    meta = machine_meta(torch.cuda.get_device_name(), 1, args.commit, rounds=args.reps)
    text = report(derive(cases), meta)
    print(text)
    write_report(args.out, result_stem("flex_blocks", torch.cuda.get_device_name(), 1), {"meta": meta, "cases": cases}, text)


if __name__ == "__main__":
    main()
