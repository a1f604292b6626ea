"""FlexAttention over a sequence split into W contiguous shares: the block mask cut per (rank, source)
and one block's forward and backward (issue 70's foundation).

A FlexAttention program states its mask twice: as a `mask_mod(b, h, q, kv)` function of global
positions and as a `BlockMask`, the same mask at block granularity (per row of Q blocks, which KV
blocks are partly or fully unmasked).  In a context-parallel schedule rank p holds the rows
[p * L, (p + 1) * L) and meets the keys of source s, [s * L, (s + 1) * L), one block at a time.
`step_mask` builds that block's BlockMask from the whole one without evaluating the mask again:
rank p's rows of the block tables, the KV blocks in source s's column range kept (in their order)
and shifted to start at 0, and the mask_mod moved by the two offsets.  `work` counts, for every
(p, s), the tiles such a block computes; a block with none is neither computed nor, where the
schedule allows, sent.

`block_forward` / `block_backward` compute one block: on a GPU torch's flex-attention operators
(`flex_attention_hop` and `flex_attention_backward`) compiled by Inductor into its Triton kernels,
on a CPU plain torch on the block's dense mask.  The forward returns the block's output and its log-sum-exp in natural log
(the operator's is base 2), to be merged with the others (merge.merge_); the backward takes the
*global* output and LSE of the rows, as flash attention's backward does, so the blocks' gradients
add up to the whole attention's.  Only masks are handled (score_mod the identity).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from torch_commopt.kernels.attention import flex_dense

log = logging.getLogger(__name__)

LN2 = math.log(2.0)


def slice_columns(num: Tensor, idx: Tensor, c0: int, c1: int) -> tuple[Tensor, Tensor]:
    """Block tables (num [..., rows], idx [..., rows, cols]) cut to the column blocks [c0, c1),
    shifted to 0: per row, the kept blocks first in their order, their count, and the table
    c1 - c0 wide."""
    cols = idx.shape[-1]
    valid = torch.arange(cols, device=idx.device) < num[..., None]
    keep = valid & (idx >= c0) & (idx < c1)
    width = c1 - c0
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept first, in order
    moved = torch.gather(idx - c0, -1, order)
    if moved.shape[-1] < width:  # a table narrower than the range: pad (never read past num)
        moved = torch.cat([moved, moved.new_zeros(*moved.shape[:-1], width - moved.shape[-1])], -1)
    new_idx = moved[..., :width].clamp(0, width - 1).to(torch.int32)
    return keep.sum(-1).to(torch.int32).contiguous(), new_idx.contiguous()


def lift(mask_mod: Callable, device: torch.device) -> tuple[torch.fx.GraphModule, tuple[Tensor, ...]]:
    """mask_mod traced into a graph of aten ops whose tensors read from outside (document ids, a
    window table) are inputs: (graph(b, h, q, kv, *buffers) -> bool, buffers).  The compiled
    kernels take such buffers as arguments (a traced constant cannot be compiled into a flex
    kernel's mask), and new values of them each batch recompile nothing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    index = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)]  # 1-D: tensor indexing traces
    gm = make_fx(lambda b, h, q, kv: mask_mod(b, h, q, kv))(*index)  # four positions, whatever else it takes
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    lifted: dict[str, torch.fx.Node] = {}
    buffers = []
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        if node.target not in lifted:
            with graph.inserting_after(last):
                last = lifted[node.target] = graph.placeholder(f"buffer{len(buffers)}")
            buffers.append(getattr(gm, node.target))
        node.replace_all_uses_with(lifted[node.target])
        graph.erase_node(node)
    gm.recompile()
    return gm, tuple(buffers)


# lift()'s results by the mask function and what it reads (lifted_mask): tracing costs ~10 ms of
# host time, which an eager call of the schedules (flex_ring / flex_allgather) paid every call
_LIFTED: collections.OrderedDict = collections.OrderedDict()
LIFT_ENTRIES = 16
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_STABLE_MODULES = frozenset({"torch", "math", "operator", "builtins", "functools"})
_CAPTURE_DEPTH = 8  # functions within functions


def _reads(obj, out: list, depth: int = 0) -> bool:
    """Append to `out` what obj (a mask function, or something it reads) is made of: tensors and
    functions as objects, plain values as values; False where some of it could change while its
    identity stays (an object's attribute rebound, a dict's entry replaced), which no key can tell."""
    if depth > _CAPTURE_DEPTH:
        return False
    if isinstance(obj, _PLAIN):
        out.append((type(obj), obj))
        return True
    if isinstance(obj, (Tensor, types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        out.append(obj)
        return True
    if isinstance(obj, tuple):
        out.append(("tuple", len(obj)))
        return all(_reads(o, out, depth) for o in obj)
    if isinstance(obj, types.ModuleType):
        out.append(("module", obj.__name__))
        return obj.__name__.split(".")[0] in _STABLE_MODULES
    if isinstance(obj, functools.partial):
        out.append(obj)
        return _reads((obj.func, obj.args, tuple(sorted(obj.keywords.items()))), out, depth + 1)
    if isinstance(obj, types.FunctionType):
        out.append(obj)
        try:
            cells = tuple(c.cell_contents for c in obj.__closure__ or ())
        except ValueError:  # an empty cell (a name bound later)
            return False
        names = tuple(n for n in obj.__code__.co_names if n in obj.__globals__)
        read_globals = tuple(obj.__globals__[n] for n in names)
        kw = tuple(sorted((obj.__kwdefaults__ or {}).items()))
        return _reads((cells, obj.__defaults__ or (), kw, names, read_globals), out, depth + 1)
    return False


def _key_part(x):
    if isinstance(x, Tensor):
        return ("tensor", id(x), tuple(x.shape), x.dtype, x.device)
    return ("object", id(x)) if not isinstance(x, tuple) else x


def lifted_mask(mask_mod: Callable, device: torch.device) -> tuple[torch.fx.GraphModule, tuple[Tensor, ...]]:
    """lift(mask_mod, device), traced once for a mask function and the objects it reads: the
    same function over the same tensors (by identity: the lifted graph reads them as buffers,
    so new values written into them in place are read too) is the same graph.  A function that
    reads anything whose contents could change under the same identity is traced every call."""
    found = _lift_key(mask_mod, device)
    if found is None:
        return lift(mask_mod, device)
    key, refs = found
    hit = _LIFTED.get(key)
    if hit is not None and all(r() is x for r, x in zip(hit[0], refs, strict=True)):
        _LIFTED.move_to_end(key)
        return hit[1]
    return remember_lift(mask_mod, device, lift(mask_mod, device))


def remember_lift(mask_mod: Callable, device: torch.device, lifted: tuple) -> tuple:
    """Keep `lifted` (lift's (graph, buffers) of mask_mod, traced by the caller) as lifted_mask's
    answer for mask_mod, where its reads can be keyed (mask_fold's folded masks: their trace is
    made once, not again by the schedules).  Returns `lifted`."""
    found = _lift_key(mask_mod, device)
    if found is None:
        return lifted
    key, refs = found
    try:
        weak = tuple(weakref.ref(x) for x in refs)
    except TypeError:  # an object without weak references: its id could be another's later
        return lifted
    _LIFTED[key] = (weak, lifted)
    _LIFTED.move_to_end(key)
    while len(_LIFTED) > LIFT_ENTRIES:
        _LIFTED.popitem(last=False)
    return lifted


def _lift_key(mask_mod: Callable, device: torch.device) -> tuple | None:
    """(lifted_mask's key of mask_mod on device, the objects it reads by identity), or None where
    what it reads could change under the same identity (_reads)."""
    reads: list = []
    if not _reads(mask_mod, reads):
        return None
    return (str(device), tuple(_key_part(x) for x in reads)), [x for x in reads if not isinstance(x, tuple)]


class _FromCode:
    """A mask function defined by a mask graph's code (`def forward(self, b, h, q, kv, *buffers)`)."""

    def __init__(self, code: str) -> None:
        namespace = {"torch": torch, "inf": math.inf, "nan": math.nan, "device": torch.device}
        exec(compile(code, "<commopt flex mask>", "exec"), namespace)  # noqa: S102  (the program's own mask graph)
        self.code, self._forward = code, namespace["forward"]

    def __call__(self, *args):
        return self._forward(None, *args)


_FROM_CODE: dict[str, _FromCode] = {}


def mask_from_code(code: str) -> _FromCode:
    """The mask function of a mask graph's code, defined once per code."""
    if code not in _FROM_CODE:
        _FROM_CODE[code] = _FromCode(code)
    return _FROM_CODE[code]


@dataclass(frozen=True)
class Blocks:
    """A block mask over the whole sequence's keys: kv_num [B|1, H|1, NQ], kv_idx [.., NQ, NK] and the
    full-block tables (None: none), the block size, the mask function, the sequence length.
    own_rows False: the rows are the whole sequence's too, and mask_mod takes global positions;
    True: the rows are this rank's share only, as a context-parallel program states its mask
    (torch's context_parallel, an all-gather of K/V into flex_attention), and mask_mod takes the
    share's row positions (the program added the rank's offset itself) and global key positions."""

    kv_num: Tensor
    kv_idx: Tensor
    full_num: Tensor | None
    full_idx: Tensor | None
    block: int
    mask_mod: Callable
    seq_len: int
    graph: Callable | None = None  # mask_mod lifted (lift; or mask_from_code): (b, h, q, kv, *buffers)
    buffers: tuple[Tensor, ...] = ()
    own_rows: bool = False

    @classmethod
    def of(cls, block_mask) -> "Blocks":
        """From a torch BlockMask over the whole sequence (square), or of this rank's rows against the
        whole sequence's keys (fewer rows than keys: own_rows)."""
        q_len, kv_len = block_mask.seq_lengths
        bq, bk = block_mask.BLOCK_SIZE
        if bq != bk:
            raise ValueError(f"flex CP: Q and KV blocks of one size, got {bq} and {bk}")
        graph, buffers = lifted_mask(block_mask.mask_mod, block_mask.kv_num_blocks.device)
        return cls(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                   block_mask.full_kv_indices, bq, block_mask.mask_mod, kv_len, graph, buffers, q_len != kv_len)

    def code(self) -> str:
        """The lifted mask's code: what a compiled kernel and a rewritten graph's op carry of it."""
        return self.graph.code if isinstance(self.graph, torch.fx.GraphModule) else getattr(self.graph, "code", "")

    @classmethod
    def from_tables(cls, tables: list, sizes: list[int], code: str, buffers: tuple[Tensor, ...]) -> "Blocks":
        """From a rewritten graph's op arguments: the block tables [kv_num, kv_idx, full_num,
        full_idx], [rows, keys, block size], the mask graph's code (mask_from_code) and its buffers;
        own rows where there are fewer rows than keys."""
        q_len, kv_len, block = sizes
        graph = mask_from_code(code)
        return cls(tables[0], tables[1], tables[2], tables[3], block, graph, kv_len, graph, tuple(buffers),
                   q_len != kv_len)

    def share(self, world: int) -> int:
        """Rows of a rank's share (the sequence in `world` equal shares of whole blocks)."""
        if self.own_rows and self.kv_num.shape[-1] * self.block * world != self.seq_len:
            raise ValueError(f"flex CP: {self.kv_num.shape[-1] * self.block} rows a rank over {world} ranks is not "
                             f"the {self.seq_len}-token sequence")
        if self.seq_len % (world * self.block):
            raise ValueError(f"flex CP: a sequence of {self.seq_len} does not split into {world} shares of whole "
                             f"{self.block}-token blocks")
        return self.seq_len // world


@dataclass(frozen=True)
class Step:
    """One (rank p's rows, source s's keys) block's mask as flex's operators take it: the block
    tables (BlockMask.as_tuple) with, last, the mask function of block-local positions
    mod(b, h, q, kv, q_off, kv_off, *buffers), and its buffers (q_off, kv_off, *the lifted
    mask's buffers)."""

    tables: tuple
    buffers: tuple[Tensor, ...]
    key: str = ""  # the mask's identity for the compiled kernels' cache: its graph's code

    def mask(self, b, h, q, kv):
        """The block's elementwise mask (True: attended)."""
        return self.tables[-1](b, h, q, kv, *self.buffers)

    def dense(self, batch: int, heads: int) -> Tensor:
        """The block's mask as a (batch, heads, rows, keys) bool tensor (broadcast where it does not
        depend on them), evaluated on index grids: no vmap."""
        rows, keys = self.tables[0], self.tables[1]
        device = self.tables[2].device
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        q = torch.arange(rows, device=device).view(1, 1, -1, 1)
        kv = torch.arange(keys, device=device).view(1, 1, 1, -1)
        return self.mask(b, h, q, kv).expand(batch, heads, rows, keys)

    def tiles(self) -> int:
        """Tiles the block computes (partial and full); a host read."""
        num, full = self.tables[2], self.tables[4]
        return int(num.sum()) + (int(full.sum()) if full is not None else 0)

    def _extent(self) -> Tensor:
        """[tiles, first row block, end row block, first key block, end key block] on the device:
        the span of the blocks with a tile (the rows from the KV tables, the keys from the Q ones)."""
        kv = self.tables[2] + (self.tables[4] if self.tables[4] is not None else 0)
        qn = self.tables[6] + (self.tables[8] if self.tables[8] is not None else 0)
        rows, cols = (t.flatten(0, -2).amax(0) > 0 for t in (kv, qn))

        def ends(live: Tensor) -> list[Tensor]:
            at = torch.arange(live.numel(), device=live.device)
            return [torch.where(live, at, live.numel()).amin(), torch.where(live, at, -1).amax() + 1]

        return torch.stack([kv.sum(), *ends(rows), *ends(cols)])


@dataclass(frozen=True)
class Extent:
    """Where a block's tiles lie, in tokens of its rows and keys: what outside them a schedule
    need not merge or add (the block's output there is empty, its gradients zero)."""

    tiles: int
    rows: slice
    keys: slice


def extents(steps: list[Step]) -> list[Extent | None]:
    """Each step's Extent (None: no tile), read to the host at once."""
    if not steps:
        return []
    values = torch.stack([s._extent() for s in steps]).tolist()  # noqa: SLF001  (one host read for every step)
    out = []
    for step, (tiles, r0, r1, c0, c1) in zip(steps, values, strict=True):
        block = step.tables[-3]
        out.append(Extent(tiles, slice(r0 * block, r1 * block), slice(c0 * block, c1 * block)) if tiles else None)
    return out


def spans(blocks: Blocks, world: int) -> list[list[tuple[int, int] | None]]:
    """spans[p][s]: the keys of source s's share that rank p's rows keep a tile of, as token
    offsets [start, end) within the share from its first such key block to its last (None: no
    tile), for every (p, s), from the whole sequence's block tables (the same on every rank; one
    host read); the rank's own rows' (own_rows) tell nothing of the others': ValueError."""
    if blocks.own_rows:
        raise ValueError("flex CP: a mask of this rank's rows only tells nothing of what the others need")
    nb = blocks.share(world) // blocks.block
    device = blocks.kv_num.device
    first = torch.full((world * world,), nb, dtype=torch.int64, device=device)
    last = torch.full((world * world,), -1, dtype=torch.int64, device=device)
    for num, idx in ((blocks.kv_num, blocks.kv_idx), (blocks.full_num, blocks.full_idx)):
        if num is None:
            continue
        kept = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]  # [.., rows, slots]
        col = idx.long().expand(kept.shape)
        row_rank = (torch.arange(idx.shape[-2], device=idx.device) // nb)[:, None]
        pair = (row_rank * world + col // nb)[kept]
        first.scatter_reduce_(0, pair, (col % nb)[kept], "amin")
        last.scatter_reduce_(0, pair, (col % nb)[kept], "amax")
    lo, hi = torch.stack([first, last]).tolist()
    flat = [(a * blocks.block, (b + 1) * blocks.block) if b >= 0 else None for a, b in zip(lo, hi, strict=True)]
    return [flat[p * world:(p + 1) * world] for p in range(world)]


def kv_tables(kv: tuple, block: int, rows: int, keys: int) -> list:
    """The block tables flex's operators take (BlockMask.as_tuple() without the mask function) of
    (kv_num, kv_idx, full_num, full_idx) over `rows` x `keys` tokens.  The backward's Q-block
    tables (the KV tables transposed) are computed here without vmap: BlockMask computes them
    under vmap, which fails where a compiled graph's op runs (functorch disabled there: "Cannot
    access storage of BatchedTensorImpl")."""
    from torch.nn.attention.flex_attention import BlockMask

    kn, ki, fn, fi = kv
    skip_q = {"compute_q_blocks": False} if _takes_compute_q_blocks() else {}  # a keyword not every torch has
    cut = BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=block, seq_lengths=(rows, keys), **skip_q)
    tables = list(cut.as_tuple()[:-1])
    cols = keys // block
    tables[6:10] = [*q_tables(kn, ki, cols), *(q_tables(fn, fi, cols) if fn is not None else (None, None))]
    return tables


def step_mask(blocks: Blocks, p: int, s: int | None, world: int) -> Step:
    """The mask of rank p's rows against source s's keys (both length L = seq / world; s None: every
    key, the whole sequence): the block tables cut (slice_columns), the lifted mask moved by the
    two offsets, which travel as tensors so that one compiled kernel serves every (p, s)."""
    length = blocks.share(world)
    nb = length // blocks.block
    rows = slice(None) if blocks.own_rows else slice(p * nb, (p + 1) * nb)
    c0, c1 = (0, world * nb) if s is None else (s * nb, (s + 1) * nb)
    kn, ki = slice_columns(blocks.kv_num[..., rows], blocks.kv_idx[..., rows, :], c0, c1)
    fn = fi = None
    if blocks.full_num is not None:
        fn, fi = slice_columns(blocks.full_num[..., rows], blocks.full_idx[..., rows, :], c0, c1)
    tables = kv_tables((kn, ki, fn, fi), blocks.block, length, length * (c1 - c0) // nb)
    graph = blocks.graph

    def moved(b, h, q, kv, q_off, kv_off, *buffers):
        return graph(b, h, q + q_off, kv + kv_off, *buffers)

    offsets = (0 if blocks.own_rows else p * length, c0 * blocks.block)
    if kn.is_cuda:  # tensors: one compiled kernel for every (p, s) (python ints would be baked in)
        # (through pinned memory: a plain copy to the device waits for the stream)
        offsets = tuple(torch.tensor(o, dtype=torch.int32).pin_memory().to(kn.device, non_blocking=True)
                        for o in offsets)
    return Step(tuple(tables) + (moved,), offsets + blocks.buffers, blocks.code())


_CACHE: collections.OrderedDict = collections.OrderedDict()
CACHE_ENTRIES = 8  # masks (x schedules) kept: a step's layers share one; cut tables are ~MBs at 128K tokens
CACHE_STATS = {"hits": 0, "cuts": 0}  # cached()'s counts (a program's cuts should be one per mask and schedule)


def cached(blocks: Blocks, key: tuple, build: Callable):
    """build() -- a schedule's cut masks (step_mask) and their extents -- once for a mask's very
    block tables: every layer of a step passes the same BlockMask's tables to its attention, and
    cutting them costs milliseconds of host time (dozens of small kernels and a host read) that
    the GPU would wait for.  A hit needs the same table tensors (held by weak references: a new
    tensor at a freed one's address is another object) at the same versions (an in-place write
    bumps it), so a new batch's mask is always cut again.  The cut reads the tables only; the mask
    function's buffers ride along in each Step, and a hit carries this call's (a compiled graph
    may hand each layer another tensor object for the same buffer)."""
    tables = tuple(t for t in (blocks.kv_num, blocks.kv_idx, blocks.full_num, blocks.full_idx) if t is not None)
    try:
        versions = tuple((id(t), t._version) for t in tables)  # noqa: SLF001  (the in-place write counter)
    except RuntimeError:  # an inference-mode tensor keeps no version counter: nothing to tell a write by
        return build()
    full_key = (versions, key, blocks.own_rows, blocks.seq_len, blocks.block, blocks.code(),
                tuple((tuple(b.shape), b.dtype, b.device) for b in blocks.buffers))
    hit = _CACHE.get(full_key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], tables, strict=True)):
        _CACHE.move_to_end(full_key)
        CACHE_STATS["hits"] += 1
        return _with_buffers(hit[1], tuple(blocks.buffers))
    CACHE_STATS["cuts"] += 1
    value = build()
    _CACHE[full_key] = (tuple(weakref.ref(t) for t in tables), value)
    while len(_CACHE) > CACHE_ENTRIES:
        _CACHE.popitem(last=False)
    return value


def _with_buffers(value, buffers: tuple):
    """A cut (a Step, or lists and tuples holding Steps) with each Step's mask buffers replaced
    by `buffers` (its two offsets kept)."""
    if isinstance(value, Step):
        if len(value.buffers) == 2 + len(buffers) and all(a is b for a, b in zip(value.buffers[2:], buffers)):
            return value
        return dataclasses.replace(value, buffers=tuple(value.buffers[:2]) + buffers)
    if isinstance(value, (list, tuple)):
        out = type(value)(_with_buffers(v, buffers) for v in value)
        return value if all(a is b for a, b in zip(out, value)) else out
    return value


def dense_tables(mask: Tensor, block: int) -> list[Tensor]:
    """The block tables [kv_num, kv_idx, full_num, full_idx] of a dense boolean mask
    (B|1, H|1, rows, keys), both multiples of `block`: a tile with some kept score is partial, one
    with every score kept full (what create_block_mask makes of the same mask)."""
    rows, keys = mask.shape[-2] // block, mask.shape[-1] // block
    tiles = mask.unflatten(-2, (rows, block)).unflatten(-1, (keys, block))  # [.., rows, block, keys, block]
    some, every = tiles.any(-1).any(-2), tiles.all(-1).all(-2)  # [.., rows, keys]
    out = []
    for kept in (some & ~every, every):
        order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)  # kept columns first, in order
        out += [kept.sum(-1).to(torch.int32).contiguous(), order.to(torch.int32).contiguous()]
    return out


def dense_mask_code(batch_broadcast: bool, heads_broadcast: bool) -> str:
    """The mask graph code (mask_from_code) that reads a dense boolean mask, its first buffer,
    at (b, h, q, kv); index 0 on a dimension the mask broadcasts."""
    b = "torch.zeros_like(b)" if batch_broadcast else "b"
    h = "torch.zeros_like(h)" if heads_broadcast else "h"
    return (f"def forward(self, b, h, q, kv, buffer0):\n"
            f"    return torch.ops.aten.index.Tensor(buffer0, [{b}, {h}, q, kv])\n")


@functools.cache
def _takes_compute_q_blocks() -> bool:
    """Whether this torch's BlockMask.from_kv_blocks takes compute_q_blocks."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def q_tables(num: Tensor, idx: Tensor, cols: int) -> tuple[Tensor, Tensor]:
    """The transposed block tables: for each KV block column, how many Q block rows keep it and
    which, in order ([..., cols] and [..., cols, rows])."""
    rows = num.shape[-1]
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    dense = torch.zeros(*num.shape, cols + 1, dtype=torch.bool, device=idx.device)  # a spare column for the padding
    dense.scatter_(-1, torch.where(valid, idx.long(), cols), True)
    kept = dense[..., :cols].transpose(-1, -2)  # [..., cols, rows]
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)
    return kept.sum(-1).to(torch.int32).contiguous(), order[..., :rows].to(torch.int32).contiguous()


def work(blocks: Blocks, world: int) -> Tensor:
    """(world, world) int64: the tiles rank p computes against source s's keys (partial and full
    blocks, summed over batch and heads of the block tables); one row, this rank's, where the
    blocks hold only its rows (own_rows)."""
    nb = blocks.share(world) // blocks.block
    ranks = 1 if blocks.own_rows else world
    out = torch.zeros(ranks, world, dtype=torch.int64)
    for num, idx in ((blocks.kv_num, blocks.kv_idx), (blocks.full_num, blocks.full_idx)):
        if num is None:
            continue
        valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        src = torch.where(valid, idx // nb, -1)  # the source rank of every kept column block
        for p in range(ranks):
            mine = src[..., p * nb:(p + 1) * nb, :]
            for s in range(world):
                out[p, s] += int((mine == s).sum())
    return out


def _kernel_options(q: Tensor, k: Tensor, v: Tensor):
    from torch.nn.attention.flex_attention import _apply_kernel_options

    return _apply_kernel_options(q, k, v, True, None)


def block_forward(q: Tensor, k: Tensor, v: Tensor, step: Step, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of q against one block of keys under `step`'s mask (lse natural log, rows with no
    key -inf and output 0); GQA where k and v have fewer heads than q.  On CUDA a compiled
    kernel (_compiled), on a CPU plain torch on the dense mask (flex_dense)."""
    from torch.nn.attention.flex_attention import _identity, flex_attention_hop

    def run(q, k, v, *tensors):
        tables, buffers = _unflatten(step, tensors)
        return flex_attention_hop(q, k, v, _identity, tables, scale, _kernel_options(q, k, v), (), buffers)[:2]

    if not q.is_cuda:
        return flex_dense.forward(q, k, v, step.dense(q.shape[0], q.shape[1]), scale)
    args = (q, k, v, *_flatten(step))
    out, lse2 = _compiled("forward", run, args, step, scale)(*args)
    return out, lse2 * LN2


