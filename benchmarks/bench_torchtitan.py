"""torchtitan 0.2.2 training with commopt against torchtitan's own inductor compile (issue 7).

Runs torchtitan's trainer (torchrun, one process per GPU) on the llama3 job of the recipe
(torch_commopt/integrations/torchtitan/llama3_debug_tp2_commopt.toml) twice from the same
seed and data: blocks compiled by commopt (the recipe's train spec), and the stock llama3
parallelize with `[compile] enable` (inductor).  TP = the number of GPUs (with SP; 1 on one
GPU, where there is nothing to overlap and the run only checks the plumbing on the device's
torch).  Parses torchtitan's per-step log lines (loss, memory, tps) and writes
torchtitan_<card>x<n>_<date>_b<batch>s<seq>.json/.md.

Each job is its own process and its steps drift as the GPUs heat (2x H100: up to 8%
within a job; commopt measured 1.083x inductor in one sequence of jobs and 0.976x in the next),
so the jobs run in `--rounds` rounds, the variant order reversed every other round (A B C, C B
A, ...: a drift that is linear in time cancels over two rounds), and the report compares each
variant with the inductor job of the same round, then takes the median over rounds.

Other parallelisms (`--job`): `moe-ep`, deepseek_v3 (debug flavor) with expert parallelism over
FSDP on every GPU, torchtitan's EP under inductor against commopt's exchange ("commopt-moe");
`cp-flex`, llama3 (8B_flex_4layers) with FlexAttention over documents and CP on every GPU (torch's
context_parallel), inductor against the blocks compiled by commopt.

    python3 benchmarks/bench_torchtitan.py --out DIR [--job tp|moe-ep|cp-flex] [--steps 20] [--flavor debugmodel]
        [--seq 2048] [--batch 8] [--rounds 2] [--commit SHA] [--extra=--optimizer.lr=3e-4]
        [--profile-step 10]

(BENCH_ARGS in device_run.sh is split on spaces: give --extra as one token, `--extra=--key=value`,
or several arguments in TT_EXTRA, which device_run.sh passes whole.)

torchtitan and its missing dependencies must be importable (device_run.sh's torchtitan mode
installs the carried wheels into a target directory and puts it on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import result_stem, write_report  # noqa: E402

TOML = ROOT / "torch_commopt/integrations/torchtitan/llama3_debug_tp2_commopt.toml"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naNinf]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
VARIANTS = {
    "commopt": ["--commopt.enable", "--compile.enable", "--compile.components", "loss"],  # loss by inductor, as below
    # the cost model and the whole-graph plan per block (the [commopt] section's mode; the
    # machine's calibration if `python -m torch_commopt calibrate` ran there, else the priors)
    "commopt-model": ["--commopt.enable", "--commopt.mode", "model", "--compile.enable", "--compile.components",
                      "loss"],
    # every region's eager calls replayed from per-call CUDA graphs (Config.call_graphs="all",
    # opt-in: torchtitan's trainer is host-bound)
    "commopt-call-graphs-all": ["--commopt.enable", "--commopt.options", '{"call_graphs": "all"}', "--compile.enable",
                                "--compile.components", "loss"],
    # graphs whose host is estimated not to run ahead of their GPU (the forward's) left to
    # Inductor (Config.host_bound_graphs="inductor", opt-in): torchtitan's
    # forward starts on an empty queue every step (the batch's copy synchronizes)
    "commopt-host-bound-inductor": ["--commopt.enable", "--commopt.options", '{"host_bound_graphs": "inductor"}',
                                    "--compile.enable", "--compile.components", "loss"],
    "inductor": ["--commopt.no-enable", "--compile.enable"],
    # a bound, not a backend: the inductor job with its compiled graphs' collectives taken out
    # (benchmarks/tt_comm_free.py): the blocks' communication all hidden; the eager parts keep theirs
    "inductor-comm-free": ["--commopt.no-enable", "--compile.enable", "--experimental.custom_import",
                           "benchmarks.tt_comm_free"],
    # torchtitan's async TP: Inductor's micro-pipeline pass (needs its model compile)
    "inductor+async-TP": ["--commopt.no-enable", "--compile.enable", "--parallelism.enable_async_tensor_parallel"],
    # MoE jobs: torchtitan compiles the layers' children (not the experts) with Inductor in both;
    # commopt swaps the experts' token exchange for its schedule (integrations/torchtitan/moe.py),
    # the tuner's pick; "inductor" above is torchtitan's own EP
    "commopt-moe": ["--commopt.enable", "--commopt.options", '{"moe_schedule": "auto"}', "--compile.enable"],
}


@dataclasses.dataclass(frozen=True)
class Job:
    """A parallelism of the benchmark: torchtitan's arguments on `ngpu` GPUs, the default model
    flavor and variants, and the data-parallel degree (global batch = local batch x dp)."""

    name: str
    flavor: str
    variants: str
    model: tuple = ()

    def args(self, ngpu: int) -> list[str]:
        n = str(ngpu)
        return list(self.model) + {
            "tp": ["--parallelism.tensor_parallel_degree", n],  # TP + SP over every GPU
            # expert parallelism borrowed from FSDP over every GPU
            "moe-ep": ["--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", n,
                       "--parallelism.expert_parallel_degree", n],
            # torch's context_parallel (FlexAttention: its head-tail balancer) over every GPU, FSDP over them
            "cp-flex": ["--parallelism.tensor_parallel_degree", "1", "--parallelism.context_parallel_degree", n],
        }[self.name]

    def dp(self, ngpu: int) -> int:
        return ngpu if self.name == "moe-ep" else 1

    def parallel(self, ngpu: int) -> str:
        return {"tp": f"TP={ngpu}", "moe-ep": f"EP={ngpu} FSDP={ngpu}", "cp-flex": f"CP={ngpu}"}[self.name]


JOBS = {
    "tp": Job("tp", "debugmodel", "commopt,inductor,inductor+async-TP"),
    "moe-ep": Job("moe-ep", "debugmodel", "commopt-moe,inductor", ("--model.name", "deepseek_v3_commopt")),
    # Llama-3-8B's layers with FlexAttention: the debug model's step is host time, not attention
    "cp-flex": Job("cp-flex", "8B_flex_4layers", "commopt,inductor"),
}


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def run_variant(name: str, args, out: pathlib.Path, ngpu: int, rnd: int = 0) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ngpu}",
           "-m", "torchtitan.train", "--job.config_file", str(TOML),
           *args.job.args(ngpu), "--training.steps", str(args.steps),
           "--training.seq_len", str(args.seq), "--training.local_batch_size", str(args.batch),
           "--model.flavor", args.flavor, "--debug.seed", "0",
           "--model.hf_assets_path", f"{args.assets}/tokenizer", "--training.dataset_path", f"{args.assets}/c4_test",
           "--job.dump_folder", str(pathlib.Path(args.dump) / f"{name}_r{rnd}"), "--training.dtype", args.dtype,
           *VARIANTS[name],
           *shlex.split(args.extra)]
    env = dict(os.environ)
    if args.profile_step:  # benchmarks/tt_profile.py: one step under torch.profiler, tables in the log
        if "--experimental.custom_import" not in cmd:  # tt_comm_free imports tt_profile itself
            cmd += ["--experimental.custom_import", "benchmarks.tt_profile"]
        env["TT_PROFILE_STEP"] = str(args.profile_step)
        # each rank's Chrome trace of that step, Python stacks included (device_run.sh tars them)
        env.update(TT_TRACE_DIR=str(out / "tt_traces"), TT_VARIANT=f"{name}_r{rnd}")
    log_path = out / f"torchtitan_{name}_r{rnd}.log"
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=ROOT,
                                env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    steps = {}
    for line in ANSI.sub("", log_path.read_text()).splitlines():
        m = STEP.search(line)
        if m:
            steps[int(m.group(1))] = (float(m.group(2)), float(m.group(3)), int(m.group(4).replace(",", "")))
    losses = [steps[s][0] for s in sorted(steps)]
    tps = [steps[s][2] for s in sorted(steps)][max(1, len(steps) // 4):]  # past compile and warm-up
    tokens_per_step = args.batch * args.seq * args.job.dp(ngpu)  # torchtitan's tps: per GPU of the whole step
    rec = {"model": f"{args.job.model[1] if args.job.model else 'llama3'} {args.flavor}",
           "parallel": args.job.parallel(ngpu), "seq": args.seq, "batch": args.batch, "dtype": args.dtype,
           "backend": name, "round": rnd,
           "returncode": rc, "steps_logged": len(steps), "losses": losses,
           "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
           "tokens_per_s": statistics.median(tps) * ngpu if tps else None,  # torchtitan's tps is per GPU
           "peak_mem_gib": max((v[1] for v in steps.values()), default=None)}
    rec["step_ms"] = 1e3 * tokens_per_step / rec["tokens_per_s"] if rec["tokens_per_s"] else None
    return rec


def round_orders(variants: list[str], rounds: int) -> list[list[str]]:
    """The variant order of each round: as given, reversed, as given, ..."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    return [list(variants) if r % 2 == 0 else list(reversed(variants)) for r in range(rounds)]


