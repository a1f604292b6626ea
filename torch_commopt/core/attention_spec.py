"""Context-parallel attention schedules by name, and why a schedule cannot take a shape.

String form (what the custom ops carry):
    allgather      all-gather K/V, then local attention (the reference)
    ring           K/V shifted one peer per step, partials merged by lse
    ring_zigzag    ring on the causal load-balanced layout (rank r: chunks r and 2W-1-r);
                   without a causal mask there is nothing to balance and it runs ring
    ulysses        all-to-all sequence -> heads, full-sequence attention, all-to-all back
    ulysses:early  ulysses whose forward attention starts on the rank's own block while the peers'
                   arrive, block by block, each result piece sent back once final (own_first.py)
    hybrid:U:R     Ulysses over groups of U consecutive ranks, a ring over R such groups
                   (U * R = W); hybrid:W:1 is ulysses, hybrid:1:W is ring.

The schedules that move their inputs (ulysses, hybrid, ring_zigzag) pipeline the moves over
head groups; `:g=G` names the depth (e.g. ulysses:g=1, hybrid:2:2:g=2), else the rule below
(ulysses_head_groups, zigzag_head_groups) picks it.  G splits the attention into G calls
(on one H200 at 16K tokens, MHA, two calls cost 0.2 ms more forward and 0.3 ms backward than
one: docs/context-parallel-attention.md) against the moves it hides.

Every schedule takes the program's contiguous layout: rank r holds tokens [r*S_loc, (r+1)*S_loc).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Union

_DIGITS = re.compile(r"[0-9]+")


class AttentionShape(NamedTuple):
    """Global shape of one attention call: q (B, H, S, D), k/v (B, H_kv, S, D), S = W * S_loc."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int


@dataclass(frozen=True)
class CPSchedule:
    """A parsed schedule name; `ulysses` x `ring` are the hybrid's degrees (0 for the others)."""

    name: str
    ulysses: int = 0
    ring: int = 0
    groups: int = 0  # head groups its moves are pipelined over (0: the rule's choice)
    early: bool = False  # ulysses only: the attention starts on the own block (own_first.py)

    NAMES: ClassVar[tuple[str, ...]] = ("allgather", "ring", "ring_zigzag", "ulysses", "hybrid")
    PIPELINED: ClassVar[tuple[str, ...]] = ("ring_zigzag", "ulysses", "hybrid")

    def __post_init__(self) -> None:
        if self.name not in self.NAMES:
            raise ValueError(f"cp schedule: unknown name {self.name!r}; known: {self.NAMES} (hybrid as hybrid:U:R)")
        degrees = (self.ulysses, self.ring)
        if self.name == "hybrid" and min(degrees) < 1:
            raise ValueError(f"cp schedule: hybrid needs degrees U, R >= 1, got {degrees}")
        if self.name != "hybrid" and degrees != (0, 0):
            raise ValueError(f"cp schedule: {self.name} takes no degrees, got {degrees}")
        if self.early and self.name != "ulysses":
            raise ValueError(f"cp schedule: early is a ulysses option, not {self.name}'s")
        if self.groups < 0 or self.groups and self.name not in self.PIPELINED:
            raise ValueError(f"cp schedule: head groups g={self.groups} for {self.name} (only {self.PIPELINED} "
                             "pipeline over head groups, g >= 1)")

    @classmethod
    def parse(cls, text: Union[str, "CPSchedule"]) -> "CPSchedule":
        """The schedule a string names (the module docstring's forms, in the order `__str__`
        writes them: name[:U:R][:early][:g=G]); ValueError for anything else: an unknown name,
        degrees or g that are not decimal digits, a part given twice, an empty or extra part,
        surrounding space."""
        if isinstance(text, CPSchedule):
            return text
        if not isinstance(text, str):
            raise ValueError(f"cp schedule: expected a string, got {text!r}")
        name, *rest = text.split(":")
        if name not in cls.NAMES:
            raise ValueError(f"cp schedule: unknown name {name!r} in {text!r}; known: {cls.NAMES} "
                             "(hybrid as hybrid:U:R)")
        groups = 0
        if rest and rest[-1].startswith("g="):
            depth = rest.pop()[2:]
            if not _DIGITS.fullmatch(depth):
                raise ValueError(f"cp schedule: head groups are written g=G (e.g. ulysses:g=2), got {text!r}")
            groups = int(depth)
            if groups < 1:
                raise ValueError(f"cp schedule: head groups must be >= 1, got {text!r}")
        early = rest == ["early"]
        if early:
            rest = []
        if name != "hybrid":
            if rest:
                raise ValueError(f"cp schedule: {name} takes no parameters but early and g=G, in that order, "
                                 f"got {text!r}")
            return cls(name, groups=groups, early=early)
        if early:
            raise ValueError(f"cp schedule: early is a ulysses option, got {text!r}")
        if len(rest) != 2 or not all(_DIGITS.fullmatch(r) for r in rest):
            raise ValueError(f"cp schedule: hybrid is written hybrid:U:R (e.g. hybrid:2:4), got {text!r}")
        return cls("hybrid", int(rest[0]), int(rest[1]), groups)

    def __str__(self) -> str:
        text = f"hybrid:{self.ulysses}:{self.ring}" if self.name == "hybrid" else self.name
        text += ":early" if self.early else ""
        return f"{text}:g={self.groups}" if self.groups else text

    def degrees(self, world: int) -> tuple[int, int]:
        """(Ulysses degree, ring degree) over a group of `world` ranks."""
        if self.name == "hybrid":
            return self.ulysses, self.ring
        return (world, 1) if self.name == "ulysses" else (1, world)


