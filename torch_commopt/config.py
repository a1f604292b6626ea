"""Typed configuration of the commopt backend.

`torch.compile(model, backend="commopt", options={...})` maps its options dict onto
`Config` through `Config.from_options`; unknown keys and bad values raise `ValueError`
naming the field.  A `Config` round-trips through JSON (`to_json` / `from_json`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch_commopt.core.moe_spec import parse_moe_schedule
from torch_commopt.core.schedule import SINGLE, Schedule

PATTERNS = ("ag_matmul", "matmul_rs", "matmul_ar", "attention", "gemm_2d", "moe")
MODES = ("auto", "model", "autotune", "fixed")


@dataclass(kw_only=True, frozen=True)
class Config:
    """Options of the commopt backend: which regions are rewritten and how each one's schedule is
    chosen.  Keyword-only and frozen; every field is checked here (ValueError naming it), and a
    Config round-trips through JSON.  Every field, its type, default and meaning, and the
    environment variables beside them: docs/configuration.md.
    """

    schedule: str = "auto"  # "auto" (the rule or the tuner picks per region), a name, or a full schedule string
    chunks: int = 4  # pieces S of the chunked schedules (clamped to the dimension being cut)
    mode: str = "auto"  # how a region's schedule is chosen: auto, model, autotune or fixed (MODES)
    autotune_top_k: int = 4  # how many of the cost model's best candidates autotune times per region
    memory_budget_mib: float | None = None  # mode="model": extra device MiB one graph's schedules may hold
    cache_dir: str | None = None  # the tuner cache directory (None: $TORCH_COMMOPT_CACHE_DIR, else the user cache)
    patterns: tuple[str, ...] = PATTERNS  # the region finders that run, any subset of PATTERNS
    check_rank_consistency: bool = True  # compare the rewrite decisions across ranks once per graph
    consistency_timeout_s: float = 30.0  # how long a rank waits for the others in a cross-rank decision
    fx_graph_cache: bool = False  # Inductor's FX cache; a hit skips the pass on that rank only
    debug: bool = False  # record the rewritten graph's code in the explain report
    debug_waits: bool = False  # bound every GPU spin-wait and raise instead of hanging (a sync per op)
    cuda_graphs: bool = False  # the program is replayed from Inductor's CUDA graphs; rank by GPU time only
    band_in_graph: bool | str = True  # host-bound band regions take the GPU-time pick where the host runs ahead
    concat_k: bool = True  # a sum of matmuls feeding a reduction becomes one matmul over concatenated K
    k_parts: bool | str = "auto"  # concat-K's terms as K parts of our op, not concatenated ("auto": where cheaper)
    coconet: bool = False  # move an all-gather after the unary ops that consume it (not yet measured)
    ar_split: bool | str = False  # all-reduce -> reduce-scatter + row ops + all-gather; "checked" verifies
    ar_split_policy: str = "cost"  # which ar_split candidates split: "cost" (predicted faster) or "always"
    regather_for_backward: bool = False  # save each forward all-gather's shard; backward gathers again
    saved_gather_budget_mib: float | None = None  # MiB of gathered activations kept for backward
    attention_schedule: str = "auto"  # context-parallel attention schedule: "auto" or a CPSchedule string
    moe_schedule: str = "a2a"  # expert-parallel token exchange of optimize()'d MoE modules (core/moe_spec)
    extra_inductor_options: dict[str, Any] = field(default_factory=dict)  # passed on to Inductor

    # Experimental: measured as not paying by default; see docs/configuration.md#experimental
    call_graphs: bool | str = False  # eager GPU schedules replayed from per-call CUDA graphs (True or "all")
    host_bound_graphs: str = "overlap"  # "inductor": leave a graph whose host is behind its GPU to Inductor
    mesh2d_slices: int | None = None  # gemm_2d regions' slice count S (1: Collective, 0: SUMMA); None: the model
    mesh2d_axis_schedule: str = ""  # ls/rs gemm_2d regions: each slice's GEMM + reduce-scatter as this matmul_rs schedule

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str):
            raise ValueError(f"Config.schedule: expected a string, got {self.schedule!r}")
        if self.schedule != "auto":
            try:
                named = Schedule.parse(self.schedule)
            except ValueError as e:
                raise ValueError(f"Config.schedule: {str(e).removeprefix('schedule: ')}; expected 'auto' or a schedule "
                                 "string (docs/configuration.md)") from e
            if named.name == "autotune":  # its id names a request that only a compile registers
                raise ValueError(f"Config.schedule: {self.schedule!r} is the placeholder mode='autotune' writes; "
                                 "set mode='autotune' instead")
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"Config.mode: unknown {self.mode!r}; known: {MODES}")
        if self.mode == "fixed" and self.schedule == "auto":
            raise ValueError("Config.mode: 'fixed' needs Config.schedule to name a schedule")
        if self.mode in ("model", "autotune") and self.schedule != "auto":
            raise ValueError(f"Config.mode: {self.mode!r} chooses the schedule itself; drop schedule={self.schedule!r} "
                             "or use mode='fixed'")
        _check_number("memory_budget_mib", self.memory_budget_mib, what="a non-negative number of MiB or None",
                      optional=True)
        if self.memory_budget_mib is not None:
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
        if self.mesh2d_slices is not None:
            _check_type("mesh2d_slices", self.mesh2d_slices, int)
            if self.mesh2d_slices < 0:
                raise ValueError(f"Config.mesh2d_slices: must be >= 0 (0: SUMMA) or None, got {self.mesh2d_slices}")
        if not isinstance(self.mesh2d_axis_schedule, str):
            raise ValueError(f"Config.mesh2d_axis_schedule: expected a string, got {self.mesh2d_axis_schedule!r}")
        if self.mesh2d_axis_schedule:
            try:
                axis = Schedule.parse(self.mesh2d_axis_schedule)
            except ValueError as e:
                raise ValueError(f"Config.mesh2d_axis_schedule: {str(e).removeprefix('schedule: ')}") from e
            if not axis.valid_for("matmul_rs"):
                raise ValueError(f"Config.mesh2d_axis_schedule: {self.mesh2d_axis_schedule!r} is not a matmul_rs "
                                 "schedule")
        if isinstance(self.patterns, (list, str)):
            object.__setattr__(self, "patterns", tuple([self.patterns] if isinstance(self.patterns, str) else self.patterns))
        unknown = [p for p in self.patterns if p not in PATTERNS]
        if unknown:
            raise ValueError(f"Config.patterns: unknown pattern(s) {unknown}; known: {PATTERNS}")
        for name in ("check_rank_consistency", "fx_graph_cache", "debug", "debug_waits", "cuda_graphs", "coconet",
                     "concat_k", "regather_for_backward"):
            _check_type(name, getattr(self, name), bool)
        if not (isinstance(self.k_parts, bool) or self.k_parts == "auto"):
            raise ValueError(f"Config.k_parts: expected False, True or 'auto', got {self.k_parts!r}")
        if not (isinstance(self.call_graphs, bool) or self.call_graphs == "all"):
            raise ValueError(f"Config.call_graphs: expected False, True or 'all', got {self.call_graphs!r}")
        _check_number("saved_gather_budget_mib", self.saved_gather_budget_mib,
                      what="a non-negative number of MiB or None", optional=True)
        if self.saved_gather_budget_mib is not None:
            if self.regather_for_backward:
                raise ValueError("Config.saved_gather_budget_mib: regather_for_backward=True re-gathers every "
                                 "all-gather already; set one of the two")
        if not (isinstance(self.band_in_graph, bool) or self.band_in_graph == "training"):
            raise ValueError(f"Config.band_in_graph: expected False, True or 'training', got {self.band_in_graph!r}")
        if self.host_bound_graphs not in ("overlap", "inductor"):
            raise ValueError(f"Config.host_bound_graphs: expected 'overlap' or 'inductor', got {self.host_bound_graphs!r}")
        if not (isinstance(self.ar_split, bool) or self.ar_split == "checked"):
            raise ValueError(f"Config.ar_split: expected False, True or 'checked', got {self.ar_split!r}")
        if not isinstance(self.attention_schedule, str):
            raise ValueError(f"Config.attention_schedule: expected a string, got {self.attention_schedule!r}")
        if self.attention_schedule != "auto":
            from torch_commopt.core.attention_spec import CPSchedule, parse_flex_schedule

            try:
                CPSchedule.parse(self.attention_schedule)
            except (TypeError, ValueError) as e:
                try:  # a FlexAttention schedule (allgather:g=G is one, not an SDPA one)
                    parse_flex_schedule(self.attention_schedule)
                except ValueError as flex_e:
                    raise ValueError(f"Config.attention_schedule: {e}; and as a flex_attention schedule: {flex_e}") from e
        try:
            parse_moe_schedule(self.moe_schedule)
        except ValueError as e:
            raise ValueError(f"Config.moe_schedule: {e}") from e
        if self.ar_split_policy not in ("cost", "always"):
            raise ValueError(f"Config.ar_split_policy: expected 'cost' or 'always', got {self.ar_split_policy!r}")
        _check_number("consistency_timeout_s", self.consistency_timeout_s, what="a positive number of seconds",
                      positive=True)
        _check_type("extra_inductor_options", self.extra_inductor_options, dict)
        if self.extra_inductor_options:
            _check_inductor_keys(self.extra_inductor_options)

    @property
    def fixed_schedule(self) -> Schedule | None:
        """The schedule named by the config (None for "auto"); a bare name of a schedule in pieces
        takes `chunks` (the single-piece ones, core.schedule.SINGLE, stay one)."""
        if self.schedule == "auto":
            return None
        sched = Schedule.parse(self.schedule)
        if ":" not in self.schedule and sched.name not in SINGLE:
            sched = Schedule(sched.name, self.chunks)
        return sched

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "Config":
        """Build a Config from a torch.compile options dict; unknown keys raise."""
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"commopt options: expected a dict of Config fields (or a Config), "
                             f"got {type(options).__name__}")
        options = dict(options)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(options) - names))
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


def _check_number(name: str, value: Any, *, what: str, positive: bool = False, optional: bool = False) -> None:
    # nan compares false with everything, so "value < 0" alone lets it through (a nan timeout
    # makes every wait end at once); inf would make a wait unbounded.
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        try:
            ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
        except OverflowError:  # an int too large for a float
            ok = False
    if not ok:
        raise ValueError(f"Config.{name}: {what} (finite), got {value!r}")


def _check_inductor_keys(options: dict[str, Any]) -> None:
    # Inductor refuses an unknown key only when the compile applies the patches, inside dynamo,
    # where torch._dynamo.config.suppress_errors would turn the error into an eager run.
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(str(k) for k in options if not isinstance(k, str) or k not in known)
    if unknown:
        raise ValueError(f"Config.extra_inductor_options: unknown Inductor option(s) {unknown} "
                         "(torch._inductor.config)")
