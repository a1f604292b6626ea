"""One GPU: the fused Triton GEMMs' throughput against cuBLAS at the training step's GEMMs, and what
the cuBLAS schedules' pieces cost the GEMMs (issue 67).

Each fused kernel runs alone with its arrival flags raised beforehand and local stand-ins for the
peers (torch_commopt/testing/fused_standins.py), so what is timed is its GEMM and its epilogue,
never a wait: the all-gather consumer (ag_matmul.launch_fused, q/k/v and w1/w3 as several B's in one
pass) and the reduce-scatter producer (matmul_reduce.launch_rs_fused, direct stores into the stand-in
peers, the own segment adding the landed partials).  cuBLAS multiplies the same rows: for the
all-gathers the gathered A against each weight, and against the weights concatenated (one GEMM,
as a fused q/k/v projection would run), whichever is faster; for the reductions A against the
weight.  Shapes: bench_e2e's Llama-3-8B layer (dim 4096, 32 / 8 heads of 128, SwiGLU 14336) at
TP=2 + SP and 8192 tokens a step: M 8192 gathered rows, each rank 4096.  Every tile configuration
of the sweep is timed (the all-gather's with its loops flattened, flat=1, the default, and
nested); the report gives each region's best against cuBLAS.  Then cuBLAS whole
against the pieces the cuBLAS schedules cut each region into, at bench_e2e's three row layouts
(batch x seq 1 x 8192, 2 x 4096, 4 x 2048: the sequence cut over the ranks).

Sustained: cuBLAS (its faster form) and the CUDA kernel each run back to back for `--sustain`
seconds, twice in alternating order, while nvidia-smi samples the SM clock and power
(benchmarks/gpu_clocks.py); the time a call after the first 0.6 s, the mean clock and power.  A
training step runs its GEMMs back to back like this, at the card's power cap, where a kernel's
clock follows its energy per FLOP: two kernels of equal cycles can differ in speed by their
clock.  Short calls interleaved with others (the rounds above) sample too little of each.  For
the reductions a third run: cuBLAS then the own segment's sum with the landed partial as a
separate add (`cuBLAS + add`), the unfused form of the work the fused kernel does on one rank
(its epilogue reads and adds the peer's partial, which cuBLAS alone does not), and the kernel at
world 1 over all the rows (`world 1`: its GEMM and stores without the reduction).

    python3 -m benchmarks.probe_fused_gemm --out OUT [--commit abc] [--rounds 7] [--sustain 2.5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from benchmarks.attention_timing import Clock
from benchmarks.common import fmt, machine_meta, result_stem, write_report
from benchmarks.gpu_clocks import ClockSampler

WORLD, M_LOC = 2, 4096
# region -> (kind, K, N of each weight) at TP=2 (bench_e2e's layer)
REGIONS = {"qkv": ("ag", 4096, (2048, 512, 512)), "w1/w3": ("ag", 4096, (7168, 7168)),
           "wo": ("rs", 2048, (4096,)), "w2": ("rs", 7168, (4096,))}
# (bm, bn, bk, warps, stages, gm): the schedules' default first
CONFIGS = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 128, 64, 4, 4, 8), (128, 128, 64, 8, 4, 8),
           (128, 256, 64, 8, 3, 16), (256, 128, 64, 8, 3, 8), (128, 128, 128, 8, 3, 8), (64, 256, 64, 4, 4, 8)]


def _timed(fns: dict, rounds: int, runs: int = 10) -> dict:
    """Median ms a call of each fn, rounds alternating their order (the clocks drift)."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    labels = list(fns)
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            times[label].append(_batch_ms(fns[label], runs))
    return {k: statistics.median(v) for k, v in times.items()}


def _batch_ms(fn, runs: int) -> float:
    """ms a call of `runs` calls of fn queued back to back."""
    return Clock("cuda").time_ms(fn, runs)


WARM_S = 0.6  # a sustained run's first seconds, not counted: the clock settles at the power cap


def _back_to_back(fn, seconds: float) -> tuple[float, tuple[float, float]]:
    """Median ms a call of fn run back to back (batches of 20) for `seconds`, past the first WARM_S,
    and the (start, end) time.time() span that median covers."""
    fn()
    torch.cuda.synchronize()
    t0, per = time.time(), []
    while time.time() - t0 < seconds or not per:
        ms = _batch_ms(fn, 20)
        if time.time() - t0 > WARM_S:
            per.append(ms)
    return statistics.median(per), (t0 + WARM_S, time.time())


