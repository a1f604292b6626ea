"""Per-rank programs for FlexAttention context parallelism on GPUs (issue 70): the ops a rewritten
graph calls (cp_flex_attention_fwd / _bwd, ring and all-gather schedules, their flex kernels
compiled by Inductor) and whole programs compiled with backend="commopt" -- inference and a
training step -- against dense float64 attention over the whole sequence.  Every rank builds the
whole sequence's inputs and mask from seeds; the tolerance is relative to single-GPU FlexAttention's
own error over the whole sequence in the same dtype (torch.compile'd flex_attention)."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

S, BLOCK, D, H, H_KV = 4096, 128, 64, 4, 2
KINDS = ("causal", "document", "window", "document+window", "empty rows")
PADDING = 100  # "empty rows": the last 100 tokens are padding, rows with no key


def seq_len(world: int) -> int:
    """The whole sequence over `world` ranks: S where it splits into whole blocks a rank, else the
    longest that does (3840 over three ranks: ten blocks each)."""
    return S // (world * BLOCK) * world * BLOCK


def doc_ids(device, seq: int = S) -> torch.Tensor:
    """Documents over `seq` tokens: ones that cross the shares at 2, 3 and 4 ranks, a one-token one
    and one longer than a share at 4 ranks."""
    ids = torch.zeros(1, seq, dtype=torch.int32)
    for cut in (300, 1100, 1101, 2300, 3000):
        ids[:, cut:] += 1
    return ids.to(device)


def mask_mod_of(kind: str, docs: torch.Tensor, window: int = 700):
    padded_from = docs.shape[-1] - PADDING
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "document":
        return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv)
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < window)
    if kind == "empty rows":  # earlier tokens only (token 0 sees none), padding at the end
        return lambda b, h, q, kv: (q > kv) & (q - kv <= window) & (q < padded_from)
    return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv) & (q - kv < window)


def _inputs(seed: int, device, seq: int = S) -> list[torch.Tensor]:
    """q, k, v, dout over the whole sequence in float32 (cast by the caller)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(1, H, seq, D), (1, H_KV, seq, D), (1, H_KV, seq, D), (1, H, seq, D)]
    return [torch.randn(*shape, device=device, generator=gen) for shape in shapes]


def _dense(q, k, v, dense_mask, scale):
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    # a row with no key: output 0 and no gradient (softmax over zeros, dropped: no NaN in the gradients)
    some = dense_mask.any(-1, keepdim=True)
    scores = ((q @ kr.transpose(-1, -2)) * scale).masked_fill(~dense_mask, float("-inf")).masked_fill(~some, 0.0)
    return (torch.softmax(scores, -1) * some) @ vr


def _truth(tensors, mod) -> list[torch.Tensor]:
    """[out, dq, dk, dv] over the whole sequence in float64."""
    q, k, v, dout = (t.double().requires_grad_() for t in tensors)
    pos = torch.arange(q.shape[2], device=q.device)
    out = _dense(q, k, v, mod(0, 0, pos[:, None], pos[None, :])[None, None], 1 / math.sqrt(D))
    out.backward(dout.detach())
    return [out.detach(), q.grad, k.grad, v.grad]


