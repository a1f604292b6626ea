"""Programs run on live gloo groups by the numerics tests (importable by spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import torch_commopt
from torch_commopt.testing.validate import rel_err


def _g():
    return dist.group.WORLD.group_name


# torch 2.11's dynamo will not trace funcol's gather_dim > 0 (`_maybe_view_chunk_cat` is marked
# skipped: a graph break under fullgraph); 2.13's does.
FUNCOL_GATHER_DIM_TRACES = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def all_gather_on(x, dim):
    """Gather on dim 0 and move the rank blocks to `dim` ourselves: funcol's gather_dim > 0
    graph-breaks on torch 2.11 (the form below is what it and DTensor emit)."""
    full = funcol.all_gather_tensor(x, gather_dim=0, group=_g())
    return full if dim == 0 else torch.cat(full.chunk(dist.get_world_size()), dim=dim)


def funcol_gather(x, dim):
    """funcol.all_gather_tensor(x, gather_dim=dim) where dynamo traces it, else its written-out
    form (all_gather_on): the same program on every torch the suite runs on."""
    if dim == 0 or FUNCOL_GATHER_DIM_TRACES:
        return funcol.all_gather_tensor(x, gather_dim=dim, group=_g())
    return all_gather_on(x, dim)




def _rs(x, op, dim):
    return funcol.reduce_scatter_tensor(x, op, scatter_dim=dim, group=_g())


def funcol_programs(world: int):
    """name -> (fn, input shapes, expected commopt op).  Shapes are local (per rank)."""
    w = world
    return {
        "ag_dim0_2d": (lambda a, b: all_gather_on(a, 0) @ b, [(12, 16), (16, 8)], "ag_matmul"),
        "ag_dim1_2d_k": (lambda a, b: all_gather_on(a, 1) @ b, [(12, 8), (8 * w, 8)], "ag_matmul"),
        "ag_dim0_3d": (lambda a, b: all_gather_on(a, 0) @ b, [(2, 6, 16), (16, 8)], "ag_matmul"),
        "ag_dim1_3d": (lambda a, b: all_gather_on(a, 1) @ b, [(2, 6, 16), (16, 8)], "ag_matmul"),
        "ag_dim2_3d_k": (lambda a, b: all_gather_on(a, 2) @ b, [(2, 6, 8), (8 * w, 8)], "ag_matmul"),
        "ag_keep_a": (lambda a, b: (all_gather_on(a, 1), all_gather_on(a, 1) @ b), [(2, 5, 16), (16, 8)], "ag_matmul"),
        "ag_qkv": (lambda a, q, k, v: (all_gather_on(a, 0) @ q, all_gather_on(a, 0) @ k, all_gather_on(a, 0) @ v),
                   [(6, 16), (16, 8), (16, 4), (16, 4)], "ag_matmul"),
        "ag_linear_bias": (lambda a, wt, b: F.linear(all_gather_on(a, 0), wt, b), [(6, 16), (24, 16), (24,)], "ag_matmul"),
        "ag_transposed_rows": (lambda a, wt: F.linear(all_gather_on(a, 0).transpose(0, 1), wt), [(5, 3, 16), (24, 16)],
                               "ag_matmul"),
        "ag_bmm_batch": (lambda a, b: torch.bmm(all_gather_on(a, 0), b), [(3, 4, 16), (3 * w, 16, 8)], "ag_matmul"),
        "rs_dim0_2d": (lambda a, b: _rs(a @ b, "sum", 0), [(8 * w, 16), (16, 8)], "matmul_rs"),
        "rs_dim1_2d_n": (lambda a, b: _rs(a @ b, "sum", 1), [(12, 16), (16, 4 * w)], "matmul_rs"),
        "rs_dim1_3d": (lambda a, b: _rs(a @ b, "sum", 1), [(2, 3 * w, 16), (16, 8)], "matmul_rs"),
        "rs_dim2_3d_n": (lambda a, b: _rs(a @ b, "sum", 2), [(2, 5, 16), (16, 4 * w)], "matmul_rs"),
        "rs_bias": (lambda a, wt, b: _rs(F.linear(a, wt, b), "sum", 0), [(4 * w, 16), (8, 16), (8,)], "matmul_rs"),
        "ar_2d": (lambda a, b: funcol.all_reduce(a @ b, "sum", group=_g()), [(10, 16), (16, 8)], "matmul_ar"),
        "ar_3d": (lambda a, b: funcol.all_reduce(a @ b, "sum", group=_g()), [(2, 5, 16), (16, 8)], "matmul_ar"),
        # one region's output is the next one's matmul input, nothing in between
        "ag_mm_mm_rs": (lambda a, b, c: _rs(all_gather_on(a, 0) @ b @ c, "sum", 0), [(6, 16), (16, 12), (12, 8)],
                        "matmul_rs"),
        "rs_then_ag": (lambda a, b, c: all_gather_on(_rs(a @ b, "sum", 0), 0) @ c, [(4 * w, 16), (16, 8), (8, 4)],
                       "ag_matmul"),
    }


def _device():
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _inputs(shapes, rank, seed, dtype):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(_device(), dtype) for s in shapes]


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def run_funcol_programs(rank: int, world: int, options: dict, seed: int = 0):
    """Per program: (name, [(compiled err, eager err) per output], commopt ops in its graph)."""
    results = []
    for i, (name, (fn, shapes, op)) in enumerate(funcol_programs(world).items()):
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        ref = _flat(fn(*_inputs(shapes, rank, seed + i, torch.float64)))
        eager = _flat(fn(*_inputs(shapes, rank, seed + i, torch.float32)))
        compiled = _flat(torch.compile(fn, backend="commopt", options=options)(*_inputs(shapes, rank, seed + i, torch.float32)))
        errors = [(rel_err(c, r), rel_err(e, r)) for c, e, r in zip(compiled, eager, ref)]
        report = torch_commopt.explain()
        ops = {k: v for g in report.graphs for k, v in g.commopt_ops.items()}
        if ops.get(op, 0) < 1:  # the report says why, in the failing test's message
            name = f"{name}: no {op} in\n{report}"
        results.append((name, errors, ops, op))
    return results


def model_shape(world: int) -> dict:
    """A block's sizes that shard evenly: dim 32 and hidden 64 at 2 or 4 ranks (heads 2W),
    multiples of 3 at 3 ranks."""
    if 32 % (2 * world) == 0:
        return {"batch": 2, "seq": 8 * world, "dim": 32, "hidden": 64, "heads": 2 * world}
    return {"batch": 2, "seq": 8 * world, "dim": 12 * world, "hidden": 24 * world, "heads": 2 * world}


def run_models(rank: int, world: int, options: dict, kinds: tuple[str, ...], shape: dict | None = None):
    from torch_commopt.testing.validate import check

    out = {}
    for kind in kinds:
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        errors = check(kind, options, shape=shape or model_shape(world))
        rewritten = sum(len(g.rewritten) for g in torch_commopt.explain().graphs)
        out[kind] = ([(e.name, e.compiled, e.eager) for e in errors], rewritten)
    return out


def _block_runs(build_fn, labels: dict, x_global: torch.Tensor, shard) -> dict:
    """{label: validate.run_once's results} of a freshly built TP+SP block per label, fed
    shard(x_global) in that label's dtype with one float64 probe.  labels: {label: (dtype,
    wrap)}, wrap(block) -> what runs (the block itself, a compiled or checkpointed form)."""
    from torch_commopt.testing.validate import run_once

    probe = torch.randn(shard(x_global).shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    runs = {}
    for label, (dtype, wrap) in labels.items():
        torch.manual_seed(0)
        block = build_fn().to(dtype)
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        runs[label] = run_once(wrap(block), block, shard(x_global).to(dtype), probe)
    return runs


def _errors(runs: dict, test: str) -> list[tuple[float, float]]:
    """[(runs[test]'s error, eager's error)] against the float64 run, tensor by tensor."""
    return [(rel_err(runs[test][k], ref), rel_err(runs["eager"][k], ref)) for k, ref in runs["ref"].items()]


def _tp_sp_block(mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_commopt.testing.models import LlamaBlock, tp_sp_plan

    block = LlamaBlock(32, 4, 64)
    parallelize_module(block, mesh, tp_sp_plan(block))
    return block


def run_dp_tp_block(rank: int, world: int, options_list: list[dict]) -> list[tuple[int, list[tuple[float, float]]]]:
    """A TP+SP block on the "tp" dim of a (dp, tp) = (2, world / 2) mesh: the TP groups are
    subgroups (global ranks {0, 1} and {2, 3} at world 4), each replica its own batch.  Per
    options: (regions rewritten on this rank, [(compiled error, eager error)] of the output,
    the input grad and every parameter grad, against float64 eager)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp, replica = mesh["tp"], mesh["dp"].get_local_rank()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(100 + replica), dtype=torch.float64)
    results = []
    for options in options_list:
        plain = lambda block: block  # noqa: E731
        labels = {"ref": (torch.float64, plain), "eager": (torch.float32, plain),
                  "compiled": (torch.float32, lambda block: torch.compile(block, backend="commopt", options=options))}
        runs = _block_runs(lambda: _tp_sp_block(tp), labels, x, lambda t: t.chunk(tp.size(), dim=1)[tp.get_local_rank()])
        rewritten = sum(len(g.rewritten) for g in torch_commopt.explain().graphs)
        results.append((rewritten, _errors(runs, "compiled")))
    return results


