"""Typed configuration of the commopt backend.

`torch.compile(model, backend="commopt", options={...})` maps its options dict onto
`Config` through `Config.from_options`; unknown keys and bad values raise `ValueError`
naming the field.  A `Config` round-trips through JSON (`to_json` / `from_json`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from torch_commopt.core.schedule import Schedule

PATTERNS = ("ag_matmul", "matmul_rs", "matmul_ar", "attention")
MODES = ("auto", "model", "autotune", "fixed")


@dataclass(kw_only=True, frozen=True)
class Config:
    """Options of the commopt backend.

    schedule: "auto" (default): on CUDA tensors the built-in rule
        (`torch_commopt.kernels.matmul.gpu.pick`) chooses per region among NCCL
        `sequential` and the GPU schedules; elsewhere `chunked` with `chunks`
        pieces.  Or one schedule for every region: a name ("sequential",
        "chunked", "ce_push", "ce_pull", "direct", "fused"; pieces from `chunks`) or a full
        schedule string ("fused:4:bm=128,bn=128").  A schedule an op does not
        have falls back to "auto" for that region (noted in explain).  A region whose rows
        are symbolic (dynamic shapes) runs schedule `auto` unless one is named here: the rule
        per call shape (`torch_commopt.kernels.matmul.auto`), whatever the mode.
    chunks: piece count S of the chunked schedules (clamped to the size of the
        dimension being cut, and noted when clamped).
    mode: how a schedule is chosen per region.  "auto" (default): `schedule` if it
        names one, else the built-in rule as above.  "model": the cost model
        (`torch_commopt.tuner`) ranks every candidate with this machine's calibration
        (measured and cached, or the reference machines' figures) and the fastest
        predicted wins; explain lists the candidates with their predicted times.
        "autotune": the model's `autotune_top_k` best candidates (with the other piece
        counts of its first and `sequential`) are timed by every rank at the region's
        first call, on that call's inputs (slowest rank counts); the fastest runs from
        then on and is cached, so later compiles emit it directly.  explain adds the
        measured times.  Context-parallel attention regions run the schedule the tuner
        cache holds for their shape (measured by `python -m torch_commopt tune --attention
        ...` or `torch_commopt.tuner.attention.tune.measure_and_store`; a training graph's kept
        tensors take the schedule's shapes when it is traced, so it cannot be timed at the
        first call), else the attention model's pick, noted in explain.
        "fixed": `schedule` must name the schedule (and its parameters).
    autotune_top_k: how many of the model's best candidates autotune times per region.
    memory_budget_mib: with mode="model", the extra device memory (MiB) the chosen schedules
        of one graph may hold together: each size class of symmetric buffers once (regions
        share them), plus the largest per-call need (staging, gathered copies); the fastest
        set of choices that fits is found exactly (reshard.plan).  A budget nothing fits runs
        the least-memory plan, logged.  None: no budget.
    cache_dir: the tuner cache directory (default $TORCH_COMMOPT_CACHE_DIR, else the
        user's cache directory).
    concat_k: a sum of matmuls that feeds a reduce-scatter or all-reduce (the backward of
        q/k/v or w1/w3: dX = dq Wq + dk Wk + dv Wv) becomes one matmul over its operands
        concatenated along K, so it forms an overlapped region (passes/matmul/concat_k.py; costs a
        copy of the A operands and of the weights per call, so it is undone where the region
        is kept as compiled).  On by default.
    k_parts: where an op of ours takes a concat-K matmul, hand it the sum's terms as K parts
        instead (kernels/ops.k_parts: one GEMM per term, added in place; the cats taken out
        again, so neither the stacked weights nor the A operands side by side are written).
        Off by default: on 2x H200 (session 39) a TP=2 training step ran the same with it as
        without (48.54 / 48.61 / 48.60 vs 48.53 / 48.51 / 48.48 ms).
    coconet: apply CoCoNet's all-gather reorder before finding regions: an all-gather whose
        result goes through unary elementwise ops (non-widening casts, activations) is
        moved after them, so they run on the shard and the gather meets its matmul
        (passes/matmul/coconet.py).  Off by default until measured on GPUs.
    ar_split: apply CoCoNet's all-reduce split where a GEMM sits on both sides: all_reduce ->
        row-local ops (residual add, norm) becomes reduce_scatter -> the ops on 1/W of the
        rows -> all_gather, which the region finders then overlap with both GEMMs
        (passes/matmul/ar_split.py).  ASSUMES the other operands of those ops (the residual stream,
        norm weights) hold the same values on every rank of the group, as in tensor
        parallelism without sequence parallelism; explain lists them.  Off by default.
        "checked": the same, and every call compares those operands across the ranks (a
        checksum all-gather each) and raises a clear error where they differ.
    attention_schedule: the context-parallel attention schedule of the regions the "attention"
        pattern rewrites (passes/attention/rewrite.py: inference graphs): "auto" (the attention cost
        model's first, or with mode="autotune" the measured winner where the tuner cache has
        one) or a name: allgather, ring, ring_zigzag, ulysses, hybrid:U:R, with `:g=G` for the
        head-group depth of ring_zigzag, ulysses and hybrid.
    regather_for_backward: save each forward all-gather's shard instead of its gathered
        result for backward; the backward gathers again (passes/matmul/regather.py): (W-1)/W of each
        gathered activation's memory for one more all-gather per region in backward.
    saved_gather_budget_mib: the most MiB per GPU that one graph's gathered activations kept
        for backward may hold beyond their shards; the forward all-gathers whose results do
        not fit are re-gathered in backward, chosen for the least predicted backward time
        (passes/regather.choose_regather).  None (default): all are kept.  Not with
        regather_for_backward (which re-gathers all).
    ar_split_policy: which candidates ar_split rewrites: "cost" (default) those the cost
        model predicts faster split than kept as an all-reduce (reshard/ar_cost.py; the
        machine's calibration, else the priors; explain notes both times), "always" every
        candidate with a GEMM on both sides.
    cuda_graphs: the compiled program is replayed from CUDA graphs: Inductor's CUDA-graph
        trees are turned on (`triton.cudagraphs`; extra_inductor_options can turn them
        off again, e.g. for a capture of your own around the compiled module); the
        built-in rule and the cost model rank schedules by GPU time only, since a replay
        pays no per-call host cost, and autotune times replays of captured calls (its
        own cache entries).  GPU schedules run inside a capture either way (their flags
        hold constants); the fused reductions run ce_push there (logged).
    call_graphs: eager programs (cuda_graphs off): a region whose GEMM is estimated between
        0.1 and 0.5 ms, where an eager GPU schedule's host cost (0.13-0.7 ms a call) would
        decide its time, runs its schedule with cg=1 -- each call captured into a CUDA graph the second
        time the same call (tensor addresses, shapes, buffer half) is seen, and replayed
        from then on (kernels/gpu/call_graphs.py) -- and the rule and the cost model rank
        those regions as replayed.  Off by default: in an isolated op loop it pays (2x H100,
        M_global 2048, K = N = 8192: AG / RS / AR 1.40x / 1.38x / 1.14x NCCL eager), but in a
        TP=4 training step (4x H100, bench_e2e, session 35) the calls' tensors' addresses did not
        recur often enough -- ~1.7 captures a step at several ms of host each -- and the step
        ran 0.80-0.87x inductor against 0.84 without.  TORCH_COMMOPT_CALL_GRAPHS=0 turns the
        replays off in a process (the calls then run eagerly).  "all" (opt-in): every eager
        GPU region from 0.1 ms of GEMM up, long ones too, for host-bound training steps.
        Measured at TP=2 (2x H200, session 54, 4 Llama-3-8B layers, 8192 tokens a step): it
        does not pay -- 1.052x / 1.047x / 1.019x inductor at batch 1 / 2 / 4 against 1.067x /
        1.052x / 1.050x without -- the calls' arguments moved between steps often enough
        (~330 captures and ~2000 replays a rank over the run, each moved argument a copy).
    band_in_graph: eager programs, the built-in rule: a region in its host-bound band (0.1-0.5 ms
        of GEMM, otherwise timed against NCCL at its first call) takes the rule's GPU-time pick
        when its graph's host runs ahead of the GPU -- estimated from the graph's matmuls and
        attention against its node count and regions (passes/host_ahead.py; explain notes the
        figures per graph) -- since the host's enqueue is then hidden.  False: always timed at
        the first call.  "training": as True, and a training forward graph is counted together
        with the backward it implies (estimated from the forward): back to back, the backward's
        lead hides the next forward's host (opt-in until measured in training).
    host_bound_graphs: eager programs, the built-in rule: what a graph whose host is estimated
        not to run ahead of its GPU (passes/host_ahead.py, the same figures band_in_graph uses)
        gets.  "overlap" (default): its regions run GPU schedules like any other graph's.
        "inductor": the graph is left to Inductor, collectives and all (explain notes why): an
        eager GPU schedule's call costs 0.3-0.5 ms of host against 0.14-0.17 ms for NCCL +
        cuBLAS (2x H200, session 54, TP=2 training at 8192 tokens), and a graph whose GPU
        waits for its host is slowed by that -- meant for trainers that synchronize every step
        (torchtitan: the batch's host-to-device copy), whose forward starts on an empty queue.
        Measured in session 54, it does not pay there (bench_e2e batch 4 x 2048 1.026x
        inductor against 1.039x; torchtitan 2 x 4096 1.012x against 1.025x): opt-in, for
        slower hosts.
    debug_waits: GPU schedules bound every spin-wait and raise a clear error
        naming the op, rank and chunk instead of hanging (also enabled by the
        environment variable TORCH_COMMOPT_DEBUG_WAITS=1); costs a sync per op.
    patterns: the region finders that run, by name; any subset of PATTERNS.
    check_rank_consistency: hash the rewrite decisions and compare them across
        ranks once per compiled graph; on mismatch the graph is left untouched.
    consistency_timeout_s: how long a rank waits for the others' plan hashes.
    fx_graph_cache: let Inductor serve compiled graphs from its FX cache.  Off by
        default: a cache hit skips the commopt pass (and its rank check) on that
        rank only, so ranks with different cache contents could run different
        collectives.  Turn it on when every rank shares one cache directory.
    debug: record the rewritten graph's code in the explain report.
    """

    schedule: str = "auto"
    chunks: int = 4
    mode: str = "auto"
    autotune_top_k: int = 4
    memory_budget_mib: float | None = None
    cache_dir: str | None = None
    patterns: tuple[str, ...] = PATTERNS
    check_rank_consistency: bool = True
    consistency_timeout_s: float = 300.0
    fx_graph_cache: bool = False
    debug: bool = False
    debug_waits: bool = False
    cuda_graphs: bool = False
    call_graphs: bool | str = False
    band_in_graph: bool | str = True
    host_bound_graphs: str = "overlap"
    concat_k: bool = True
    k_parts: bool = False
    coconet: bool = False
    ar_split: bool | str = False
    ar_split_policy: str = "cost"
    regather_for_backward: bool = False
    saved_gather_budget_mib: float | None = None
    attention_schedule: str = "auto"
    extra_inductor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str):
            raise ValueError(f"Config.schedule: expected a string, got {self.schedule!r}")
        if self.schedule != "auto":
            try:
                Schedule.parse(self.schedule)
            except ValueError as e:
                raise ValueError(f"Config.schedule: {self.schedule!r} is not 'auto' or a schedule ({e})") from e
        if self.mode not in MODES:
            raise ValueError(f"Config.mode: unknown {self.mode!r}; known: {MODES}")
        if self.mode == "fixed" and self.schedule == "auto":
            raise ValueError("Config.mode: 'fixed' needs Config.schedule to name a schedule")
        if self.mode in ("model", "autotune") and self.schedule != "auto":
            raise ValueError(f"Config.mode: {self.mode!r} chooses the schedule itself; drop schedule={self.schedule!r} "
                             "or use mode='fixed'")
        if self.memory_budget_mib is not None:
            if isinstance(self.memory_budget_mib, bool) or not isinstance(self.memory_budget_mib, (int, float)) \
                    or self.memory_budget_mib < 0:
                raise ValueError(f"Config.memory_budget_mib: a non-negative number of MiB or None, "
                                 f"got {self.memory_budget_mib!r}")
            if self.mode != "model":
                raise ValueError("Config.memory_budget_mib: only mode='model' plans under a budget so far")
        _check_type("autotune_top_k", self.autotune_top_k, int)
        if self.autotune_top_k < 1:
            raise ValueError(f"Config.autotune_top_k: must be >= 1, got {self.autotune_top_k}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            raise ValueError(f"Config.cache_dir: expected a path string or None, got {self.cache_dir!r}")
        _check_type("chunks", self.chunks, int)
        if self.chunks < 1:
            raise ValueError(f"Config.chunks: must be >= 1, got {self.chunks}")
        if isinstance(self.patterns, (list, str)):
            object.__setattr__(self, "patterns", tuple([self.patterns] if isinstance(self.patterns, str) else self.patterns))
        unknown = [p for p in self.patterns if p not in PATTERNS]
        if unknown:
            raise ValueError(f"Config.patterns: unknown pattern(s) {unknown}; known: {PATTERNS}")
        for name in ("check_rank_consistency", "fx_graph_cache", "debug", "debug_waits", "cuda_graphs", "coconet",
                     "concat_k", "k_parts", "regather_for_backward"):
            _check_type(name, getattr(self, name), bool)
        if not (isinstance(self.call_graphs, bool) or self.call_graphs == "all"):
            raise ValueError(f"Config.call_graphs: expected False, True or 'all', got {self.call_graphs!r}")
        if self.saved_gather_budget_mib is not None:
            if isinstance(self.saved_gather_budget_mib, bool) or not isinstance(self.saved_gather_budget_mib,
                                                                                  (int, float)) \
                    or self.saved_gather_budget_mib < 0:
                raise ValueError(f"Config.saved_gather_budget_mib: a non-negative number of MiB or None, "
                                 f"got {self.saved_gather_budget_mib!r}")
            if self.regather_for_backward:
                raise ValueError("Config.saved_gather_budget_mib: regather_for_backward=True re-gathers every "
                                 "all-gather already; set one of the two")
        if not (isinstance(self.band_in_graph, bool) or self.band_in_graph == "training"):
            raise ValueError(f"Config.band_in_graph: expected False, True or 'training', got {self.band_in_graph!r}")
        if self.host_bound_graphs not in ("overlap", "inductor"):
            raise ValueError(f"Config.host_bound_graphs: expected 'overlap' or 'inductor', got {self.host_bound_graphs!r}")
        if self.ar_split not in (False, True, "checked"):
            raise ValueError(f"Config.ar_split: expected False, True or 'checked', got {self.ar_split!r}")
        if self.attention_schedule != "auto":
            from torch_commopt.core.attention_spec import CPSchedule

            try:
                CPSchedule.parse(self.attention_schedule)
            except (TypeError, ValueError) as e:
                raise ValueError(f"Config.attention_schedule: {e}") from e
        if self.ar_split_policy not in ("cost", "always"):
            raise ValueError(f"Config.ar_split_policy: expected 'cost' or 'always', got {self.ar_split_policy!r}")
        if not isinstance(self.consistency_timeout_s, (int, float)) or self.consistency_timeout_s <= 0:
            raise ValueError(f"Config.consistency_timeout_s: must be a positive number, got {self.consistency_timeout_s!r}")
        _check_type("extra_inductor_options", self.extra_inductor_options, dict)

    @property
    def fixed_schedule(self) -> Schedule | None:
        """The schedule named by the config (None for "auto"); a bare name takes `chunks`."""
        if self.schedule == "auto":
            return None
        sched = Schedule.parse(self.schedule)
        if ":" not in self.schedule and sched.name != "sequential":
            sched = Schedule(sched.name, self.chunks)
        return sched

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "Config":
        """Build a Config from a torch.compile options dict; unknown keys raise."""
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"commopt options: unknown key(s) {unknown}; known: {sorted(names)}")
        return cls(**options)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls.from_options(json.loads(text))


def _check_type(name: str, value: Any, typ: type) -> None:
    # bool is a subclass of int: reject it where an int is meant.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ValueError(f"Config.{name}: expected {typ.__name__}, got {value!r}")