def _whole_flex(tensors, mod, dtype) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of single-GPU FlexAttention over the whole sequence in `dtype`: the
    reference whose own error sets the tolerance."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (t.to(dtype).requires_grad_() for t in tensors[:3])
    mask = create_block_mask(mod, 1, None, q.shape[2], q.shape[2], device=q.device, BLOCK_SIZE=BLOCK)
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask, enable_gqa=True)
    out.backward(tensors[3].to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _rows_of(mod, offset: int):
    """The mask of a rank's rows, as a context-parallel program states it (its offset added)."""
    return lambda b, h, q, kv: mod(b, h, q + offset, kv)


def _compare(label: str, got: list, truth: list, own: list, mine: slice) -> list[tuple[str, float, float]]:
    """(label name, error of ours, the reference's own) per tensor, on this rank's rows."""
    out = []
    for name, g, t, o in zip(("out", "dq", "dk", "dv")[:len(got)], got, truth, own, strict=True):
        t_mine = t[:, :, mine].double()
        out.append((f"{label} {name}", float((g.double() - t_mine).abs().max()),
                    float((o[:, :, mine].double() - t_mine).abs().max())))
    return out


OPS_SCHEDULES = ("ring", "allgather:g=2", "allgather kept")


def run_flex_ops(rank: int, world: int, dtype: torch.dtype = torch.bfloat16,
                 schedules: tuple[str, ...] = OPS_SCHEDULES) -> list[tuple[str, float, float]]:
    """cp_flex_attention_fwd / _bwd as a rewritten graph calls them, every mask, ring and
    all-gather (two head groups), the whole mask and the rank's rows only; and the one-group
    all-gather's kept pair (cp_flex_attention_fwd_keep / _bwd_kept, the gathered K/V carried)
    (`schedules`: those, or others, e.g. the one-group "allgather" that gathers again)."""
    from torch.nn.attention.flex_attention import create_block_mask

    import torch_commopt  # noqa: F401  (registers the ops)
    from torch_commopt.kernels.attention import flex

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    seq = seq_len(world)
    length = seq // world
    mine = slice(rank * length, (rank + 1) * length)
    results = []
    for i, kind in enumerate(KINDS):
        tensors = _inputs(100 + i, device, seq)
        mod = mask_mod_of(kind, doc_ids(device, seq))
        truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
        for own_rows in (False, True):
            rows_mod = _rows_of(mod, rank * length) if own_rows else mod
            bm = create_block_mask(rows_mod, 1, None, length if own_rows else seq, seq, device=device, BLOCK_SIZE=BLOCK)
            graph, buffers = flex.lift(bm.mask_mod, device)
            tables = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
            for schedule in schedules:
                args = (tables, list(buffers), graph.code, [length if own_rows else seq, seq, BLOCK], 1 / math.sqrt(D),
                        world, group.group_name, schedule.removesuffix(" kept"))
                q, k, v, dout = (t[:, :, mine].to(dtype).contiguous() for t in tensors)
                if schedule.endswith(" kept"):
                    out, lse, k_all, v_all = torch.ops.commopt.cp_flex_attention_fwd_keep(q, k, v, *args)
                    grads = torch.ops.commopt.cp_flex_attention_bwd_kept(dout, q, k_all, v_all, out, lse, *args)
                else:
                    out, lse = torch.ops.commopt.cp_flex_attention_fwd(q, k, v, *args)
                    grads = torch.ops.commopt.cp_flex_attention_bwd(dout, q, k, v, out, lse, *args)
                label = f"ops {kind} {schedule}{' own rows' if own_rows else ''}"
                results += _compare(label, [out, *grads], truth, own, mine)
    return results


def run_flex_ops_pulled(rank: int, world: int) -> list[tuple[str, float, float]]:
    """run_flex_ops with the one-group all-gathers (kept and gathered again), checking that the
    pulled gather and the cut reduce-scatter ran (TORCH_COMMOPT_FLEX_GATHER_CUT=1 set by the caller)."""
    from torch_commopt.kernels.attention import ce_gather

    results = run_flex_ops(rank, world, torch.bfloat16, ("allgather", "allgather kept"))
    assert ce_gather.STATS["pulled"] > 0, "the pulled all-gather never ran"
    assert ce_gather.STATS["cut scatter"] > 0, "the cut reduce-scatter never ran"
    return results


def run_flex_hybrid(rank: int, world: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, float, float]]:
    """hybrid:2:2 at four ranks through cp_flex_attention_fwd / _bwd: Ulysses over each pair of
    consecutive ranks (one KV head each), the flex ring over the two pairs, the whole mask (the same
    for every head, as the hybrid needs), every mask but the padded one."""
    from torch.nn.attention.flex_attention import create_block_mask

    import torch_commopt  # noqa: F401  (registers the ops)
    from torch_commopt.kernels.attention import flex

    device = torch.device("cuda", torch.cuda.current_device())
    group, length = dist.group.WORLD, S // world
    mine = slice(rank * length, (rank + 1) * length)
    results = []
    for i, kind in enumerate(KINDS[:4]):
        tensors = _inputs(300 + i, device)
        mod = mask_mod_of(kind, doc_ids(device))
        truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
        bm = create_block_mask(mod, 1, None, S, S, device=device, BLOCK_SIZE=BLOCK)
        graph, buffers = flex.lift(bm.mask_mod, device)
        tables = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
        args = (tables, list(buffers), graph.code, [S, S, BLOCK], 1 / math.sqrt(D), world, group.group_name,
                "hybrid:2:2")
        q, k, v, dout = (t[:, :, mine].to(dtype).contiguous() for t in tensors)
        out, lse = torch.ops.commopt.cp_flex_attention_fwd(q, k, v, *args)
        grads = torch.ops.commopt.cp_flex_attention_bwd(dout, q, k, v, out, lse, *args)
        results += _compare(f"hybrid {kind}", [out, *grads], truth, own, mine)
    return results