# ring_zigzag on a contiguous program relays its inputs to the zigzag layout and its results
# back (all-to-alls); done for all heads at once, neither hides behind compute (at 8K tokens/GPU,
# world 2, MHA: ~1.2 ms per fwd+bwd on ~8 ms).  Split over head groups, group g+1's relayout is
# in flight while group g's ring computes and group g's results travel back meanwhile; each
# group's kernels get H/G heads, so G stays small and applies to large shards only.
ZIGZAG_PIPELINE_MIN_BYTES = 32 << 20  # q bytes of one rank per head group


def zigzag_head_groups(q_bytes: int, kv_heads: int) -> int:
    """How many head groups ring_zigzag pipelines its relayouts over (schedules and the cost
    model): 2 when each group keeps >= ZIGZAG_PIPELINE_MIN_BYTES of q and the K/V heads split
    evenly, else 1."""
    return 2 if kv_heads % 2 == 0 and q_bytes // 2 >= ZIGZAG_PIPELINE_MIN_BYTES else 1


# Ulysses (and hybrid) move every input and result through all-to-alls.  Split over head
# groups, group g+1's inputs travel while group g's attention runs and group g's results travel
# back meanwhile (schedules._pipelined, ce_a2a.pipelined): only the first group's inputs and the
# last group's results are exposed.  Two groups run fastest and four lose, with NCCL (every
# group adds ~16 c10d calls' host time; NCCL's kernels share the SMs with cuDNN's) and by the
# copy engine (ce_a2a: no SM, little host time) alike: each group's attention loses to the tail
# of its last wave as its heads shrink (H 32, fwd+bwd, 16K tokens on an H200 pair: attention
# alone 6.53 / 6.95 / 7.22 ms in 1 / 2 / 4 groups; docs/context-parallel-attention.md, "Measurements
# behind the constants").  So two groups, each keeping >= 32 MiB of q, for either transport.
ULYSSES_MAX_HEAD_GROUPS = 2
ULYSSES_PIPELINE_MIN_BYTES = 32 << 20  # q bytes of one rank per head group


def ulysses_head_groups(q_bytes: int, heads: int, kv_heads: int, u: int) -> int:
    """How many head groups ulysses / hybrid:U:R pipeline their all-to-alls over (schedules and
    the cost model): the largest G <= ULYSSES_MAX_HEAD_GROUPS that splits the heads and K/V heads
    into G * u equal parts and keeps >= ULYSSES_PIPELINE_MIN_BYTES of this rank's q per group;
    1 if none does (or u == 1: nothing moves)."""
    if u <= 1:
        return 1
    for g in range(ULYSSES_MAX_HEAD_GROUPS, 1, -1):
        if heads % (g * u) == 0 and kv_heads % (g * u) == 0 and q_bytes // g >= ULYSSES_PIPELINE_MIN_BYTES:
            return g
    return 1