def sustained(fns: dict, seconds: float) -> dict:
    """{label: {ms, sm_mhz, power_w, capped, samples, mcycles}} of each fn run back to back for
    `seconds`, twice in alternating order (ms: the mean of the two medians; the clock figures over
    both spans; mcycles: ms x MHz / 1000, a call's cycles in millions)."""
    ms, windows = {k: [] for k in fns}, {k: [] for k in fns}
    labels = list(fns)
    with ClockSampler(period_ms=20) as clocks:
        for order in (labels, labels[::-1]):
            for label in order:
                t, span = _back_to_back(fns[label], seconds)
                ms[label].append(t)
                windows[label].append(span)
    return _sustained_rows(ms, clocks.summary(windows))


def _sustained_rows(ms: dict, per_label: dict) -> dict:
    out = {}
    for label, times in ms.items():
        g = next(iter(per_label.get(label, {}).values()), None)  # the one GPU's
        t = statistics.mean(times)
        out[label] = {"ms": t, "sm_mhz": g and g["sm_mhz_mean"], "power_w": g and g["power_w_mean"],
                      "capped": g and g["power_capped_share"], "samples": g and g["samples"],
                      "mcycles": g and t * g["sm_mhz_mean"] / 1000}
    return out


def _params(cfg, flat: int = 0) -> dict:
    bm, bn, bk, warps, stages, gm = cfg
    return {"tma": 1, "bm": bm, "bn": bn, "bk": bk, "warps": warps, "stages": stages, "gm": gm, "flat": flat}


def _label(cfg, flat: int = 0) -> str:
    return "{}x{}x{} w{} s{} g{}".format(*cfg) + (" flat" if flat else "")


def _default(kind: str) -> str:
    """The schedules' default tile (FUSED_DEFAULTS): flat=1 on the all-gather consumer."""
    return _label(CONFIGS[0], 1 if kind == "ag" else 0)


def _checked(out: torch.Tensor, truth: torch.Tensor, cublas: torch.Tensor, what: str) -> None:
    """The fused output as close to the fp32 product as cuBLAS's own (validate.within_tolerance)."""
    from torch_commopt.testing.validate import rel_err, within_tolerance

    if not within_tolerance(rel_err(out, truth), rel_err(cublas, truth)):
        raise RuntimeError(f"{what}: fused error {rel_err(out, truth):.3g} against cuBLAS's {rel_err(cublas, truth):.3g}")


def _whole_tiles(run):
    """`run` with the sm90 kernel's stream-K tail off (no workspace: every tile whole)."""
    from torch_commopt.kernels.matmul.gpu import sm90

    def whole() -> None:
        real = sm90._workspace
        sm90._workspace = lambda *args: None
        try:
            run()
        finally:
            sm90._workspace = real

    return whole


def _ag_runs(k: int, ns: tuple, gen) -> tuple[dict, dict]:
    from torch_commopt.kernels.matmul.gpu.ag_matmul import launch_fused
    from torch_commopt.testing.fused_standins import Standin, ag_standins

    st = ag_standins(M_LOC, k, list(ns), Standin(WORLD, gen=gen))
    gathered = torch.cat([st.slots2[:M_LOC], st.a2])  # rank 1 of 2, one run of rows a rank
    cat = torch.cat(st.weights, dim=1)
    runs = {"cublas": lambda: [torch.mm(gathered, w) for w in st.weights]}
    if len(ns) > 1:
        runs["cublas one GEMM"] = lambda: torch.mm(gathered, cat)

    def check(label, region):
        truth = gathered.float() @ cat.float()
        _checked(torch.cat(st.products.outs, dim=1), truth, torch.mm(gathered, cat), f"{region} {label}")

    for cfg in CONFIGS:
        for flat in (0, 1):
            runs[_label(cfg, flat)] = functools.partial(launch_fused, st.a2, st.slots2, st.products, st.arrivals,
                                                        _params(cfg, flat))
    # the default with the TMA store (tma_store=1) instead of pointer stores
    runs[_default("ag") + " tma_store"] = functools.partial(
        launch_fused, st.a2, st.slots2, st.products, st.arrivals, {**_params(CONFIGS[0], 1), "tma_store": 1})
    # the CUDA kernel (sm90.py), warp-specialized, with its stream-K tail and without it
    runs["sm90"] = functools.partial(launch_fused, st.a2, st.slots2, st.products, st.arrivals, {"impl": "sm90"})
    runs["sm90 whole tiles"] = _whole_tiles(runs["sm90"])
    return runs, {"status": st.arrivals.status, "check": check}