def paired(records: list[dict], ref: str = "inductor") -> dict[str, dict]:
    """Per backend: its median step ms over rounds, and its speedup over the `ref` job of the
    same round (ref's step ms / its step ms) in each round and their median."""
    by_round = {(r["backend"], r.get("round", 0)): r for r in records if r["step_ms"]}
    out = {}
    for backend in dict.fromkeys(r["backend"] for r in records):
        mine = sorted((rnd, r["step_ms"]) for (b, rnd), r in by_round.items() if b == backend)
        if not mine:
            continue
        ratios = [by_round[(ref, rnd)]["step_ms"] / ms for rnd, ms in mine if (ref, rnd) in by_round]
        out[backend] = {"step_ms_median": statistics.median(ms for _, ms in mine), "rounds": len(mine),
                        f"speedup_vs_{ref}_by_round": ratios,
                        f"speedup_vs_{ref}": statistics.median(ratios) if ratios else None}
    return out


def report(meta: dict, records: list[dict]) -> str:
    lines = [f"# torchtitan {meta['torchtitan']} with commopt vs inductor ({meta['device']})", "",
             f"torch {meta['torch']}, commit {meta['commit']}, {meta['date']}; command: `{meta['command']}`", "",
             "| backend | round | parallel | seq | batch | dtype | rc | steps | step ms | tokens/s | peak GiB | loss first | "
             "loss last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in records:
        lines.append(f"| {r['backend']} | {r.get('round', 0)} | {r['parallel']} | {r['seq']} | {r['batch']} | "
                     f"{r.get('dtype', '?')} | "
                     f"{r['returncode']} | "
                     f"{r['steps_logged']} | {fmt(r['step_ms'], '.1f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
                     f"{fmt(r['peak_mem_gib'], '.2f')} | {fmt(r['loss_first'], '.4f')} | "
                     f"{fmt(r['loss_last'], '.4f')} |")
    ref = next((r for r in records if r["backend"] == "inductor" and r["losses"]), None)
    others = [r for r in records if r is not ref and r["losses"] and r["backend"] != "inductor-comm-free"]
    if ref is not None and others:
        lines.append("")
        for r in others:  # the loss curves against the first inductor job (speed: paired by round, below)
            diff = max(abs(x - y) for x, y in zip(r["losses"], ref["losses"]))
            lines.append(f"- {r['backend']} (round {r.get('round', 0)}) vs inductor (round {ref.get('round', 0)}): "
                         f"largest per-step loss difference {diff:.4f} over "
                         f"{min(len(r['losses']), len(ref['losses']))} steps.")
    pairs = paired(records)
    if any(p["speedup_vs_inductor"] for p in pairs.values()):
        lines += ["", "Against the inductor job of the same round (the order reversed every other round), median "
                  "over rounds:", ""]
        for backend, p in pairs.items():
            if backend != "inductor" and p["speedup_vs_inductor"]:
                lines.append(f"- {backend}: {p['speedup_vs_inductor']:.3f}x inductor's tokens/s (rounds: "
                             + ", ".join(f"{x:.3f}" for x in p["speedup_vs_inductor_by_round"])
                             + f"); median step {p['step_ms_median']:.1f} ms")
    if "inductor-comm-free" in pairs:
        lines += ["", "inductor-comm-free is a bound, not a backend: the inductor job with every collective taken out "
                  "of its compiled graphs (the blocks', benchmarks/tt_comm_free.py), what hiding all of the blocks' "
                  "communication could reach at best; the embedding, output projection and loss keep their "
                  "collectives, and its losses are meaningless."]
    if any(r["losses"] for r in records):
        lines += ["", "Losses: " + "; ".join(f"{r['backend']} (round {r.get('round', 0)}): "
                                             + ", ".join(f"{x:.3f}" for x in r["losses"])
                                             for r in records if r["losses"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--job", default="tp", choices=sorted(JOBS),
                    help="tp: llama3 TP=W + SP; moe-ep: deepseek_v3 EP=W over FSDP=W; cp-flex: llama3 with "
                         "FlexAttention (documents), CP=W")
    ap.add_argument("--flavor", default=None, help="the model flavor (default: the job's)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--assets", default=None, help="the tokenizer and data set's directory (default: a new temporary one)")
    ap.add_argument("--variants", default=None, help=f"of {sorted(VARIANTS)} (default: the job's)")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--rounds", type=int, default=2,
                    help="run every variant this many times, the order reversed every other round")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="training.dtype of every variant: torchtitan 0.2.2 gives TP without FSDP no mixed "
                         "precision, so float32 trains in full fp32 (~870 ms a step at 8B_4layers "
                         "TP=2)")
    ap.add_argument("--extra", default="", help="more torchtitan CLI arguments for every variant")
    ap.add_argument("--commit", default="?")
    ap.add_argument("--profile-step", dest="profile_step", type=int, default=0,
                    help="profile this train step (benchmarks/tt_profile.py): op tables in torchtitan_<variant>.log, "
                         "each rank's Chrome trace in OUT/tt_traces")
    args = ap.parse_args()
    args.job = JOBS[args.job]
    args.flavor = args.flavor or args.job.flavor
    args.variants = args.variants or args.job.variants
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_torchtitan_")  # no fixed shared path: the assets and torchtitan's outputs
    args.assets = args.assets or os.path.join(work, "tt_assets")
    args.dump = os.path.join(work, "outputs")
    subprocess.run([sys.executable, "-m", "torch_commopt.integrations.torchtitan.assets", args.assets], check=True,
                   cwd=ROOT)
    import torch
    import torchtitan

    ngpu = gpus()
    device = torch.cuda.get_device_name() if ngpu else "cpu"
    meta = {"device": f"{ngpu}x {device}", "torch": torch.__version__,
            "torchtitan": getattr(torchtitan, "__version__", "0.2.2?"), "commit": args.commit,
            "date": datetime.date.today().isoformat(), "command": " ".join(["python3", *sys.argv])}
    records = []
    for rnd, names in enumerate(round_orders(args.variants.split(","), args.rounds)):
        for name in names:
            records.append(run_variant(name, args, out, ngpu, rnd))
            print(json.dumps({k: v for k, v in records[-1].items() if k != "losses"}), flush=True)
    job = "" if args.job.name == "tp" else f"{args.job.name}_"  # the TP reports keep their names
    stem = result_stem("torchtitan", device, ngpu, meta["date"], variant=f"{job}b{args.batch}s{args.seq}")
    write_report(out, stem, {"meta": meta, "records": records, "paired": paired(records)}, report(meta, records))
    print(report(meta, records))


if __name__ == "__main__":
    main()