def run_flex_ce(rank: int, world: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The one-group all-gather's ops with K/V moved by the copy engine (ce_gather; the caller
    set TORCH_COMMOPT_ATTENTION_TRANSPORT=ce), the kept pair and the unkept one, causal and
    documents over the rank's rows: {"results" against float64 and single-GPU flex, "same": the
    outputs equal to NCCL's bit for bit (the gather only copies), "moves": ce_gather's calls}."""
    from torch.nn.attention.flex_attention import create_block_mask

    import torch_commopt  # noqa: F401  (registers the ops)
    from torch_commopt.core import env
    from torch_commopt.kernels.attention import ce_gather, flex

    device = torch.device("cuda", torch.cuda.current_device())
    group, length = dist.group.WORLD, S // world
    mine = slice(rank * length, (rank + 1) * length)
    moves = {"all_gather_kv": 0, "reduce_scatter_kv": 0}

    def counted(name, fn):
        def call(*a):
            moves[name] += 1
            return fn(*a)
        return call

    for name in moves:
        setattr(ce_gather, name, counted(name, getattr(ce_gather, name)))
    results, same = [], []
    for i, kind in enumerate(("causal", "document")):
        tensors = _inputs(300 + i, device)
        mod = mask_mod_of(kind, doc_ids(device))
        truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
        bm = create_block_mask(_rows_of(mod, rank * length), 1, None, length, S, device=device, BLOCK_SIZE=BLOCK)
        graph, buffers = flex.lift(bm.mask_mod, device)
        tables = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
        args = (tables, list(buffers), graph.code, [length, S, BLOCK], 1 / math.sqrt(D), world, group.group_name,
                "allgather")
        q, k, v, dout = (t[:, :, mine].to(dtype).contiguous() for t in tensors)
        got = {}
        for transport in ("ce", "nccl"):
            os.environ[env.ATTENTION_TRANSPORT] = transport
            out, lse, k_all, v_all = torch.ops.commopt.cp_flex_attention_fwd_keep(q, k, v, *args)
            kept = torch.ops.commopt.cp_flex_attention_bwd_kept(dout, q, k_all, v_all, out, lse, *args)
            out2, lse2 = torch.ops.commopt.cp_flex_attention_fwd(q, k, v, *args)
            grads = torch.ops.commopt.cp_flex_attention_bwd(dout, q, k, v, out2, lse2, *args)
            got[transport] = [out, *kept, out2, *grads, k_all, v_all]
        os.environ[env.ATTENTION_TRANSPORT] = "ce"
        ce = got["ce"]
        results += _compare(f"ce {kind} kept", ce[:4], truth, own, mine)
        results += _compare(f"ce {kind}", ce[4:8], truth, own, mine)
        same.append((kind, [torch.equal(a, b) for a, b in zip(ce, got["nccl"], strict=True)]))
    return {"results": results, "same": same, "moves": moves}


def run_flex_compiled(rank: int, world: int, schedule: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A context-parallel program compiled with backend="commopt": K and V all-gathered along the
    sequence into flex_attention with the rank's queries and its rows' mask (document + window),
    run for inference and for a training step.  {"results": [(label, ours, reference's own)],
    "notes": explain's notes, "ops": the commopt ops in the graphs}."""
    import torch.distributed._functional_collectives as funcol
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch_commopt

    device = torch.device("cuda", torch.cuda.current_device())
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    mod = mask_mod_of("document+window", doc_ids(device))
    bm = create_block_mask(_rows_of(mod, rank * length), 1, None, length, S, device=device, BLOCK_SIZE=BLOCK)

    def gather(x):
        return torch.cat(funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD).chunk(world), dim=2)

    def program(q, k, v):
        return flex_attention(q, gather(k), gather(v), block_mask=bm, enable_gqa=True)

    tensors = _inputs(7, device)
    truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})
    shares = [t[:, :, mine].to(dtype).contiguous() for t in tensors]
    with torch.no_grad():
        inference = compiled(*shares[:3])
    results = _compare(f"compiled {schedule} inference", [inference], truth[:1], own[:1], mine)
    q, k, v = (t.clone().requires_grad_() for t in shares[:3])
    out = compiled(q, k, v)
    out.backward(shares[3])
    results += _compare(f"compiled {schedule} training", [out.detach(), q.grad, k.grad, v.grad], truth, own, mine)
    graphs = torch_commopt.explain().graphs
    return {"results": results, "notes": [n for g in graphs for n in g.notes],
            "ops": {k_: v_ for g in graphs for k_, v_ in g.commopt_ops.items()}}