def block_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, step: Step,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block's share of the attention, from the rows' *global* out and lse
    (natural log) and dout; dk and dv with k's heads (GQA summed)."""
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    fw, joint = _score_graphs(q.dtype, q.device)

    def run(q, k, v, out, lse2, dout, *tensors):
        tables, buffers = _unflatten(step, tensors)
        return flex_attention_backward(q, k, v, out, lse2, dout, None, fw, joint, tables, scale,
                                       _kernel_options(q, k, v), (), buffers)[:3]

    if not q.is_cuda:
        return flex_dense.backward(q, k, v, (out, lse, dout), step.dense(q.shape[0], q.shape[1]), scale)
    args = (q, k, v, out, (lse / LN2).to(torch.float32), dout, *_flatten(step))
    dq, dk, dv = _compiled("backward", run, args, step, scale)(*args)
    return dq, dk, dv


_SCORE_GRAPHS: dict[tuple, tuple] = {}


def _score_graphs(dtype: torch.dtype, device: torch.device) -> tuple:
    """The identity score_mod's forward and joint graphs (create_fw_bw_graph), traced once per dtype
    and device: tracing them is milliseconds of host time, which every block's backward would pay."""
    key = (dtype, device)
    if key not in _SCORE_GRAPHS:
        from torch._higher_order_ops.flex_attention import create_fw_bw_graph
        from torch.nn.attention.flex_attention import _identity

        index = [torch.zeros((), dtype=torch.int, device=device) for _ in range(4)]
        score = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
        _SCORE_GRAPHS[key] = create_fw_bw_graph(_identity, (score, *index), ())
    return _SCORE_GRAPHS[key]