def _sm90_rs(st, signals, params: dict):
    """A call of the sm_90a reduce-scatter kernel on stand-ins st that raises where the kernel
    would not run (sm90.rs_gemm refuses: launch_rs_fused would run the Triton kernel instead, and
    its times would stand in the CUDA kernel's row)."""
    from torch_commopt.kernels.matmul.gpu import sm90

    launch = sm90.Launch.of(params, st.a2.device, False)

    def run() -> None:
        if not sm90.rs_gemm(st.a2, st.weight, st.targets, signals, st.segments, 1.0, launch):
            raise RuntimeError(f"the sm_90a reduce-scatter did not run with {params}: {sm90.why_not() or 'refused'}")
    return run


def _rs_runs(k: int, n: int, gen) -> tuple[dict, dict]:
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import launch_rs_fused
    from torch_commopt.testing.fused_standins import Standin, rs_standins

    runs, status, calls = {}, torch.zeros(8, dtype=torch.int32, device="cuda"), {}
    for cfg in CONFIGS:
        st = rs_standins(M_LOC, k, n, Standin(WORLD, gen=gen), bm=cfg[0])
        sig = st.signals._replace(status=status)
        calls[_label(cfg)] = st
        runs[_label(cfg)] = functools.partial(launch_rs_fused, st.a2, st.weight, st.targets, sig, st.segments, 1.0,
                                              _params(cfg))
    # the CUDA kernel (sm90.py) on the default configuration's stand-ins (row tiles of 128, as its own)
    st = rs_standins(M_LOC, k, n, Standin(WORLD, gen=gen), bm=CONFIGS[0][0])
    calls["sm90"] = st
    runs["sm90"] = _sm90_rs(st, st.signals._replace(status=status), {"impl": "sm90"})
    runs["cublas"] = lambda a=st.a2, w=st.weight: torch.mm(a, w)
    whole = torch.empty(WORLD * M_LOC, n, device="cuda", dtype=st.a2.dtype)

    def unfused() -> None:  # the same rows' GEMM, then the own segment (rank 1's) plus the landed partial
        torch.mm(st.a2, st.weight, out=whole)
        torch.add(whole[M_LOC:], st.recv[0], out=st.targets.out)

    def check(label, region):
        s = calls[label]
        own = s.a2[M_LOC:]  # rank 1's segment (one run of rows a segment)
        partial = s.recv[0].float()
        _checked(s.targets.out, own.float() @ s.weight.float() + partial,
                 (torch.mm(own, s.weight).float() + partial).to(own.dtype), f"{region} {label}")

    return runs, {"status": status, "check": check, "unfused": unfused, "alone": _rs_alone(k, n, gen, status)}


def _rs_alone(k: int, n: int, gen, status) -> tuple:
    """(run, check): the same kernel at world 1 over all WORLD * M_LOC rows, the same GEMM and
    stores with no partial to load or add, i.e. its GEMM throughput without the reduction."""
    from torch_commopt.testing.fused_standins import Standin, rs_standins

    st = rs_standins(WORLD * M_LOC, k, n, Standin(1, gen=gen), bm=CONFIGS[0][0])
    run = _sm90_rs(st, st.signals._replace(status=status), {"impl": "sm90"})

    def check(region: str) -> None:
        _checked(st.targets.out, st.a2.float() @ st.weight.float(), torch.mm(st.a2, st.weight),
                 f"{region} sm90 at world 1")
    return run, check


def probe(rounds: int, sustain: float) -> list:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for region, (kind, k, ns) in REGIONS.items():
        runs, probe_of = _ag_runs(k, ns, gen) if kind == "ag" else _rs_runs(k, ns[0], gen)
        ms = _timed(runs, rounds)
        cublas = min((key for key in ms if key.startswith("cublas")), key=ms.get)  # the faster form
        held_fns = {"cublas": runs[cublas], "sm90": runs["sm90"]}
        if "unfused" in probe_of:
            held_fns["cublas + add"] = probe_of["unfused"]
        if "alone" in probe_of:
            held_fns["sm90 world 1"] = probe_of["alone"][0]
        held = sustained(held_fns, sustain) if sustain > 0 else None
        torch.cuda.synchronize()
        if int(probe_of["status"][0]) != 0:
            raise RuntimeError(f"{region}: a fused kernel reported wait status {int(probe_of['status'][0])}")
        for label in runs:  # each configuration's own output, as close as cuBLAS's
            if not label.startswith("cublas"):
                runs[label]()
                probe_of["check"](label, region)
        if "alone" in probe_of:
            probe_of["alone"][0]()
            probe_of["alone"][1](region)
        base = min(v for key, v in ms.items() if key.startswith("cublas"))
        fused = {key: v for key, v in ms.items() if not key.startswith("cublas")}
        best = min(fused, key=fused.get)
        flops = 2 * WORLD * M_LOC * k * sum(ns)
        rows.append({"region": region, "kind": kind, "m": WORLD * M_LOC, "k": k, "ns": list(ns), "ms": ms,
                     "cublas_ms": base, "best": best, "best_ms": fused[best],
                     "default_ms": fused[_default(kind)], "ratio_best": base / fused[best],
                     "ratio_default": base / fused[_default(kind)], "cublas_tflops": flops / base / 1e9,
                     "sm90_ms": ms.get("sm90"), "ratio_sm90": base / ms["sm90"] if "sm90" in ms else None,
                     "sustained": held})
    return rows