def run_torch_cp_flex(rank: int, world: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """torch's context_parallel with FlexAttention on GPUs: _ContextParallel(FLEX) on an attention
    module (cplib::flex_cp_allgather), its PTRR load balancer dealing the documents mask and the
    inputs, the block around it compiled with backend="commopt" and trained one step.
    {"results": [(label, ours, reference's own)] on the rank's rearranged rows, "notes"}."""
    import torch.nn.attention.flex_attention as fa
    from dist_programs import torch_cp_flex_block
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _PTRRLoadBalancer

    import torch_commopt

    device = torch.device("cuda", torch.cuda.current_device())
    block = torch_cp_flex_block("cuda", world)
    mesh = init_device_mesh("cuda", (world,))
    mod = mask_mod_of("document", doc_ids(device))
    whole_mask = fa.create_block_mask(mod, 1, None, S, S, device=device, BLOCK_SIZE=BLOCK)
    balancer = _PTRRLoadBalancer(whole_mask, world)
    (block_mask,) = _context_parallel_shard(mesh, [whole_mask], [2], load_balancer=balancer)
    tensors = _inputs(31, device)
    truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
    shares = [t.to(dtype).contiguous()
              for t in _context_parallel_shard(mesh, tensors, [2] * 4, load_balancer=balancer)]
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(block, backend="commopt")
    q, k, v = (t.clone().requires_grad_() for t in shares[:3])
    out = compiled(q, k, v, block_mask)
    out.backward(shares[3])
    mine = balancer._generate_indices()[0].to(device).view(world, -1)[rank]  # noqa: SLF001
    results = []
    for name, g, t, o in zip(("out", "dq", "dk", "dv"), [out.detach(), q.grad, k.grad, v.grad], truth, own):
        t_mine = t.index_select(2, mine).double()
        results.append((f"torch CP {name}", float((g.double() - t_mine).abs().max()),
                        float((o.index_select(2, mine).double() - t_mine).abs().max())))
    graphs = torch_commopt.explain().graphs
    return {"results": results, "notes": [n for g in graphs for n in g.notes]}


def run_flex_batches(rank: int, world: int, dtype: torch.dtype = torch.bfloat16, batches: int = 3) -> dict:
    """A compiled program given a new documents mask each batch: {"results": per batch, "compiled":
    the block kernels compiled after each batch (flex._COMPILED), "graphs": Dynamo's graphs after
    each batch}."""
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch_commopt
    from torch_commopt.kernels.attention import flex

    device = torch.device("cuda", torch.cuda.current_device())
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)

    def gather(x):
        return torch.cat(funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD).chunk(world), dim=2)

    def program(q, k, v, block_mask):
        return flex_attention(q, gather(k), gather(v), block_mask=block_mask, enable_gqa=True)

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    counters.clear()
    compiled = torch.compile(program, backend="commopt")
    torch._logging.set_logs(recompiles=True)  # the reason of any recompile, in the log
    results, kernels, graphs = [], [], []
    for i in range(batches):
        ids = torch.zeros(1, S, dtype=torch.int32)
        cuts = sorted(torch.randperm(S - 2, generator=torch.Generator().manual_seed(i))[:6].add(1).tolist())
        for cut in cuts:
            ids[:, cut:] += 1
        mod = mask_mod_of("document", ids.to(device))
        bm = create_block_mask(_rows_of(mod, rank * length), 1, None, length, S, device=device, BLOCK_SIZE=BLOCK)
        tensors = _inputs(200 + i, device)
        truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
        q, k, v, dout = (t[:, :, mine].to(dtype).contiguous() for t in tensors)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = compiled(q, k, v, bm)
        out.backward(dout)
        results += _compare(f"batch {i}", [out.detach(), q.grad, k.grad, v.grad], truth, own, mine)
        kernels.append(len(flex._COMPILED))  # noqa: SLF001
        graphs.append(counters["stats"]["unique_graphs"])
    return {"results": results, "compiled": kernels, "graphs": graphs}


