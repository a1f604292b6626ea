"""Context-parallel attention on W GPUs: commopt's schedules next to one GPU and torch's CP (issue 6).

Per case (B, H, H_kv, D, S_total, causal, pass "fwd" or "fwd+bwd"; bf16) one run times, side by side:

    single GPU full     F.scaled_dot_product_attention over the whole sequence; EVERY rank computes
                        the same whole-sequence attention on its own GPU at the same time (no
                        communication); the figure is the slowest rank's, like every other figure
    torch CP            torch.distributed.tensor.experimental.context_parallel with
                        _attention.set_rotate_method("allgather") and ("alltoall"), its default
                        load balancing (head-tail: rank r holds chunks r and 2W-1-r of 2W when
                        S % 2W == 0).  It refuses non-causal attention with load balancing on
                        ("Load balancing requires `is_causal=True`"; after that error its
                        context exit left SDPA wrapped on the GPUs): non-causal cases run it
                        with load balancing off (nothing to balance there; `load_balance` in
                        the record).  A context that fails inside is repaired before the
                        check below.
                        Every sample enters the context with fresh full-size buffers (q, k, v,
                        dout; all in no_restore_buffers) and makes its requires-grad leaves from
                        the shards inside it; after each context F.scaled_dot_product_attention
                        must be the original function again (RuntimeError if not).  GQA is
                        tried natively (enable_gqa=True); if torch CP refuses it, K/V are
                        expanded to H heads before sharding (noted in torch_cp_gqa).
    commopt             every schedule cost.candidates accepts (torch.ops.commopt.cp_attention_fwd;
                        fwd+bwd through the autograd wrapper cp_attention), on contiguous shards;
                        commopt's pick = cost.rank_schedules' first (head-group depths included,
                        as the rewrite ranks them) with the machine figures the
                        compiled path uses (cost.machine_for: this machine's stored tuner
                        calibration, else the priors; `commopt_pick_by` says which): its time
                        is that schedule's time in the same rounds.

Before timing, every commopt schedule's out shard (and for fwd+bwd dq/dk/dv shards) is compared
with the single-device full attention (relative error; torch CP's too, in its own layout).
Times: back-to-back calls (each sample >= --target-ms, after --lead untimed calls queued right
before it so that the window opens on a busy device; LEAD_CALLS says why), median over --repeats
rounds that visit the variants in a rotated order, each round's slowest rank (all_reduce MAX).
efficiency = single_gpu_full_ms / (W * commopt_ms); speedup_vs_torch_cp = the faster of the
two torch CP times / commopt_ms.  Writes attention_h200x<W>_<date>.json/.md (records also
appended to partial.jsonl as they finish, so a run cut short keeps them).

NVLink multicast must stay off on the device machine (as for every benchmark here):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/bench_attention.py --out benchmarks/results --commit SHA [--full]

    python3 benchmarks/bench_attention.py --cpu      # gloo smoke run, float32, tiny shapes

The default sweep (B 1; H/H_kv 32/32 and 32/8; D 128; S_total 8K, 32K, 128K; causal and not;
fwd and fwd+bwd) is meant to finish within ~8 minutes on 2x H200; --full adds B 2, 4 and
S_total 16K, 64K.  Every sweep flag overrides its preset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.attention_timing import LEAD_CALLS, TARGET_MS, Clock, time_variants  # noqa: E402
from benchmarks.common import machine_meta, max_over_ranks, result_stem, write_report  # noqa: E402
from benchmarks.render_attention import _row, report  # noqa: E402,F401  (report: this benchmark's, also read as bench_attention.report)
from benchmarks.torch_cp_variant import TorchCP, TorchCPLeak, fresh_leaves, last_grads, reset_grads, torch_cp  # noqa: E402
from torch_commopt.testing.launch import run_distributed  # noqa: E402

log = logging.getLogger("torch_commopt.bench_attention")

# Captured at import, before any torch CP context could patch it.
PASSES = ("fwd", "fwd+bwd")
TORCH_CP_METHODS = ("allgather", "alltoall")
PRESETS = {
    "default": {"batch": "1", "heads": "32/32,32/8", "head_dim": "128", "seq": "8192,32768,131072",
                "causal": "1,0", "passes": "fwd,fwd+bwd"},
    "full": {"batch": "1,2,4", "heads": "32/32,32/8", "head_dim": "128",
             "seq": "8192,16384,32768,65536,131072", "causal": "1,0", "passes": "fwd,fwd+bwd"},
    "cpu": {"batch": "1", "heads": "4/4,4/2", "head_dim": "16", "seq": "64", "causal": "1,0",
            "passes": "fwd,fwd+bwd"},
}
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    causal: bool
    pass_: str  # "fwd" or "fwd+bwd"

    @property
    def backward(self) -> bool:
        return self.pass_ == "fwd+bwd"

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.heads, self.kv_heads, self.seq, self.head_dim)

    def label(self) -> str:
        return (f"B{self.batch} H{self.heads}/{self.kv_heads} D{self.head_dim} S{self.seq} "
                f"{'causal' if self.causal else 'full'} {self.pass_}")


# ---------------------------------------------------------------------------------------------
# sweep


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: want comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: want positive integers, got {text!r}")
    return values


def _heads(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        h, _, h_kv = item.strip().partition("/")
        if not (h.isdigit() and (h_kv or h).isdigit()):
            raise ValueError(f"--heads: want H/H_kv pairs such as 32/32,32/8, got {text!r}")
        h, h_kv = int(h), int(h_kv or h)
        if h_kv < 1 or h % h_kv:
            raise ValueError(f"--heads: H_kv {h_kv} must divide H {h} (in {text!r})")
        pairs.append((h, h_kv))
    return pairs


def sweep(args: argparse.Namespace) -> list[Case]:
    """The cases of the run, shortest sequences first (a run cut short loses the longest)."""
    preset = PRESETS["cpu" if args.cpu else "full" if args.full else "default"]
    get = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    passes = [p.strip() for p in get("passes").split(",") if p.strip()]
    if not passes or set(passes) - set(PASSES):
        raise ValueError(f"--passes: want a comma-separated subset of {PASSES}, got {get('passes')!r}")
    causals = [c.strip() for c in get("causal").split(",") if c.strip()]
    if not causals or set(causals) - {"0", "1"}:
        raise ValueError(f"--causal: want a comma-separated subset of 1 (causal), 0 (not), got {get('causal')!r}")
    seqs = _ints("--seq", get("seq"))
    for s in seqs:
        if s % args.world:
            raise ValueError(f"--seq: S_total {s} is not a multiple of --world {args.world}")
    cases = [Case(b, h, h_kv, d, s, c == "1", p)
             for s in sorted(seqs) for b in _ints("--batch", get("batch")) for h, h_kv in _heads(get("heads"))
             for d in _ints("--head-dim", get("head_dim")) for c in causals for p in passes]
    return cases


# ---------------------------------------------------------------------------------------------
# inputs, layouts, numerics


def _full_inputs(case: Case, dtype: torch.dtype, dev: str) -> dict[str, torch.Tensor]:
    """The whole-sequence q, k, v, dout: the same on every rank (one seed)."""
    g = torch.Generator(device=dev).manual_seed(1234)
    rnd = lambda h: torch.randn(case.batch, h, case.seq, case.head_dim, generator=g, device=dev, dtype=dtype)  # noqa: E731
    return {"q": rnd(case.heads), "k": rnd(case.kv_heads), "v": rnd(case.kv_heads), "dout": rnd(case.heads)}


def shard(t: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    """This rank's part of `t` along dim 2: `contiguous` (chunk r of W) or `head_tail` (torch
    CP's load balancing: chunks r and 2W-1-r of 2W)."""
    if layout == "contiguous":
        return t.chunk(world, dim=2)[rank].contiguous()
    if layout == "head_tail":
        chunks = t.chunk(2 * world, dim=2)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=2).contiguous()
    raise ValueError(f"shard: layout must be contiguous or head_tail, got {layout!r}")


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    from torch_commopt.testing.validate import rel_err

    return rel_err(x, ref)


