"""Does a head group's attention fill the tail of the group before it when it runs on a second
stream?  One GPU, one rank's Ulysses work at world 2 (B1, H/2 heads over the whole sequence,
cuDNN through attention/local.py), forward then backward, in CUDA-graph replays:

    one        all heads in one call per pass (no pipeline: what 1 head group computes)
    seq2       two head groups one after the other on one stream (what the pipeline runs now)
    par2       group 0 on the caller's stream, group 1 on a second stream launched right after
               it (the GPU dispatches group 0's blocks first, then group 1's as SMs free up)

    one+copy   one call with the kept form's local copies beside it on a second stream (the
               copy engine copies q, k, v -- the moved inputs -- out of the all-to-all buffer
               into the kept tensors while the attention runs; forward only, as there)

For each: the pass's time and when group 0 ended (its results can travel from then on: a
second stream that delays group 0 would expose more of its all-to-all).  The session 11
profile: 16K MHA, attention alone 6.53 ms with one group, 6.95 with two.

    python3 benchmarks/probe_attention_streams.py OUTDIR [--seq 16384] [--heads 32/32]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_commopt.attention.local import attend_bwd, attend_fwd  # noqa: E402

D, WORLD, ROUNDS, CALLS = 128, 2, 5, 3


def _tensors(seq: int, h: int, h_kv: int) -> dict:
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, dout = mk(1, h, seq, D), mk(1, h, seq, D)
    k, v = mk(1, h_kv, seq, D), mk(1, h_kv, seq, D)
    out, lse = attend_fwd(q, k, v, scale=D ** -0.5, mask="causal")
    return dict(q=q, k=k, v=v, dout=dout, out=out.to(q.dtype), lse=lse)


def _groups(t: dict, n: int) -> list[dict]:
    def part(x, g):
        size = x.shape[1] // n
        return x[:, g * size:(g + 1) * size].contiguous()
    return [{key: part(x, g) for key, x in t.items()} for g in range(n)]


def _pass(g: dict, backward: bool):
    if backward:
        return lambda: attend_bwd(g["dout"], g["q"], g["k"], g["v"], g["out"], g["lse"], scale=D ** -0.5, mask="causal")
    return lambda: attend_fwd(g["q"], g["k"], g["v"], scale=D ** -0.5, mask="causal")


def _time(variant: str, groups: list[dict], backward: bool) -> tuple[float, float]:
    """(ms of the pass, ms until group 0 ended), median over ROUNDS rounds of CALLS calls."""
    cur, other = torch.cuda.current_stream(), torch.cuda.Stream()
    runs = [_pass(g, backward) for g in groups]
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
              torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]

    copies = []
    if variant == "one+copy":  # sources and destinations of the kept form's copies (q, k, v)
        copies = [(torch.empty_like(groups[0][key]), groups[0][key]) for key in ("q", "k", "v")]

    def call(i: int) -> None:
        start, first, end = marks[i]
        start.record()
        if copies:
            other.wait_event(start)
            with torch.cuda.stream(other):
                for dst, src in copies:
                    dst.copy_(src)
        runs[0]()
        first.record()
        if copies:
            cur.wait_stream(other)
        if variant == "par2":
            other.wait_event(start)
            with torch.cuda.stream(other):
                runs[1]()
            cur.wait_stream(other)
        else:
            for run in runs[1:]:
                run()
        end.record()

    for i in range(2):
        call(i)  # warm-up: cuDNN picks its plans
    torch.cuda.synchronize()
    totals, firsts = [], []
    for _ in range(ROUNDS):
        for i in range(CALLS):  # back to back, eagerly: each pass is milliseconds of GPU work
            call(i)
        torch.cuda.synchronize()
        totals += [s.elapsed_time(e) for s, _, e in marks]
        firsts += [s.elapsed_time(f) for s, f, _ in marks]
    return statistics.median(totals), statistics.median(firsts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seq", default="16384,32768")
    ap.add_argument("--heads", default="32/32,32/8")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for seq in (int(s) for s in args.seq.split(",")):
        for heads in args.heads.split(","):
            h, h_kv = (int(x) // WORLD for x in heads.split("/"))
            t = _tensors(seq, h, h_kv)
            for backward in (False, True):
                rec = {"seq_total": seq, "heads_per_rank": f"{h}/{h_kv}", "pass": "bwd" if backward else "fwd"}
                variants = (("one", 1), ("seq2", 2), ("par2", 2)) + ((("one+copy", 1),) if not backward else ())
                for variant, n in variants:
                    total, first = _time(variant, _groups(t, n), backward)
                    rec[f"{variant}_ms"], rec[f"{variant}_group0_ms"] = round(total, 4), round(first, 4)
                if not backward:
                    rec["copy_mib"] = round(sum(x.numel() * x.element_size() for x in (t["q"], t["k"], t["v"])) / 2**20)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "records": records}
    result["command"] = " ".join(["python3", *sys.argv])
    (out / "probe_attention_streams.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