def refusal(schedule: Union[str, CPSchedule], shape: Union[AttentionShape, tuple], world: int,
            causal: bool) -> Union[str, None]:
    """Why `schedule` cannot run attention of global `shape` over `world` ranks; None if it can.

    shape: AttentionShape or a tuple (batch, heads, kv_heads, seq_total, head_dim)."""
    sched = CPSchedule.parse(schedule)
    b, h, h_kv, seq, d = AttentionShape(*shape)
    if min(b, h, h_kv, seq, d, world) < 1:
        return f"sizes must be positive, got {AttentionShape(*shape)} over {world} ranks"
    if h % h_kv:
        return f"kv heads {h_kv} do not divide query heads {h}"
    if seq % world:
        return f"sequence length {seq} is not a multiple of the world size {world}"
    u, r = sched.degrees(world)
    if u * r != world:
        return f"degrees {u} x {r} != world size {world}"
    if sched.name == "ring_zigzag" and causal and seq % (2 * world):
        return (f"sequence length {seq} cannot be cut into 2*W = {2 * world} equal chunks "
                f"(W = {world}); use ring, or pad the sequence to a multiple of {2 * world}")
    if u > 1 and (h % u or h_kv % u):
        return (f"the all-to-all splits heads over {u} ranks, but heads {h} / kv heads {h_kv} "
                f"are not both divisible by {u} (K/V heads are never replicated)")
    if sched.early and u < 2:
        return "ulysses:early starts on the own block of an all-to-all: it needs two or more ranks"
    parts = sched.groups * (u if sched.name != "ring_zigzag" else 1)
    if sched.groups and (h % parts or h_kv % parts):
        return f"{sched.groups} head groups of {parts // sched.groups} rank(s) do not divide heads {h} / kv heads {h_kv}"
    return None


def pipeline_groups(schedule: Union[str, CPSchedule], q_bytes: int, heads: int, kv_heads: int, world: int) -> int:
    """The head groups a schedule pipelines its moves over: its g=G, else the rule's
    (zigzag_head_groups, ulysses_head_groups); 1 for the schedules that move nothing.
    q_bytes: this rank's q."""
    sched = CPSchedule.parse(schedule)
    if sched.groups:
        return sched.groups
    if sched.early:  # its own block hides the inputs' arrival, its pieces the results' return
        return 1
    if sched.name == "ring_zigzag":
        return zigzag_head_groups(q_bytes, kv_heads)
    if sched.name in ("ulysses", "hybrid"):
        return ulysses_head_groups(q_bytes, heads, kv_heads, sched.degrees(world)[0])
    return 1


FLEX_SCHEDULES = ("ring", "allgather", "allgather:g=G", "hybrid:U:R")


def parse_flex_schedule(schedule: str) -> tuple[str, int]:
    """(name, head groups) of a FlexAttention CP schedule (kernels/attention/flex_ring.py,
    flex_allgather.py, flex_hybrid.py): "ring", "allgather" or "allgather:g=G" (its K/V gathered in
    G head groups, each group's gather in flight while the one before attends), "hybrid:U:R"
    (Ulysses over U consecutive ranks, a flex ring over R such groups; U, R >= 2: with a degree of
    one it is the ring or a Ulysses program); ValueError for anything else."""
    name, _, groups = schedule.partition(":") if isinstance(schedule, str) else ("", "", "")
    if name == "ring" and not groups:
        return name, 1
    if name == "hybrid" and flex_hybrid_degrees(schedule) is not None:
        return name, 1
    depth = groups.removeprefix("g=")
    if name == "allgather" and (not groups or (groups.startswith("g=") and _DIGITS.fullmatch(depth) and int(depth) >= 1)):
        return name, int(depth or 1)
    raise ValueError(f"flex cp schedule: unknown schedule {schedule!r} (known: {', '.join(FLEX_SCHEDULES)})")


def flex_hybrid_degrees(schedule: str) -> tuple[int, int] | None:
    """(U, R) of a flex "hybrid:U:R" with U, R >= 2, else None."""
    parts = schedule.split(":") if isinstance(schedule, str) else []
    if len(parts) != 3 or parts[0] != "hybrid" or not all(_DIGITS.fullmatch(x) for x in parts[1:]):
        return None
    u, r = int(parts[1]), int(parts[2])
    return (u, r) if u >= 2 and r >= 2 else None