def _ag_pieces(shards: list, ws: list, lay) -> None:
    """The cuBLAS schedules' GEMMs of an all-gather (ag_matmul._piece_matmuls): the own shard's
    rows, then the peer's (each a rank's rows, contiguous as in its slot), each one GEMM (a
    batched one over outer blocks of a 3-D activation) into its rows of the outputs."""
    from torch_commopt.kernels.scaled import matmul

    k, per = shards[0].shape[1], lay.local_rows
    outs = [torch.empty(WORLD * per, w.shape[1], device=shards[0].device, dtype=shards[0].dtype) for w in ws]
    for block in (1, 0):  # rank 1: its own shard first
        rows = shards[block]
        for out, w in zip(outs, ws):
            if lay.outer == 1:
                matmul(rows, w, None, out=lay.block_rows(out, block, 0, per))
            else:
                matmul(rows.view(lay.outer, lay.lin, k), w, None, out=lay.block_rows(out, block, 0, per))


def _rs_pieces(a: torch.Tensor, w: torch.Tensor, lay) -> None:
    """The cuBLAS schedules' GEMMs of a reduce-scatter (matmul_reduce._Call.product): one per
    destination segment, its rows in every outer block (a strided batched GEMM at outer > 1)."""
    from torch_commopt.kernels.scaled import matmul

    per = lay.local_rows
    for seg in range(WORLD):
        rows = lay.block_rows(a, seg, 0, per)
        out = torch.empty(per, w.shape[1], device=a.device, dtype=a.dtype)
        matmul(rows, w, None, out=out if lay.outer == 1 else out.view(lay.outer, lay.lin, w.shape[1]))


