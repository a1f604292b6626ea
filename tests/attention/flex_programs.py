"""Per-rank programs for FlexAttention over a sequence-sharded ring (kernels/attention/flex_ring.py):
every rank builds the whole sequence's inputs and mask from seeds and checks its shares of the
output and gradients against dense attention over the whole sequence in float64."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

S, BLOCK, D = 1024, 128, 16


def doc_ids(batch: int) -> torch.Tensor:
    """Per batch row, document ids over S tokens: documents that cross shares, a one-token one, one
    longer than a share at 4 ranks (301..700), and another layout for the second row."""
    ids = torch.zeros(batch, S, dtype=torch.int32)
    for b, cuts in enumerate([(100, 300, 301, 700), (50, 600, 601, 900)][:batch]):
        for cut in cuts:
            ids[b, cut:] += 1
    return ids


def mask_mod_of(kind: str, docs: torch.Tensor, window: int = 200):
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    if kind == "causal":
        return causal
    if kind == "document":
        return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv)
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < window)
    if kind == "document+window":
        return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv) & (q - kv < window)
    if kind == "empty rows":  # a window of earlier tokens only (token 0 sees none) and padding at the end
        return lambda b, h, q, kv: (q > kv) & (q - kv <= window) & (q < PADDED_FROM)
    raise ValueError(kind)


PADDED_FROM = S - 40  # "empty rows": the last 40 tokens are padding, rows with no key at all


def _rows_mask(mod, offset: int):
    """The mask of a rank's rows (its offset added), as a context-parallel program states it."""
    return lambda b, h, q, kv: mod(b, h, q + offset, kv)


def _dense(q, k, v, dense_mask, scale):
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ kr.transpose(-1, -2)) * scale
    # a row with no key: output 0 and no gradient (its softmax taken over zeros, then dropped, so
    # that no NaN reaches the gradients as softmax over all -inf would)
    some = dense_mask.any(-1, keepdim=True)
    scores = scores.masked_fill(~dense_mask, float("-inf")).masked_fill(~some, 0.0)
    probs = torch.softmax(scores, -1) * some
    return probs @ vr


