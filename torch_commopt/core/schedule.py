"""Schedules of a distributed operator, and their string form carried by the custom ops.

String form: `name[:chunks[:key=value,key=value...]]`, e.g. `sequential`, `chunked:4`,
`ce_push:2`, `fused:4:bm=128,bn=256,bk=64,warps=8,stages=3,store=direct`.  Parsing is strict
(`Schedule.parse`): chunks are decimal digits, each key is known and given once, integer values
are decimal digits, text values are tokens of letters, digits and `_.-`; `sequential` has no
piece count but 1 (its string with parameters is `sequential:1:dbg=1`), nor do `gather_sum`,
`scatter_gather`, `oneshot` and `twoshot`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

# Which schedules each op has (the reference schedules run everywhere; the rest need CUDA
# and symmetric memory, and run their reference twin anywhere else).
OP_SCHEDULES = {
    "ag_matmul": ("sequential", "chunked", "local_first", "ce_push", "fused", "autotune", "auto"),
    "matmul_rs": ("sequential", "chunked", "ce_push", "ce_pull", "direct", "fused", "autotune", "auto"),
    "matmul_ar": ("sequential", "chunked", "ce_push", "ce_pull", "direct", "autotune", "auto", "gather_sum",
                  "scatter_gather", "oneshot", "twoshot"),
}
# Schedules of one piece only: their string form is the name alone.
SINGLE = ("sequential", "gather_sum", "scatter_gather", "oneshot", "twoshot")
GPU_NAMES = ("ce_push", "ce_pull", "direct", "fused", "oneshot", "twoshot")
PARAM_KEYS = {
    "bm": int, "bn": int, "bk": int, "gm": int, "warps": int, "stages": int, "sms": int,
    "store": str, "dbg": int, "id": str, "gemm": str, "tma": int, "par": int, "graphs": int,
    "cg": int, "tma_store": int, "flat": int, "impl": str,
}
IMPLS = ("triton", "sm90")  # fused's impl=: the Triton kernels or the CUDA ones for Hopper (kernels/matmul/gpu/sm90.py)
STORES = ("ce", "direct")  # fused's store=
_DIGITS = re.compile(r"[0-9]+")
_TOKEN = re.compile(r"[A-Za-z0-9_.-]+")  # a text parameter's value (store, gemm, an autotune id)


@dataclass(frozen=True)
class Schedule:
    """How a region runs.

    sequential: the collective, then the compute (NCCL + cuBLAS on the GPU).
    chunked(S): the collective cut into S pieces along one dimension, each piece
        consumed (or produced) by the compute as it arrives, so that transfer of
        piece j+1 overlaps the compute of piece j (MeshSlice slicing, Mercury shift).
        Plain torch + c10d: runs on any backend; the reference of the GPU schedules.
    local_first: all-gather only.  The collective is issued asynchronously and the
        rank's own shard is multiplied while it travels; the peers' rows follow in one
        or two GEMMs.  Plain torch + c10d (NCCL on the GPU): the cheapest overlap to
        launch, for short GEMMs where host time bounds the GPU schedules.
    ce_push(S): GPU.  Copy engines push S pieces per rank into peers' symmetric buffers
        (signalled by stream flag writes) while cuBLAS computes the pieces already there.
        All-gather with gemm=whole: the pieces are pushed the same way, but one GEMM runs
        over the gathered rows once all are there (short M, where each GEMM re-reads B).
        All-gather with par=1: the peers' GEMMs run on a second compute stream, beside the
        own shard's (short M, where one shard's GEMM fills few SMs).
    ce_pull(S): GPU, reductions.  Each rank computes a peer's partial into its own
        symmetric buffer (local stores) and flags it; the peer's copy engine pulls it
        straight into its output, where its own GEMM adds in place (no staging copy).
        Two ranks only: over more it runs ce_push (matmul_reduce.pull_placed).
    direct(S): GPU, reductions.  cuBLAS writes each peer's partial straight into that
        peer's symmetric buffer (NVLink stores); the reduction is fused into the
        epilogue (addmm) of the rank's own piece.
    fused(S): GPU.  One persistent Triton GEMM that waits on per-chunk flags (all-gather)
        or releases per-chunk tile counters (reduce-scatter); params: tile sizes
        bm/bn/bk, group gm, warps, stages, sms (grid), store=ce|direct.
    gather_sum: all-reduce only.  Every rank's partial all-gathered, then summed in fp32 in rank
        order 0..W-1 and cast once: every rank gets the same bits, and so does scatter_gather.
        Plain torch + c10d: the reference of the low-latency one-shot all-reduce.
    scatter_gather: all-reduce only.  The partial cut into W element segments; rank r sums
        segment r of every rank in fp32 in rank order (an all-to-all), then the sums are
        all-gathered.  Plain torch + c10d: the reference of the two-shot all-reduce.
    oneshot: GPU, all-reduce only, decode-sized calls.  The product computed into this rank's slot
        of the low-latency buffer, then one kernel: a barrier, every rank's slot summed in fp32 in
        rank order (gather_sum's bits, its reference twin), a barrier.  Any row count.
    twoshot: GPU, all-reduce only.  The same slot; the kernel sums one element segment per rank
        and copies every rank's sums out (scatter_gather's bits, its twin): fewer bytes read than
        oneshot at more ranks and larger messages.
    autotune(id=...): a placeholder of Config.mode="autotune": the first call times the
        candidates registered under `id` (tuner.autotune) and runs the winner from then on.
    auto(S): a region whose row count is symbolic (compiled with dynamic shapes): each call
        runs what the built-in rule picks for its concrete shape (kernels.auto), on CUDA
        by the GPU rule (graphs=1: its CUDA-graph variant), elsewhere chunked(S).
    Any schedule takes dbg=1: bounded spin-waits that raise instead of hanging.
    GPU schedules (and autotune's placeholder, for its winner) take cg=1: an eager call is captured into a CUDA graph the second
    time the same call (addresses, shapes, buffer half) is seen and replayed from then on, so
    a short call stops paying its host cost (kernels/gpu/call_graphs.py, Config.call_graphs).
    """

    name: str
    chunks: int = 1
    params: tuple[tuple[str, int | str], ...] = ()

    NAMES: ClassVar[tuple[str, ...]] = ("sequential", "chunked", "local_first", "ce_push", "ce_pull", "direct", "fused",
                                        "autotune", "auto", "gather_sum", "scatter_gather", "oneshot", "twoshot")

    def __post_init__(self) -> None:
        if self.name not in self.NAMES:
            raise ValueError(f"schedule: unknown name {self.name!r}; known: {self.NAMES}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise ValueError(f"schedule: chunks must be an integer >= 1, got {self.chunks!r}")
        if self.name in SINGLE and self.chunks != 1:
            raise ValueError(f"schedule: {self.name} takes no piece count, got {self.chunks}")
        keys = [kv[0] for kv in self.params]
        if len(set(keys)) != len(keys):
            raise ValueError(f"schedule: a parameter is given twice in {keys}")
        for key, value in self.params:
            typ = PARAM_KEYS.get(key)
            if typ is None:
                raise ValueError(f"schedule: unknown parameter {key!r}; known: {sorted(PARAM_KEYS)}")
            if typ is int:
                good = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            else:  # written between ':' ',' '=' in the string form: a token only, so it round-trips
                good = isinstance(value, str) and _TOKEN.fullmatch(value) is not None
            if not good:
                raise ValueError(f"schedule: bad parameter {key}={value!r} (expected "
                                 f"{'an integer >= 0' if typ is int else 'a token of letters, digits, _.-'})")
        if dict(self.params).get("store", STORES[0]) not in STORES:
            raise ValueError(f"schedule: store is one of {STORES}, got {dict(self.params)['store']!r}")
        if dict(self.params).get("gemm", "whole") != "whole" or (dict(self.params).get("gemm") and self.name != "ce_push"):
            raise ValueError(f"schedule: gemm=whole is a ce_push option (the only value); got {self.name} "
                             f"gemm={dict(self.params)['gemm']!r}")
        par = dict(self.params).get("par")
        if par is not None and (self.name != "ce_push" or par not in (0, 1) or dict(self.params).get("gemm")):
            raise ValueError(f"schedule: par=0/1 is a ce_push option (not with gemm=whole); got {self.name} par={par!r}")
        if dict(self.params).get("tma") is not None and (self.name != "fused" or dict(self.params)["tma"] not in (0, 1)):
            raise ValueError(f"schedule: tma=0/1 is a fused option; got {self.name} tma={dict(self.params)['tma']!r}")
        tstore = dict(self.params).get("tma_store")
        if tstore is not None and (self.name != "fused" or tstore not in (0, 1) or dict(self.params).get("tma") != 1):
            raise ValueError(f"schedule: tma_store=0/1 is a fused option with tma=1; got {self.name} "
                             f"{dict(self.params)}")
        flat = dict(self.params).get("flat")
        if flat is not None and (self.name != "fused" or flat not in (0, 1) or dict(self.params).get("tma") != 1):
            raise ValueError(f"schedule: flat=0/1 is a fused option with tma=1; got {self.name} {dict(self.params)}")
        impl = self.param("impl")
        if impl is not None and (self.name != "fused" or impl not in IMPLS):
            raise ValueError(f"schedule: impl is a fused option, one of {IMPLS}; got {self.name} impl={impl!r}")
        graphs = self.param("graphs")
        if graphs is not None and (self.name != "auto" or graphs not in (0, 1)):
            raise ValueError(f"schedule: graphs=0/1 is an auto option; got {self.name} graphs={graphs!r}")
        cg = self.param("cg")
        if cg is not None and (cg not in (0, 1) or not (self.name in GPU_NAMES or self.name == "autotune")):
            raise ValueError(f"schedule: cg=0/1 is an option of the GPU schedules and autotune; got {self.name} cg={cg!r}")
        object.__setattr__(self, "params", tuple(sorted(self.params)))

    def __str__(self) -> str:
        if self.name in SINGLE and not self.params:
            return self.name
        text = f"{self.name}:{self.chunks}"
        if self.params:
            text += ":" + ",".join(f"{k}={v}" for k, v in self.params)
        return text

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """The schedule a string names (the module docstring's form); ValueError for anything
        else: an unknown name or key, a piece count that is not digits, a key given twice, an
        empty or extra part."""
        if not isinstance(text, str):
            raise ValueError(f"schedule: expected a string, got {text!r}")
        try:
            return cls._parse(text)
        except ValueError as e:
            raise ValueError(f"schedule: cannot parse {text!r} ({str(e).removeprefix('schedule: ')})") from e

    @classmethod
    def _parse(cls, text: str) -> "Schedule":
        parts = text.split(":")
        if len(parts) > 3:
            raise ValueError("more than name:chunks:params")
        name = parts[0]
        if name not in cls.NAMES:
            raise ValueError(f"unknown name {name!r}; known: {cls.NAMES}")
        if len(parts) == 1:
            return cls(name)
        if not _DIGITS.fullmatch(parts[1]):
            raise ValueError(f"the piece count must be digits, got {parts[1]!r}")
        params = []
        if len(parts) == 3:
            for item in parts[2].split(","):
                key, eq, value = item.partition("=")
                if not eq or key not in PARAM_KEYS:
                    raise ValueError(f"expected key=value with a key of {sorted(PARAM_KEYS)}, got {item!r}")
                if PARAM_KEYS[key] is int:
                    if not _DIGITS.fullmatch(value):
                        raise ValueError(f"{key} takes an integer, got {value!r}")
                    params.append((key, int(value)))
                else:
                    params.append((key, value))
        return cls(name, int(parts[1]), tuple(params))

    @property
    def is_gpu(self) -> bool:
        return self.name in GPU_NAMES

    def param(self, key: str, default=None):
        for k, v in self.params:  # a few pairs, read several times a call: no dict built per lookup
            if k == key:
                return v
        return default

    def with_params(self, **params) -> "Schedule":
        merged = dict(self.params, **params)
        return Schedule(self.name, self.chunks, tuple(merged.items()))

    def without_debug(self) -> "Schedule":
        """The same schedule without dbg=1 (how candidates are named)."""
        return Schedule(self.name, self.chunks, tuple(kv for kv in self.params if kv[0] != "dbg"))

    def in_capture(self, op: str) -> "Schedule":
        """What runs for `op` inside a CUDA-graph capture: a fused reduction's barrier counts
        epochs, so it runs ce_push with the same pieces (and debug setting); the rest as is."""
        if self.name == "fused" and op != "ag_matmul":
            return Schedule("ce_push", self.chunks, tuple(kv for kv in self.params if kv[0] == "dbg"))
        return self

    def at_world(self, world: int) -> "Schedule":
        """What runs over `world` ranks: ce_pull over two only, ce_push with the same pieces (and
        debug and call-graph settings) over more -- a push into a peer's buffer half waits for that
        peer's token to the writer, while a third rank's pulls of that half are guarded by a token
        in the peer's flags, which no writer waits for; the rest as is."""
        if self.name == "ce_pull" and world > 2:
            return Schedule("ce_push", self.chunks, tuple(kv for kv in self.params if kv[0] in ("dbg", "cg")))
        return self

    def reference_twin(self) -> "Schedule":
        """The plain torch + c10d schedule computing the same pieces in the same order."""
        if self.name in ("gather_sum", "scatter_gather"):
            return Schedule(self.name)
        if self.name in ("oneshot", "twoshot"):
            return Schedule("gather_sum" if self.name == "oneshot" else "scatter_gather")
        if self.name == "sequential" or self.chunks == 1:
            return Schedule("sequential")
        return Schedule("chunked", self.chunks)

    def clamp(self, size: int) -> "Schedule":
        """The same schedule with at most `size` chunks (a dimension of `size` rows)."""
        if self.name not in SINGLE and self.chunks > size:
            return Schedule(self.name, max(1, size), self.params)
        return self

    def valid_for(self, kind: str) -> bool:
        """Whether an op of `kind` runs this schedule (gemm=whole, par=1: all-gather only)."""
        ag_only = self.param("gemm") is not None or self.param("par") is not None
        return self.name in OP_SCHEDULES[kind] and (not ag_only or kind == "ag_matmul")