def run_sdpa_dense_mask(rank: int, world: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """SDPA with a boolean documents mask of the rank's rows (computed in the graph from the ids)
    over all-gathered K/V, compiled with backend="commopt" for inference: it runs the flex ops with
    the mask a buffer.  {"results": [(label, ours, single-GPU flex's own)], "notes"}."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    import torch_commopt

    device = torch.device("cuda", torch.cuda.current_device())
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    docs = doc_ids(device)[0]

    def gather(x):
        return torch.cat(funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD).chunk(world), dim=2)

    def program(q, k, v, ids):
        rows = torch.arange(length, device=q.device) + rank * length
        keys = torch.arange(S, device=q.device)
        mask = (ids[rows][:, None] == ids[None, :]) & (rows[:, None] >= keys[None, :])
        return F.scaled_dot_product_attention(q, gather(k), gather(v), attn_mask=mask[None, None], enable_gqa=True)

    mod = mask_mod_of("document", docs[None])
    tensors = _inputs(41, device)
    truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend=_no_collectives_left)
    with torch.no_grad():
        out = compiled(*(t[:, :, mine].to(dtype).contiguous() for t in tensors[:3]), docs)
    graphs = torch_commopt.explain().graphs
    return {"results": _compare("sdpa dense mask", [out], truth[:1], own[:1], mine),
            "notes": [n for g in graphs for n in g.notes]}


def _no_collectives_left(gm, example_inputs):
    """commopt's backend, refusing (at compile, before anything runs) a graph that still runs a
    collective: with the ranks on one GPU over gloo, funcol on CUDA tensors crashes the process
    (tests/gpu/results/shared_gpu_funcol_segfault_h200_2026-11-25.txt); the error names why."""
    import torch_commopt
    from torch_commopt.backend import commopt_backend

    compiled = commopt_backend(gm, example_inputs)
    graph = torch_commopt.explain().graphs[-1]
    if any(graph.collectives_after.values()):
        raise RuntimeError(f"collectives left {graph.collectives_after}; notes {graph.notes}; skipped {graph.skipped}")
    return compiled


def run_flex_ulysses(rank: int, world: int, schedule: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A Ulysses program around flex_attention compiled with backend="commopt" (all-to-all
    sequence -> heads on (B, S_loc, H, D) activations, flex_attention on H/W heads over the whole
    sequence with its documents + window mask, all-to-all back), inference and a training step.
    {"results": [(label, ours, reference's own)], "notes": explain's attention notes}."""
    import torch.distributed._functional_collectives as funcol
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch_commopt

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    mod = mask_mod_of("document+window", doc_ids(device))
    bm = create_block_mask(mod, 1, None, S, S, device=device, BLOCK_SIZE=BLOCK)

    def seq_to_heads(x):  # (B, S_loc, H, D) -> (B, H/W, S, D), the sequence rank-major
        b, s, h, d = x.shape
        x = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        y = funcol.all_to_all_single_autograd(x, None, None, group=group)
        return y.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d).transpose(1, 2)

    def heads_to_seq(x):  # (B, H/W, S, D) -> (B, S_loc, H, D)
        b, h, s, d = x.shape
        x = x.transpose(1, 2).reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
        y = funcol.all_to_all_single_autograd(x, None, None, group=group)
        return y.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)

    def program(q, k, v):
        return heads_to_seq(flex_attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), block_mask=bm,
                                           enable_gqa=True))

    tensors = _inputs(31, device)
    truth, own = _truth(tensors, mod), _whole_flex(tensors, mod, dtype)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})
    shares = [t[:, :, mine].transpose(1, 2).to(dtype).contiguous() for t in tensors]  # (B, S_loc, H, D)
    with torch.no_grad():
        inference = compiled(*shares[:3]).transpose(1, 2)
    results = _compare(f"ulysses {schedule} inference", [inference], truth[:1], own[:1], mine)
    q, k, v = (t.clone().requires_grad_() for t in shares[:3])
    out = compiled(q, k, v)
    out.backward(shares[3])
    got = [out.detach().transpose(1, 2), *(t.grad.transpose(1, 2) for t in (q, k, v))]
    results += _compare(f"ulysses {schedule} training", got, truth, own, mine)
    graphs = torch_commopt.explain().graphs
    return {"results": results, "notes": [n for g in graphs for n in g.notes if "attention" in n]}