def _flatten(step: Step) -> tuple[Tensor, ...]:
    """The step's tensors, the block tables' then the buffers, as one flat argument list."""
    return tuple(t for t in step.tables if isinstance(t, Tensor)) + step.buffers


def _unflatten(step: Step, tensors: tuple) -> tuple[tuple, tuple]:
    """(block tables, buffers) from _flatten's list: the step's tables with their tensors replaced."""
    it = iter(tensors)
    tables = tuple(next(it) if isinstance(t, Tensor) else t for t in step.tables)
    return tables, tuple(it)


_COMPILED: dict[tuple, Callable] = {}


def _compiled(kind: str, run: Callable, args: tuple, step: Step, scale: float) -> Callable:
    """run traced (make_fx, fake tensors) and compiled by Inductor into the flex Triton kernels, once per kind,
    argument shapes and dtypes, scale and mask graph: every (p, s) block of a call and every layer of a step
    share it (the offsets, tables and buffers are arguments).  With Inductor's default tile configuration:
    max-autotune of these templates hit an illegal memory access on torch 2.11 (docs/flex-attention.md)."""
    key = (kind, scale, step.key,
           tuple((tuple(a.shape), a.dtype) if isinstance(a, Tensor) else a for a in args),
           tuple(t for t in step.tables if not isinstance(t, Tensor) and not callable(t)))
    fn = _COMPILED.get(key)
    if fn is None:
        from torch.fx.experimental.proxy_tensor import make_fx

        start = time.perf_counter()
        # fake tensors: tracing with real ones runs the operator's dense math (a 32 GiB score
        # matrix at 8K rows a rank), only to throw it away
        gm = make_fx(run, tracing_mode="fake")(*args)
        fn = _COMPILED[key] = torch._inductor.compile(gm, list(args))
        shapes = [tuple(a.shape) for a in args[:2] if isinstance(a, Tensor)]  # q's and k's
        log.info("commopt flex: the %s kernels for %s compiled in %.1f s (once per shape and mask)", kind,
                 " and ".join(map(str, shapes)), time.perf_counter() - start)
    return fn