def pieces(rounds: int) -> list:
    """cuBLAS whole (as inductor runs the region's GEMMs: one per weight over all rows) against
    the pieces the cuBLAS schedules cut them into, at each e2e shape's row layout."""
    from torch_commopt.kernels.matmul.gpu.layout import RowLayout
    from torch_commopt.testing.fused_standins import weight

    gen = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    rows = []
    for batch in (1, 2, 4):
        lay = RowLayout(batch, WORLD * M_LOC // batch // WORLD, WORLD)  # seq cut over the ranks (SP)
        for region, (kind, k, ns) in REGIONS.items():
            a = mk(WORLD * M_LOC, k)
            ws = [weight(n, k, True, mk) for n in ns]
            shards = list(a.view(lay.outer, WORLD, lay.lin, k).transpose(0, 1).reshape(WORLD, -1, k))
            runs = {"whole": lambda a=a, ws=ws: [torch.mm(a, w) for w in ws],
                    "pieces": (lambda s=shards, ws=ws, lay=lay: _ag_pieces(s, ws, lay)) if kind == "ag"
                    else (lambda a=a, w=ws[0], lay=lay: _rs_pieces(a, w, lay))}
            ms = _timed(runs, rounds)
            rows.append({"batch": batch, "seq": WORLD * M_LOC // batch, "region": region, "kind": kind, "ms": ms,
                         "ratio": ms["pieces"] / ms["whole"]})
    return rows


def report(rows: list, meta: dict) -> str:
    lines = [f"# The fused GEMMs alone against cuBLAS ({meta['device']}, one GPU)", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; "
             f"`{meta['command']}`. Arrival flags raised beforehand, the peers local stand-ins "
             "(benchmarks/probe_fused_gemm.py); bf16; Llama-3-8B layer at TP=2 + SP, 8192 tokens; median of "
             f"{meta['rounds']} rounds of 10 calls. Throughput = cuBLAS ms / fused ms (1.00: as fast).", "",
             "Triton: the default tile and the sweep's best (`best tile`); sm90: the CUDA kernel "
             "(kernels/matmul/gpu/sm90.py, warp-specialized; for the all-gathers a last round of tiles at "
             "most half full split stream-K, `sm90 whole tiles` without that split).", "",
             "| region | op | M x K x N | cuBLAS ms (TFLOP/s) | Triton default ms | default / cuBLAS "
             "throughput | best tile | best ms | best / cuBLAS throughput | sm90 ms | sm90 / cuBLAS throughput |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ns = "+".join(map(str, r["ns"]))
        lines.append(f"| {r['region']} | {'AG+GEMM' if r['kind'] == 'ag' else 'GEMM+RS'} | {r['m']} x {r['k']} x {ns} "
                     f"| {fmt(r['cublas_ms'])} ({r['cublas_tflops']:.0f}) | {fmt(r['default_ms'])} | "
                     f"{fmt(r['ratio_default'])} | {r['best']} | {fmt(r['best_ms'])} | {fmt(r['ratio_best'])} | "
                     f"{fmt(r.get('sm90_ms'))} | {fmt(r.get('ratio_sm90'))} |")
    return "\n".join(lines + [""])


def sustained_report(rows: list) -> str:
    """The sustained table: cuBLAS's and the CUDA kernel's time a call, clock and power, each run
    back to back, and the kernel's throughput and cycles against cuBLAS's."""
    lines = ["## Sustained: each kernel back to back", "",
             "cuBLAS (the faster form) and the sm90 kernel each run back to back for seconds, twice in alternating "
             "order; ms a call past the first 0.6 s; nvidia-smi every 20 ms meanwhile: mean SM clock, power, share of "
             "samples with the software power cap active. Cycles = ms x clock. For the reductions, `cuBLAS + add`: "
             "cuBLAS then the own segment's sum with the landed partial as a separate add, the unfused form of "
             "the fused kernel's work on one rank; `world 1`: the same kernel alone over all the rows, its GEMM "
             "and stores without the reduction (no partial to load or add).", "",
             "| region | cuBLAS ms | MHz | W | capped | sm90 ms | MHz | W | capped | sm90 / cuBLAS throughput "
             "| sm90 / cuBLAS cycles | cuBLAS + add ms | sm90 / (cuBLAS + add) throughput | world 1 ms "
             "| world 1 / cuBLAS throughput |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        held = r.get("sustained")
        if not held:
            continue
        c, f = held["cublas"], held["sm90"]
        cycles = f["mcycles"] / c["mcycles"] if c["mcycles"] and f["mcycles"] else None

        def cols(x):
            return f"{fmt(x['ms'])} | {fmt(x['sm_mhz'], 0)} | {fmt(x['power_w'], 0)} | {fmt(x['capped'], 2)}"

        both, alone = held.get("cublas + add"), held.get("sm90 world 1")
        unfused = f"{fmt(both['ms'])} | {fmt(both['ms'] / f['ms'])}" if both else "- | -"
        solo = f"{fmt(alone['ms'])} | {fmt(c['ms'] / alone['ms'])}" if alone else "- | -"
        lines.append(f"| {r['region']} | {cols(c)} | {cols(f)} | {fmt(c['ms'] / f['ms'])} | {fmt(cycles)} | {unfused} "
                     f"| {solo} |")
    return "\n".join(lines + [""])


def pieces_report(rows: list) -> str:
    lines = ["## cuBLAS whole against the cuBLAS schedules' pieces", "",
             "Whole: one GEMM per weight over all 8192 rows (as inductor runs the region). Pieces: what "
             "`ce_push` / `ce_pull` / `direct` run (an all-gather's own shard then the peer's, a reduce-scatter's one "
             "GEMM per destination segment; a batched GEMM over the outer blocks of a 3-D activation).", "",
             "| batch x seq | region | whole ms | pieces ms | pieces / whole |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} x {r['seq']} | {r['region']} | {fmt(r['ms']['whole'])} | "
                     f"{fmt(r['ms']['pieces'])} | {fmt(r['ratio'])} |")
    return "\n".join(lines + [""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default="")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sustain", type=float, default=2.5, help="seconds each kernel runs back to back (0: none)")
    args = p.parse_args(argv)
    torch.cuda.set_device(0)
    rows, cut = probe(args.rounds, args.sustain), pieces(args.rounds)
    meta = machine_meta(torch.cuda.get_device_name(0), 1, args.commit, rounds=args.rounds, sustain_s=args.sustain)
    text = report(rows, meta) + "\n" + sustained_report(rows) + "\n" + pieces_report(cut)
    print(text)
    write_report(args.out, result_stem("fused_gemm", meta["device"], 1), {"meta": meta, "rows": rows, "pieces": cut},
                 text)


if __name__ == "__main__":
    main()