def _checkpointing(how: str):
    """wrap(block) -> the block under activation checkpointing: "full" wraps each sub-block
    (block.attention, block.feed_forward) in checkpoint_wrapper, as torchtitan's full AC;
    "selective" checkpoints the whole block, matmuls saved and the rest recomputed (an
    op-level selective policy)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def save_matmuls(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def checkpointed(block):
        if how == "full":
            block.attention = checkpoint_wrapper(block.attention)
            block.feed_forward = checkpoint_wrapper(block.feed_forward)
            return block
        context = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        return functools.partial(checkpoint, block, use_reentrant=False, context_fn=context)

    return checkpointed


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def run_checkpointed_block(rank: int, world: int, how: str, options: dict) -> dict:
    """A DTensor TP+SP block under activation checkpointing (_checkpointing(how)), compiled
    with plain inductor and with commopt, against float64 eager.  The backward graph
    recomputes the forward's all-gathers.  {"inductor_error": why torch's own compile failed
    (or None), "commopt_error": why commopt's did (tried only where torch's own failed too;
    None if it ran), "rewritten": regions per graph, "errors": [(commopt error, eager error)]}."""
    from torch.distributed.device_mesh import init_device_mesh

    checkpointed = _checkpointing(how)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    shard = lambda t: t.chunk(world, dim=1)[rank]  # noqa: E731
    result = {"inductor_error": None, "commopt_error": None, "rewritten": [], "errors": []}
    try:  # torch's own compile first: where it fails, commopt can only fail the same way
        _block_runs(lambda: _tp_sp_block(mesh), {"inductor": (torch.float32, lambda b: torch.compile(checkpointed(b)))},
                    x, shard)
    except Exception as e:  # noqa: BLE001 - torch's own failure is reported, not ours
        result["inductor_error"] = _failure(e)
    labels = {"ref": (torch.float64, checkpointed), "eager": (torch.float32, checkpointed),
              "commopt": (torch.float32, lambda b: torch.compile(checkpointed(b), backend="commopt", options=options))}
    try:
        runs = _block_runs(lambda: _tp_sp_block(mesh), labels, x, shard)
    except Exception as e:  # noqa: BLE001 - where torch's own compile failed, the test compares the two
        if result["inductor_error"] is None:
            raise
        result["commopt_error"] = _failure(e)
        return result
    result["rewritten"] = [len(g.rewritten) for g in torch_commopt.explain().graphs]
    result["errors"] = _errors(runs, "commopt")
    return result


class _FuncolAttention(torch.nn.Module):
    """Attention's TP+SP form in functional collectives: all-gather the sequence shards
    (dim 0: sequence first), column-parallel q/k/v (this rank's heads), row-parallel o into a
    reduce-scatter (dim 0).  The weights: shards of a full Attention's."""

    def __init__(self, full, rank: int, world: int):
        super().__init__()
        cols = lambda lin: torch.nn.Parameter(lin.weight.detach().chunk(world, 0)[rank].clone())  # noqa: E731
        self.wq, self.wk, self.wv = cols(full.wq), cols(full.wk), cols(full.wv)
        self.wo = torch.nn.Parameter(full.wo.weight.detach().chunk(world, 1)[rank].clone())
        self.head_dim = full.head_dim

    def forward(self, x):
        full = funcol.all_gather_tensor_autograd(x, gather_dim=0, group=_g())  # (seq, batch, dim)
        s, b, _ = full.shape
        q, k, v = (F.linear(full, w).view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        return funcol.reduce_scatter_tensor_autograd(F.linear(out, self.wo), "sum", scatter_dim=0, group=_g())


class _FuncolSwiGLU(torch.nn.Module):
    """SwiGLU's TP+SP form in functional collectives: all-gather (dim 0), w1/w3 column shards,
    the w2 row shard into a reduce-scatter (dim 0)."""

    def __init__(self, full, rank: int, world: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(full.w1.weight.detach().chunk(world, 0)[rank].clone())
        self.w3 = torch.nn.Parameter(full.w3.weight.detach().chunk(world, 0)[rank].clone())
        self.w2 = torch.nn.Parameter(full.w2.weight.detach().chunk(world, 1)[rank].clone())

    def forward(self, x):
        full = funcol.all_gather_tensor_autograd(x, gather_dim=0, group=_g())
        partial = F.linear(F.silu(F.linear(full, self.w1)) * F.linear(full, self.w3), self.w2)
        return funcol.reduce_scatter_tensor_autograd(partial, "sum", scatter_dim=0, group=_g())


class _FuncolTpSpBlock(torch.nn.Module):
    """LlamaBlock in the form tp_sp_plan gives it, written with functional collectives
    instead of DTensor: the residual stream (seq / W, batch, dim) sequence-sharded, the norms
    on the shard, an all-gather before attention and before the MLP, a reduce-scatter after
    each.  _tp_sp_block's math, sequence first (the collectives on dim 0)."""

    def __init__(self, rank: int, world: int):
        from torch_commopt.testing.models import LlamaBlock

        super().__init__()
        full = LlamaBlock(32, 4, 64)
        self.attention_norm, self.ffn_norm = full.attention_norm, full.ffn_norm
        self.attention = _FuncolAttention(full.attention, rank, world)
        self.feed_forward = _FuncolSwiGLU(full.feed_forward, rank, world)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def run_checkpointed_funcol_block(rank: int, world: int, how: str, options: dict) -> dict:
    """run_checkpointed_block's program with the block written in functional collectives
    (_FuncolTpSpBlock) instead of DTensor: the nearest program to it that torch 2.13's
    AOTAutograd compiles under activation checkpointing (with DTensor the checkpointed
    region's forward saves a DeviceMesh among the tensors for the backward, which 2.13's
    runtime wrapper refuses).  Plain inductor and commopt each against eager, all against
    float64 eager.  Per graph of commopt's ("kinds": forward, backward): the kinds of the
    regions rewritten, the collectives found, the regions skipped and why; "errors":
    [(commopt error, eager error)], "inductor_errors": [(inductor error, eager error)]."""
    checkpointed = _checkpointing(how)
    torch.set_num_threads(1)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # (seq, batch, dim)
    shard = lambda t: t.chunk(world, dim=0)[rank]  # noqa: E731
    build = lambda: _FuncolTpSpBlock(rank, world)  # noqa: E731
    labels = {"ref": (torch.float64, checkpointed), "eager": (torch.float32, checkpointed),
              "inductor": (torch.float32, lambda b: torch.compile(checkpointed(b))),
              "commopt": (torch.float32, lambda b: torch.compile(checkpointed(b), backend="commopt", options=options))}
    runs = _block_runs(build, labels, x, shard)  # commopt last: explain() below is its report
    graphs = torch_commopt.explain().graphs
    return {"kinds": [g.graph_kind for g in graphs], "rewritten": [sorted(r.kind for r in g.rewritten) for g in graphs],
            "collectives": [dict(g.collectives_before) for g in graphs],
            "skipped": [[f"{k.kind}: {k.reason}" for k in g.skipped] for g in graphs],
            "errors": _errors(runs, "commopt"), "inductor_errors": _errors(runs, "inductor")}


def torch_cp_flex_block(device_type: str, world: int) -> torch.nn.Module:
    """torch's context_parallel for FlexAttention as torchtitan applies it: an attention module
    parallelized with _ContextParallel(FLEX) (K/V gathered by cplib::flex_cp_allgather in its
    pre-hook), inside a block whose forward a test compiles -- the gather then lies in the
    compiled graph, as when torchtitan compiles whole blocks.  Called as block(q, k, v, block_mask)."""
    import torch.nn.attention.flex_attention as fa
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, *, block_mask=None):
            return fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    class Block(torch.nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def forward(self, q, k, v, block_mask):
            return self.attn(q * 1, k * 1, v * 1, block_mask=block_mask)

    mesh = init_device_mesh(device_type, (world,))
    plan = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    return Block(parallelize_module(Attention(), mesh, plan))