def _errors(got: dict, ref: dict, rank: int, world: int, layout: str) -> dict[str, float]:
    return {name: _rel_err(got[name], shard(ref[name], rank, world, layout)) for name in got}


# ---------------------------------------------------------------------------------------------
# variants: each is a context manager yielding (step, outputs) -- step() runs one call,
# outputs() returns {"out": ..., "dq": ...} of the last call, in the variant's own layout


def _sdpa_kwargs(case: Case) -> dict:
    return {"is_causal": case.causal, **({"enable_gqa": True} if case.heads != case.kv_heads else {})}


def _fused_only(dev: str):
    """On CUDA, SDPA without its math fallback: at long sequences math would materialize S x S
    scores (an OOM, or a meaningless figure) instead of saying that no fused kernel takes the call."""
    if dev != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


@contextlib.contextmanager
def single_gpu(case: Case, full: dict):
    """The whole sequence on this rank's device (every rank the same, no communication)."""
    last = {}
    fused = lambda: _fused_only(full["q"].device.type)  # noqa: E731
    if not case.backward:
        def step():
            with torch.no_grad(), fused():
                last["out"] = F.scaled_dot_product_attention(full["q"], full["k"], full["v"], **_sdpa_kwargs(case))
        yield step, lambda: dict(last)
        return
    leaves = fresh_leaves(full["q"], full["k"], full["v"])

    def step():
        reset_grads(leaves)
        with fused():
            last["out"] = F.scaled_dot_product_attention(*leaves, **_sdpa_kwargs(case))
        last["out"].backward(full["dout"])
    yield step, lambda: {"out": last["out"].detach(), **last_grads(leaves)}