def run_flex_ring(rank: int, world: int, kind: str, batch: int = 1, schedule: str = "ring", own_rows: bool = False,
                  layout: str | None = None) -> dict:
    """{"errors": {name: max abs error vs dense float64}, "work": the (W, W) tiles, "computed": the
    blocks this rank's forward computed}.  schedule: "ring" or "allgather[:g=G]" (G head groups);
    4 query heads over 2 KV heads.  own_rows: each rank states the mask of its rows only (against
    every key, its row offset added in its mask_mod), as a context-parallel program does.
    layout: "choose", the sequence dealt to the ranks by balance.choose first, the inputs and the
    mask in its order (with "layout": its name)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import balance, flex, flex_allgather, flex_ring

    heads, kv_heads = 4, 2

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(batch, heads, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    mod = mask_mod_of(kind, doc_ids(batch))
    dealt = None
    if layout == "choose":  # attention in layout order is the sequence's, its rows and keys permuted alike
        dealt = balance.choose(create_block_mask(mod, batch, None, S, S, device="cpu", BLOCK_SIZE=BLOCK), world)
        q, k, v, dout = (dealt.rearrange(t, 2) for t in (q, k, v, dout))
        mod = dealt.mask_mod(mod)
    scale = 1 / math.sqrt(D)
    length = S // world
    if own_rows:
        block_mask = create_block_mask(_rows_mask(mod, rank * length), batch, None, length, S,
                                       device="cpu", BLOCK_SIZE=BLOCK)
    else:
        block_mask = create_block_mask(mod, batch, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    mine = slice(rank * length, (rank + 1) * length)
    computed = []
    forward = flex.block_forward

    def counted(*args):
        computed.append(1)
        return forward(*args)

    flex.block_forward = counted
    from torch_commopt.kernels.attention import comm

    p2p, sent = comm._p2p, []  # noqa: SLF001

    def counted_p2p(sends, recvs, group):  # the messages this rank sends (forward and backward)
        sent.extend(t.numel() for t, _, _ in sends)
        return p2p(sends, recvs, group)

    comm._p2p = counted_p2p  # noqa: SLF001
    try:
        qs, ks, vs = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        if schedule == "ring":
            out = flex_ring.flex_ring(qs, ks, vs, block_mask, scale, group)
        else:
            groups = int(schedule.split("g=")[1]) if "g=" in schedule else 1
            out = flex_allgather.flex_allgather(qs, ks, vs, block_mask, scale, group, groups)
        out.backward(dout[:, :, mine])
    finally:
        flex.block_forward = forward
        comm._p2p = p2p  # noqa: SLF001
    pos = torch.arange(S)
    dense_mask = torch.stack([mod(b, 0, pos[:, None], pos[None, :]) for b in range(batch)])[:, None]
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    want = _dense(qt, kt, vt, dense_mask, scale)
    want.backward(dout)
    errors = {"out": (out - want[:, :, mine]).abs().max().item(),
              "dq": (qs.grad - qt.grad[:, :, mine]).abs().max().item(),
              "dk": (ks.grad - kt.grad[:, :, mine]).abs().max().item(),
              "dv": (vs.grad - vt.grad[:, :, mine]).abs().max().item()}
    work = flex.work(flex.Blocks.of(block_mask), world).tolist()
    spans = None if own_rows else flex_ring.skipping(flex.Blocks.of(block_mask), world)
    got = {"errors": errors, "work": work if not own_rows else [None] * rank + work, "computed": len(computed),
           "sent": len(sent), "sent_numel": sum(sent), "spans": spans, "kv_row": batch * kv_heads * D}
    if dealt is not None:
        got["layout"] = dealt.name
    return got


def run_flex_ops(rank: int, world: int, kind: str, schedule: str, own_rows: bool = False, keep: bool = False) -> dict:
    """torch.ops.commopt.cp_flex_attention_fwd / _bwd as a rewritten graph calls them (the block
    tables, the lifted mask's code and buffers): {name: max abs error vs dense float64}.  keep: the
    _keep / _kept pair, the forward's gathered K/V into the backward; then also "gathered" (their
    error against the whole sequence's K/V) and "backward_gathers" (all-gathers the backward ran)."""
    from torch.nn.attention.flex_attention import create_block_mask

    import torch_commopt  # noqa: F401  (registers the ops)
    from torch_commopt.kernels.attention import flex

    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 4, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    mod = mask_mod_of(kind, doc_ids(1))
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    rows = _rows_mask(mod, rank * length) if own_rows else mod
    block_mask = create_block_mask(rows, 1, None, length if own_rows else S, S, device="cpu", BLOCK_SIZE=BLOCK)
    graph, buffers = flex.lift(block_mask.mask_mod, torch.device("cpu"))
    tables = [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices]
    sizes = [length if own_rows else S, S, BLOCK]
    scale, group = 1 / math.sqrt(D), dist.group.WORLD
    args = (tables, list(buffers), graph.code, sizes, scale, world, group.group_name, schedule)
    qs, ks, vs, ds = (t[:, :, mine].contiguous() for t in (q, k, v, dout))
    extra = {}
    if keep:
        from torch_commopt.kernels.attention import flex_allgather

        out, lse, k_all, v_all = torch.ops.commopt.cp_flex_attention_fwd_keep(qs, ks, vs, *args)
        extra["gathered"] = max((k_all - k).abs().max().item(), (v_all - v).abs().max().item())
        real, calls = flex_allgather.all_gather, []
        flex_allgather.all_gather = lambda *a, **kw: calls.append(a) or real(*a, **kw)
        try:
            dq, dk, dv = torch.ops.commopt.cp_flex_attention_bwd_kept(ds, qs, k_all, v_all, out, lse, *args)
        finally:
            flex_allgather.all_gather = real
        extra["backward_gathers"] = len(calls)
    else:
        out, lse = torch.ops.commopt.cp_flex_attention_fwd(qs, ks, vs, *args)
        dq, dk, dv = torch.ops.commopt.cp_flex_attention_bwd(ds, qs, ks, vs, out, lse, *args)
    pos = torch.arange(S)
    dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    want = _dense(qt, kt, vt, dense_mask, scale)
    want.backward(dout)
    return {"out": (out - want[:, :, mine]).abs().max().item(), "dq": (dq - qt.grad[:, :, mine]).abs().max().item(),
            "dk": (dk - kt.grad[:, :, mine]).abs().max().item(), "dv": (dv - vt.grad[:, :, mine]).abs().max().item(),
            **extra}


def _compiled_program(rank: int, world: int, kind: str, schedule: str, options: dict | None = None):
    """(compiled, mask function, this rank's slice): a context-parallel program compiled with
    backend="commopt" -- K and V all-gathered along the sequence into flex_attention with the
    rank's local queries and the mask of its rows (offset added in its mask_mod), GQA 4:2."""
    from dist_programs import all_gather_on
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch_commopt

    mod = mask_mod_of(kind, doc_ids(1))
    length = S // world
    block_mask = create_block_mask(_rows_mask(mod, rank * length), 1, None, length, S,
                                   device="cpu", BLOCK_SIZE=BLOCK)

    def program(q_loc, k_loc, v_loc):
        return flex_attention(q_loc, all_gather_on(k_loc, 2), all_gather_on(v_loc, 2), block_mask=block_mask,
                              enable_gqa=True)

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend="commopt", options={"attention_schedule": schedule, **(options or {})})
    return compiled, mod, slice(rank * length, (rank + 1) * length)


def run_flex_compiled(rank: int, world: int, kind: str, schedule: str) -> dict:
    """_compiled_program run for inference: {"error": max abs error vs dense float64,
    "eager_error": float32 dense's own, "notes": explain's notes, "ops": the commopt ops left}."""
    import torch_commopt

    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, S, D, generator=gen)  # float32: Inductor's CPU flex (the program as written) takes no float64
    k, v = (torch.randn(1, 2, S, D, generator=gen) for _ in range(2))
    compiled, mod, mine = _compiled_program(rank, world, kind, schedule)
    with torch.no_grad():
        got = compiled(*(t[:, :, mine].contiguous() for t in (q, k, v)))
    pos = torch.arange(S)
    dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
    truth = _dense(q.double(), k.double(), v.double(), dense_mask, 1 / math.sqrt(D))[:, :, mine]
    eager = _dense(q, k, v, dense_mask, 1 / math.sqrt(D))[:, :, mine]  # float32's own error
    graphs = torch_commopt.explain().graphs
    return {"error": (got.double() - truth).abs().max().item(), "eager_error": (eager.double() - truth).abs().max().item(),
            "notes": [n for g in graphs for n in g.notes], "ops": {k_: v_ for g in graphs for k_, v_ in g.commopt_ops.items()}}


def run_flex_compiled_training(rank: int, world: int, schedule: str, options: dict | None = None) -> dict:
    """_compiled_program (documents + window) trained one step in float32: the q/k/v gradients'
    largest errors against dense float64, float32 eager's own, and explain's notes.  torch refuses
    flex_attention with gradients on a CPU at its public API (_validate_device; its eager
    operators run dense math there): patched here."""
    import torch.nn.attention.flex_attention as fa

    import torch_commopt

    fa._validate_device = lambda *args, **kwargs: None  # noqa: SLF001
    gen = torch.Generator().manual_seed(13)
    q, dout = (torch.randn(1, 4, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, generator=gen) for _ in range(2))
    compiled, mod, mine = _compiled_program(rank, world, "document+window", schedule, options)
    shares = [t[:, :, mine].contiguous().requires_grad_() for t in (q, k, v)]
    compiled(*shares).backward(dout[:, :, mine])
    pos = torch.arange(S)
    dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
    errors = {}
    for dtype in (torch.float64, torch.float32):  # the truth, and float32 eager's own error against it
        full = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        _dense(*full, dense_mask, 1 / math.sqrt(D)).backward(dout.to(dtype))
        errors[dtype] = [t.grad[:, :, mine] for t in full]
    names = ("dq", "dk", "dv")
    got = {n: (s.grad.double() - t.double()).abs().max().item() for n, s, t in zip(names, shares, errors[torch.float64])}
    own = {n: (e.double() - t.double()).abs().max().item()
           for n, e, t in zip(names, errors[torch.float32], errors[torch.float64])}
    graphs = torch_commopt.explain().graphs
    return {"errors": got, "eager_errors": own, "notes": [n for g in graphs for n in g.notes]}