@contextlib.contextmanager
def commopt_schedule(case: Case, local: dict, schedule: str, group: dist.ProcessGroup, layout: str = "contiguous"):
    from torch_commopt.kernels.attention.ops import CPOptions, cp_attention

    last = {}
    world, name = group.size(), group.group_name
    if not case.backward:
        def step():
            last["out"] = torch.ops.commopt.cp_attention_fwd(local["q"], local["k"], local["v"], schedule,
                                                             case.causal, None, world, name, "auto", layout)[0]
        yield step, lambda: dict(last)
        return
    leaves = fresh_leaves(local["q"], local["k"], local["v"])

    def step():
        reset_grads(leaves)
        last["out"] = cp_attention(*leaves, schedule=schedule, causal=case.causal, group=group,
                                   options=CPOptions(layout=layout))
        last["out"].backward(local["dout"])
    yield step, lambda: {"out": last["out"].detach(), **last_grads(leaves)}


ZIGZAG_LAYOUT = "ring_zigzag on zigzag shards"  # a variant, not a schedule the pick chooses from


# ---------------------------------------------------------------------------------------------
# one case


def _global_errors(errors: dict[str, float], dev: str) -> dict[str, float]:
    """Each error's maximum over ranks (every rank checks its own shard)."""
    return dict(zip(errors, max_over_ranks(list(errors.values()), dev))) if errors else {}


def _transport() -> str:
    """How the ring schedules move K/V on CUDA (kernels/attention/ce_ring.py's switch; "auto"
    moves the rings on NCCL)."""
    from torch_commopt.kernels.attention.ce_ring import ENV, transport

    asked = transport()
    return f"{'nccl' if asked == 'auto' else asked} ({ENV}={asked})"


def _a2a_transport() -> str:
    """How Ulysses's all-to-alls move on CUDA (kernels/attention/ce_a2a.py's switch)."""
    from torch_commopt.kernels.attention.ce_a2a import ENV, transport

    return f"{transport()} ({ENV})"


def pick_machine(dev: str, world: int, dtype: torch.dtype):
    """(CPMachine, how it was obtained): what the compiled path ranks with (cost.machine_for)."""
    from torch_commopt.tuner.attention.cost import machine_and_source

    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    return machine_and_source(device, world, dist.group.WORLD.group_name, str(dtype).removeprefix("torch."), None,
                              300.0)


def _commopt_plan(case: Case, world: int, dtype: torch.dtype, machine, only: list[str] | None):
    """(schedules to run, pick, the cost model's ranking).  The pick is always run."""
    from torch_commopt.core.attention_spec import refusal
    from torch_commopt.tuner.attention.cost import candidates, rank_schedules

    accepted = [str(s) for s in candidates(case.shape, world=world, causal=case.causal)]
    # the compiled path's ranking (rewrite._choose): head-group depths included, so the pick may be
    # e.g. ulysses:g=1 (run beside the plain names)
    ranked = rank_schedules(case.shape, world=world, causal=case.causal, dtype=dtype, machine=machine,
                            backward=case.backward, depths=True)
    pick = ranked[0][0]
    if only is None:  # the pick may be a depth (ulysses:g=1) that `accepted` names only as ulysses
        return accepted + ([pick] if pick not in accepted else []), pick, ranked
    chosen = [s for s in only if refusal(s, case.shape, world, case.causal) is None]
    for s in set(only) - set(chosen):
        log.info("%s: --schedules %s skipped (%s)", case.label(), s, refusal(s, case.shape, world, case.causal))
    return chosen + ([pick] if pick not in chosen else []), pick, ranked


def _try_torch_cp(case: Case, full: dict, ref: dict, how: TorchCP, mesh, rank: int, world: int, dev: str):
    """(errors vs the full attention, None) if torch CP runs the case, else (None, reason).
    Every rank must agree: a failure on any rank is a failure on all."""
    errors, reason = None, None
    try:
        with torch_cp(case, full, how, mesh) as (step, outputs):
            step()
            errors = _errors(outputs(), ref, rank, world, how.layout(case, world))
    except TorchCPLeak:
        raise
    except (RuntimeError, NotImplementedError, ValueError, AssertionError, TypeError) as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    ok = torch.tensor([0.0 if reason else 1.0], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if reason is None and ok.item() < 1:
        reason = "failed on another rank"
    return (None, reason) if reason else (_global_errors(errors, dev), None)


def _torch_cp_plans(case, full, ref, mesh, rank, world, dev) -> dict[str, dict]:
    """Per rotate method: {"how": TorchCP or None, "errors", "reason", "gqa"}."""
    plans = {}
    for method in TORCH_CP_METHODS:
        how = TorchCP(method, load_balance=case.causal)
        errors, reason = _try_torch_cp(case, full, ref, how, mesh, rank, world, dev)
        gqa = "native" if case.heads != case.kv_heads else None
        if reason and gqa:  # GQA refused? retry with K/V expanded to H heads (more bytes moved)
            expanded = TorchCP(method, load_balance=how.load_balance, expand_kv=True)
            errors, reason2 = _try_torch_cp(case, full, ref, expanded, mesh, rank, world, dev)
            if reason2 is None:
                how, gqa, reason = expanded, f"K/V expanded to H heads (native GQA: {reason})", None
            else:
                reason = f"{reason}; with K/V expanded: {reason2}"
        plans[method] = {"how": None if reason else how, "errors": errors, "reason": reason, "gqa": gqa,
                         "layout": how.layout(case, world), "load_balance": how.load_balance}
    return plans


def run_case(case: Case, rank: int, world: int, dev: str, dtype: torch.dtype, mesh, args, machine) -> dict:
    """Check numerics of every variant, then time them all in the same rounds."""
    from torch_commopt.kernels.attention.local import pick as local_pick

    group = dist.group.WORLD
    clock = Clock(dev)
    full = _full_inputs(case, dtype, dev)
    local = {n: shard(t, rank, world, "contiguous") for n, t in full.items()}
    with single_gpu(case, full) as (step, outputs):
        step()
        ref = outputs()
    scheds, pick, ranked = _commopt_plan(case, world, dtype, machine[0], args.schedules)
    tol = TOLERANCE.get(dtype, 3e-2)
    errors = {}
    for s in scheds:
        with commopt_schedule(case, local, s, group) as (step, outputs):
            step()
            errors[s] = _global_errors(_errors(outputs(), ref, rank, world, "contiguous"), dev)
        if max(errors[s].values()) > tol:
            log.warning("%s: commopt %s relative error %s above %.0e", case.label(), s, errors[s], tol)
    # the same sequence sharded zigzag (torch CP's head-tail layout): ring_zigzag without relayouts
    zz_local = ({n: shard(t, rank, world, "head_tail") for n, t in full.items()}
                if case.causal and case.seq % (2 * world) == 0 and "ring_zigzag" in scheds else None)
    if zz_local is not None:
        with commopt_schedule(case, zz_local, "ring_zigzag", group, "zigzag") as (step, outputs):
            step()
            errors[ZIGZAG_LAYOUT] = _global_errors(_errors(outputs(), ref, rank, world, "head_tail"), dev)
    cp = _torch_cp_plans(case, full, ref, mesh, rank, world, dev)
    variants = {"single_gpu_full": lambda: single_gpu(case, full)}
    if zz_local is not None:
        variants[ZIGZAG_LAYOUT] = lambda: commopt_schedule(case, zz_local, "ring_zigzag", group, "zigzag")
    variants.update({f"torch_cp_{m}": (lambda h=p["how"]: torch_cp(case, full, h, mesh, warm=True))
                     for m, p in cp.items() if p["how"] is not None})
    variants.update({f"commopt {s}": (lambda s=s: commopt_schedule(case, local, s, group)) for s in scheds})
    rounds = time_variants(variants, clock, dev, args.repeats, args.target_ms, args.lead)
    rec = _record(case, world, dtype, rounds, errors, tol, pick, ranked, cp, machine[1])
    rec["commopt_local_backend"] = local_pick(local["q"], local["k"]).name
    return rec


def _record(case: Case, world: int, dtype: torch.dtype, rounds: dict, errors: dict, tol: float, pick: str,
            ranked: list, cp: dict, pick_by: str) -> dict:
    from torch_commopt.core.attention_spec import zigzag_head_groups

    ms = {name: statistics.median(v) for name, v in rounds.items()}
    sched_ms = {k.removeprefix("commopt "): v for k, v in ms.items() if k.startswith("commopt ")}
    zz_ms = ms.get(ZIGZAG_LAYOUT)
    zz_err = errors.pop(ZIGZAG_LAYOUT, None)
    torch_ms = {m: ms.get(f"torch_cp_{m}") for m in TORCH_CP_METHODS}
    commopt_ms = sched_ms[pick]
    timed_torch = [t for t in torch_ms.values() if t is not None]
    best = min(sched_ms, key=sched_ms.get)
    return {
        "B": case.batch, "H": case.heads, "H_kv": case.kv_heads, "D": case.head_dim, "S_total": case.seq,
        "causal": case.causal, "world": world, "pass": case.pass_, "dtype": str(dtype).removeprefix("torch."),
        "single_gpu_full_ms": ms["single_gpu_full"],
        "single_gpu_full_note": "every rank computes the whole-sequence attention on its own device at once; "
                                "slowest rank",
        "torch_cp_allgather_ms": torch_ms["allgather"], "torch_cp_alltoall_ms": torch_ms["alltoall"],
        "torch_cp": {m: {k: v for k, v in p.items() if k != "how"} for m, p in cp.items()},
        "commopt_ms": commopt_ms, "commopt_schedule": pick,
        "commopt_pick_by": f"attention.cost.rank_schedules with {pick_by}",
        "commopt_predicted_ms": dict(ranked),
        "efficiency": ms["single_gpu_full"] / (world * commopt_ms),
        "speedup_vs_torch_cp": min(timed_torch) / commopt_ms if timed_torch else None,
        "torch_cp_best": min((m for m in torch_ms if torch_ms[m] is not None), key=torch_ms.get, default=None),
        "schedules_ms": sched_ms, "schedule_errors": errors,
        "numerics_ok": {s: max(e.values()) <= tol for s, e in errors.items()}, "tolerance": tol,
        "best_schedule": best, "best_schedule_ms": sched_ms[best],
        "round_range_ms": {k: [min(v), max(v)] for k, v in rounds.items()},
        "ring_zigzag_head_groups": zigzag_head_groups(
            case.batch * case.heads * (case.seq // world) * case.head_dim * dtype.itemsize, case.kv_heads),
        "commopt_zigzag_layout_ms": zz_ms,
        "commopt_zigzag_layout_note": "ring_zigzag on a zigzag-sharded sequence (layout='zigzag', torch CP's "
                                      "head-tail sharding): no relayouts; causal cases only",
        "efficiency_zigzag_layout": ms["single_gpu_full"] / (world * zz_ms) if zz_ms else None,
        "zigzag_layout_errors": zz_err,
        "zigzag_layout_numerics_ok": None if zz_err is None else max(zz_err.values()) <= tol,
    }


def worker(rank: int, world: int, cases: list[Case], args: argparse.Namespace, partial_path: str | None) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    import torch_commopt  # noqa: F401  (registers the commopt ops)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    dtype = torch.float32 if dev == "cpu" else getattr(torch, args.dtype)
    mesh = init_device_mesh(dev, (world,))
    machine = pick_machine(dev, world, dtype)
    records = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        rec = run_case(case, rank, world, dev, dtype, mesh, args, machine)
        records.append(rec)
        if rank == 0:
            log.info("[%d/%d %.1fs] %s", i + 1, len(cases), time.perf_counter() - t0, _row(rec))
            if partial_path:
                with open(partial_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        if dev == "cuda":
            torch.cuda.empty_cache()
    return records


# ---------------------------------------------------------------------------------------------
# main


def _meta(args: argparse.Namespace) -> dict:
    device = "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(0)
    return machine_meta(device, args.world, args.commit, dtype="float32" if args.cpu else args.dtype,
                        ring_transport="gloo" if args.cpu else _transport(),
                        a2a_transport="gloo" if args.cpu else _a2a_transport(), target_ms=args.target_ms,
                        lead_calls=args.lead, repeats=args.repeats)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="result folder (default benchmarks/results; --cpu: none)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the full sweep (B 1,2,4; S_total 8K..128K)")
    parser.add_argument("--cpu", action="store_true", help="smoke run on gloo: float32, tiny shapes")
    parser.add_argument("--batch", help="comma-separated B values")
    parser.add_argument("--heads", help="comma-separated H/H_kv pairs, e.g. 32/32,32/8")
    parser.add_argument("--head-dim", dest="head_dim", help="comma-separated D values")
    parser.add_argument("--seq", help="comma-separated S_total values")
    parser.add_argument("--causal", help="comma-separated 1 (causal) / 0 (not)")
    parser.add_argument("--passes", help="comma-separated fwd / fwd+bwd")
    parser.add_argument("--schedules", type=lambda s: [x for x in s.split(",") if x] or None, default=None,
                        help="commopt schedules to time (default: every one the spec accepts; the pick always)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default 5; --cpu 2)")
    parser.add_argument("--target-ms", dest="target_ms", type=float, default=None,
                        help=f"each sample's back-to-back calls last at least this long (default {TARGET_MS:g}; "
                             "--cpu 1)")
    parser.add_argument("--lead", type=int, default=LEAD_CALLS,
                        help=f"untimed calls queued right before each sample's timed ones (default {LEAD_CALLS}; "
                             "0: the timed window opens on an idle device)")
    parser.add_argument("--commit", default="")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.cpu else 5)
    args.target_ms = args.target_ms or (1.0 if args.cpu else TARGET_MS)
    if args.world < 2:
        raise ValueError(f"--world must be >= 2, got {args.world}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = sweep(args)
    out = pathlib.Path(args.out) if args.out else (None if args.cpu else ROOT / "benchmarks" / "results")
    if out:
        out.mkdir(parents=True, exist_ok=True)
    log.info("%d cases: %s", len(cases), "; ".join(c.label() for c in cases))
    backend = "gloo" if args.cpu else "nccl"
    records = run_distributed(worker, args.world, cases, args, str(out / "partial.jsonl") if out else None,
                              backend=backend, timeout_s=3600)[0]
    meta = _meta(args)
    text = report(records, meta)
    if out:
        stem = result_stem("attention", meta["device"], args.world, meta["date"])
        write_report(out, stem, {**meta, "records": records}, text)
    print(text)


if __name__ == "__main__":
    main()