def run_torch_cp_flex(rank: int, world: int, schedule: str, train: bool = False) -> dict:
    """torch's context_parallel with FlexAttention: an attention module parallelized with
    _ContextParallel(FLEX) (K/V gathered by cplib::flex_cp_allgather), the block mask and the
    inputs sharded by its PTRR load balancer (documents), and the block around it compiled with
    backend="commopt" (the gather inside the compiled graph, as torchtitan compiles whole blocks).
    {"errors", "eager_errors": {name: max abs error vs dense float64 on the rank's rearranged rows},
    "notes"}; train: a step's q/k/v gradients too (torch's CPU flex check patched, as above)."""
    import torch.nn.attention.flex_attention as fa
    from dist_programs import torch_cp_flex_block
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _PTRRLoadBalancer

    import torch_commopt

    if train:
        fa._validate_device = lambda *args, **kwargs: None  # noqa: SLF001
    block = torch_cp_flex_block("cpu", world)
    mesh = init_device_mesh("cpu", (world,))
    mod = mask_mod_of("document", doc_ids(1))
    whole_mask = fa.create_block_mask(mod, 1, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    balancer = _PTRRLoadBalancer(whole_mask, world)
    (block_mask,) = _context_parallel_shard(mesh, [whole_mask], [2], load_balancer=balancer)
    gen = torch.Generator().manual_seed(17)
    q, dout = (torch.randn(1, 4, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, generator=gen) for _ in range(2))
    shares = [t.contiguous() for t in _context_parallel_shard(mesh, [q, k, v, dout], [2] * 4, load_balancer=balancer)]
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(block, backend="commopt", options={"attention_schedule": schedule})
    inputs = [t.clone().requires_grad_(train) for t in shares[:3]]
    out = compiled(*inputs, block_mask)
    if train:
        out.backward(shares[3])
    order = balancer._generate_indices()[0]  # noqa: SLF001  (the rearranged sequence's positions)
    mine = order.view(world, -1)[rank]
    pos = torch.arange(S)
    dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
    errors, eager = {}, {}
    results = {}
    for dtype in (torch.float64, torch.float32):  # the truth, and float32 eager's own error against it
        full = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        want = _dense(*full, dense_mask, 1 / math.sqrt(D))
        want.backward(dout.to(dtype))
        results[dtype] = [want.detach()[:, :, mine]] + ([t.grad[:, :, mine] for t in full] if train else [])
    got = [out.detach()] + ([t.grad for t in inputs] if train else [])
    for name, g, t64, t32 in zip(("out", "dq", "dk", "dv"), got, results[torch.float64], results[torch.float32]):
        errors[name] = (g.double() - t64).abs().max().item()
        eager[name] = (t32.double() - t64).abs().max().item()
    graphs = torch_commopt.explain().graphs
    return {"errors": errors, "eager_errors": eager, "notes": [n for g in graphs for n in g.notes]}


def batch_doc_ids(seed: int) -> torch.Tensor:
    """Another batch's documents over S tokens: four cuts drawn from the seed."""
    cuts = sorted(torch.randperm(S - 2, generator=torch.Generator().manual_seed(seed))[:4].add(1).tolist())
    ids = torch.zeros(1, S, dtype=torch.int32)
    for cut in cuts:
        ids[:, cut:] += 1
    return ids


def run_flex_compiled_batches(rank: int, world: int, schedule: str, batches: int = 3) -> dict:
    """One compiled program (K/V all-gathered into flex_attention, its block mask an argument)
    called with a new documents mask each batch, a new mask_mod closure over new document ids as
    torchtitan makes them:
    {"errors": per batch, "eager_errors": float32's own, "graphs": how many graphs Dynamo compiled, "notes"}."""
    from dist_programs import all_gather_on
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch_commopt

    def program(q_loc, k_loc, v_loc, block_mask):
        return flex_attention(q_loc, all_gather_on(k_loc, 2), all_gather_on(v_loc, 2), block_mask=block_mask,
                              enable_gqa=True)

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    counters.clear()
    compiled = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    errors, eager = [], []
    for i in range(batches):
        mod = mask_mod_of("document", batch_doc_ids(i))  # a new closure each batch, as torchtitan makes it
        mask = create_block_mask(_rows_mask(mod, rank * length), 1, None, length, S, device="cpu", BLOCK_SIZE=BLOCK)
        gen = torch.Generator().manual_seed(100 + i)
        q = torch.randn(1, 4, S, D, generator=gen)
        k, v = (torch.randn(1, 2, S, D, generator=gen) for _ in range(2))
        with torch.no_grad():
            got = compiled(*(t[:, :, mine].contiguous() for t in (q, k, v)), mask)
        pos = torch.arange(S)
        dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
        truth = _dense(q.double(), k.double(), v.double(), dense_mask, 1 / math.sqrt(D))[:, :, mine]
        errors.append((got.double() - truth).abs().max().item())
        eager.append((_dense(q, k, v, dense_mask, 1 / math.sqrt(D))[:, :, mine].double() - truth).abs().max().item())
    graphs = torch_commopt.explain().graphs
    return {"errors": errors, "eager_errors": eager, "graphs": counters["stats"]["unique_graphs"],
            "notes": [n for g in graphs for n in g.notes]}


def run_sdpa_document_mask(rank: int, world: int, train: bool = False) -> dict:
    """SDPA with a boolean documents mask of the rank's rows against every key, which the program
    computes from the document ids (an input), K/V all-gathered, compiled with backend="commopt":
    {"error", "eager_error": float32's own vs dense float64, "notes"}; train: a step's q/k/v
    gradients instead."""
    import torch.nn.functional as F
    from dist_programs import all_gather_on

    import torch_commopt

    length = S // world
    mine = slice(rank * length, (rank + 1) * length)

    def program(q_loc, k_loc, v_loc, docs):
        rows = torch.arange(length) + rank * length
        keys = torch.arange(S)
        mask = (docs[rows][:, None] == docs[None, :]) & (rows[:, None] >= keys[None, :])
        return F.scaled_dot_product_attention(q_loc, all_gather_on(k_loc, 2), all_gather_on(v_loc, 2),
                                              attn_mask=mask[None, None], enable_gqa=True)

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend="commopt")
    gen = torch.Generator().manual_seed(23)
    q, dout = (torch.randn(1, 4, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, generator=gen) for _ in range(2))
    docs = doc_ids(1)[0]
    shares = [t[:, :, mine].contiguous().requires_grad_(train) for t in (q, k, v)]
    with torch.set_grad_enabled(train):
        out = compiled(*shares, docs)
    pos = torch.arange(S)
    dense_mask = mask_mod_of("document", doc_ids(1))(0, 0, pos[:, None], pos[None, :])[None, None]
    results = {}
    for dtype in (torch.float64, torch.float32):
        full = [t.to(dtype).requires_grad_(train) for t in (q, k, v)]
        want = _dense(*full, dense_mask, 1 / math.sqrt(D))
        if train:
            want.backward(dout.to(dtype))
            results[dtype] = torch.cat([t.grad[:, :, mine].flatten() for t in full])
        else:
            results[dtype] = want.detach()[:, :, mine]
    if train:
        out.backward(dout[:, :, mine])
        got = torch.cat([t.grad.flatten() for t in shares])
    else:
        got = out.detach()
    graphs = torch_commopt.explain().graphs
    return {"error": (got.double() - results[torch.float64]).abs().max().item(),
            "eager_error": (results[torch.float32].double() - results[torch.float64]).abs().max().item(),
            "notes": [n for g in graphs for n in g.notes]}


def run_sdpa_document_mask_both(rank: int, world: int) -> list[dict]:
    """run_sdpa_document_mask for inference, then training, in one start of the ranks."""
    return [run_sdpa_document_mask(rank, world, train) for train in (False, True)]


def run_flex_ulysses(rank: int, world: int, schedule: str = "auto", train: bool = False) -> dict:
    """A Ulysses program around flex_attention (DeepSpeed-style on (B, S_loc, H, D) activations:
    all-to-all sequence -> heads, flex_attention on H/W heads over the whole sequence with the
    whole sequence's documents mask, all-to-all back) compiled with backend="commopt":
    {"error", "eager_error": largest error of the rank's output (train: its q/k/v gradients) vs
    dense float64, float32 eager's own; "notes"; "a2as": all-to-alls left in the graphs}."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.attention.flex_attention as fa

    import torch_commopt

    heads, kv_heads = 2 * world, world  # each rank: 2 query heads over 1 KV head
    group = dist.group.WORLD
    a2a = funcol.all_to_all_single_autograd if train else funcol.all_to_all_single
    if train:
        fa._validate_device = lambda *args, **kwargs: None  # noqa: SLF001

    def seq_to_heads(x):  # (B, S_loc, H, D) -> (B, H/W, S, D), the sequence rank-major
        b, s, h, d = x.shape
        x = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        return a2a(x, None, None, group=group).permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d).transpose(1, 2)

    def heads_to_seq(x):  # (B, H/W, S, D) -> (B, S_loc, H, D)
        b, h, s, d = x.shape
        x = x.transpose(1, 2).reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
        return a2a(x, None, None, group=group).permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)

    mod = mask_mod_of("document", doc_ids(1))
    block_mask = fa.create_block_mask(mod, 1, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)

    def program(q, k, v):
        out = fa.flex_attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), block_mask=block_mask,
                                enable_gqa=True)
        return heads_to_seq(out)

    gen = torch.Generator().manual_seed(29)
    q, dout = (torch.randn(1, S, heads, D, generator=gen) for _ in range(2))  # (B, S, H, D)
    k, v = (torch.randn(1, S, kv_heads, D, generator=gen) for _ in range(2))
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    shares = [t[:, mine].contiguous().requires_grad_(train) for t in (q, k, v)]
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})
    with torch.set_grad_enabled(train):
        out = compiled(*shares)
    if train:
        out.backward(dout[:, mine])
        got = torch.cat([t.grad.flatten() for t in shares])
    else:
        got = out.detach().flatten()
    pos = torch.arange(S)
    dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
    results = {}
    for dtype in (torch.float64, torch.float32):
        full = [t.to(dtype).transpose(1, 2).requires_grad_(train) for t in (q, k, v)]  # (B, H, S, D)
        want = _dense(*full, dense_mask, 1 / math.sqrt(D)).transpose(1, 2)  # (B, S, H, D)
        if train:
            want.backward(dout.to(dtype))
            results[dtype] = torch.cat([t.grad.transpose(1, 2)[:, mine].flatten() for t in full])
        else:
            results[dtype] = want.detach()[:, mine].flatten()
    graphs = torch_commopt.explain().graphs
    return {"error": (got.double() - results[torch.float64]).abs().max().item(),
            "eager_error": (results[torch.float32].double() - results[torch.float64]).abs().max().item(),
            "notes": [n for g in graphs for n in g.notes if "attention" in n],
            "a2as": sum(g.collectives_after.get("all_to_all", 0) for g in graphs)}


def run_flex_ulysses_both(rank: int, world: int, schedule: str) -> list[dict]:
    """run_flex_ulysses for inference, then a training step, in one start of the ranks."""
    return [run_flex_ulysses(rank, world, schedule, train) for train in (False, True)]


def run_flex_dtensor(rank: int, world: int, schedule: str = "allgather") -> dict:
    """A DTensor program: q, k, v sharded along the sequence (Shard(2)), K and V redistributed to
    Replicate (their gradients Partial) and handed to flex_attention with the rank's local queries and its rows' mask,
    compiled with backend="commopt" and trained one step.  {"errors", "eager_errors": the q/k/v
    gradients' largest errors vs dense float64 and float32 eager's own, "notes"}."""
    import torch.nn.attention.flex_attention as fa
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import torch_commopt

    fa._validate_device = lambda *args, **kwargs: None  # noqa: SLF001  (CPU flex gradients, as above)
    mesh = init_device_mesh("cpu", (world,))
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    mod = mask_mod_of("document", doc_ids(1))
    block_mask = fa.create_block_mask(_rows_mask(mod, rank * length), 1, None, length, S, device="cpu",
                                      BLOCK_SIZE=BLOCK)

    def program(q_loc, k_loc, v_loc):
        # each rank's queries give every key a gradient: Partial, summed back into the shards
        k, v = (DTensor.from_local(t, mesh, [Shard(2)]).redistribute(mesh, [Replicate()])
                .to_local(grad_placements=[Partial()]) for t in (k_loc, v_loc))
        return fa.flex_attention(q_loc, k, v, block_mask=block_mask, enable_gqa=True)

    gen = torch.Generator().manual_seed(37)
    q, dout = (torch.randn(1, 4, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, generator=gen) for _ in range(2))
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})
    shares = [t[:, :, mine].contiguous().requires_grad_() for t in (q, k, v)]
    compiled(*shares).backward(dout[:, :, mine])
    pos = torch.arange(S)
    dense_mask = mod(0, 0, pos[:, None], pos[None, :])[None, None]
    grads = {}
    for dtype in (torch.float64, torch.float32):
        full = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        _dense(*full, dense_mask, 1 / math.sqrt(D)).backward(dout.to(dtype))
        grads[dtype] = [t.grad[:, :, mine] for t in full]
    names = ("dq", "dk", "dv")
    errors = {n: (s.grad.double() - t.double()).abs().max().item()
              for n, s, t in zip(names, shares, grads[torch.float64])}
    own = {n: (e.double() - t.double()).abs().max().item()
           for n, e, t in zip(names, grads[torch.float32], grads[torch.float64])}
    graphs = torch_commopt.explain().graphs
    return {"errors": errors, "eager_errors": own, "notes": [n for g in graphs for n in g.notes if "attention" in n]}
