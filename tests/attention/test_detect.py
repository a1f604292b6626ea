"""detect.find_attention on graphs traced from small programs (single process, fake process group).

Graphs come from aot_autograd with Inductor's decompositions and partitioner (the op set the
post-grad pass sees, without Inductor's codegen); one test checks that the real post-grad
graph (compile_fx with a capturing custom pass) gives the same answer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from dist_programs import all_gather_on, funcol_gather
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table

from torch_commopt.passes.attention.detect import find_attention

worlds = pytest.mark.parametrize("fake_world", [2, 4], indirect=True)


def _found(fn, *inputs):
    """[(regions summaries, skips)] of the forward and backward graphs of fn."""
    out = []

    def capture(gm, _):
        regions, skips = find_attention(gm.graph)
        out.append(([r.summary() for r in regions], skips))
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture, decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    inputs = [t.requires_grad_(True) for t in inputs]
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs).sum().backward()
    return out


def _group():
    return dist.group.WORLD.group_name


def _qkv(world, h=4, h_kv=2, s_loc=8, d=16, layout="bhsd"):
    shapes = {"bhsd": [(2, h, s_loc, d), (2, h_kv, s_loc, d)], "bshd": [(2, s_loc, h, d), (2, s_loc, h_kv, d)],
              "sbhd": [(s_loc, 2, h, d), (s_loc, 2, h_kv, d)]}[layout]
    return torch.randn(*shapes[0]), torch.randn(*shapes[1]), torch.randn(*shapes[1])


def _sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _gather_kv_dim2(q, k, v):
    return _sdpa(q, funcol_gather(k, 2),
                 funcol_gather(v, 2), scale=0.3)


def _gather_kv_bshd(q, k, v):
    """(B, S, H, D) activations gathered on dim 1 (dim-0 gather + chunk/cat), then transposed."""
    k, v = (all_gather_on(t, 1).transpose(1, 2) for t in (k, v))
    return _sdpa(q.transpose(1, 2), k, v).transpose(1, 2)


def _gather_kv_seq_first(q, k, v):
    """(S, B, H, D) gathered on dim 0 (a plain wait), permuted to (B, H, S, D)."""
    k, v = (funcol_gather(t, 0).permute(1, 2, 0, 3) for t in (k, v))
    return _sdpa(q.permute(1, 2, 0, 3), k, v)


@worlds
@pytest.mark.parametrize("program,layout", [(_gather_kv_dim2, "bhsd"), (_gather_kv_bshd, "bshd"),
                                            (_gather_kv_seq_first, "sbhd")])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_gathered_kv_with_local_q_is_one_region(fake_world, program, layout, heads):
    fwd, bwd = _found(program, *_qkv(fake_world, *heads, layout=layout))
    (region,), skips = fwd
    assert not skips and bwd == ([], [])  # the backward graph holds saved gathers: no forward form
    assert region["form"] == "allgather_kv" and region["op"] == "cpu_flash" and region["world"] == fake_world
    assert region["shape"] == [2, heads[0], heads[1], 8 * fake_world, 16] and region["causal"] is False
    assert len(region["collectives"]) == 2 and region["inputs"]["k"].startswith("primals")
    assert region["scale"] == (0.3 if program is _gather_kv_dim2 else None)


def _ulysses(world, causal):
    def seq_to_heads(x):  # (B, S_loc, H, D) -> (B, H / W, S, D)
        b, s, h, d = x.shape
        x = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        y = funcol.all_to_all_single(x, None, None, group=_group())
        return y.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d).transpose(1, 2)

    def heads_to_seq(x):  # (B, H / W, S, D) -> (B, S_loc, H, D)
        b, h, s, d = x.shape
        x = x.transpose(1, 2).reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
        y = funcol.all_to_all_single(x, None, None, group=_group())
        return y.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)

    return lambda q, k, v: heads_to_seq(_sdpa(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), is_causal=causal))


@worlds
@pytest.mark.parametrize("causal", [False, True])
def test_all_to_all_attention_all_to_all_is_ulysses(fake_world, causal):
    q, k, v = _qkv(fake_world, h=2 * fake_world, h_kv=fake_world, layout="bshd")
    fwd, bwd = _found(_ulysses(fake_world, causal), q, k, v)
    (region,), skips = fwd
    assert not skips and bwd == ([], [])
    assert region["form"] == "ulysses" and region["causal"] is causal and len(region["collectives"]) == 4
    assert region["shape"] == [2, 2 * fake_world, fake_world, 8 * fake_world, 16]
    assert region["input_shapes"] == {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape)}


def _head_gather(q, k, v):
    return _sdpa(q, funcol_gather(k, 1),
                 funcol_gather(v, 1))


def _q_gathered_too(q, k, v):
    q, k, v = (funcol_gather(t, 2) for t in (q, k, v))
    return _sdpa(q, k, v)


def _local_causal(q, k, v):
    k, v = (funcol_gather(t, 2) for t in (k, v))
    return _sdpa(q, k, v, is_causal=True)


def _explicit_mask(q, k, v):  # a sliding window: not the global causal mask
    k, v = (funcol_gather(t, 2) for t in (k, v))
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril() & torch.ones(
        q.shape[2], k.shape[2], dtype=torch.bool).triu(-1)
    return _sdpa(q, k, v, attn_mask=mask)


def _global_causal_mask(q, k, v):  # this rank's rows of the global causal mask, built from its rank
    k, v = (funcol_gather(t, 2) for t in (k, v))
    rows = torch.arange(q.shape[2]) + dist.get_rank() * q.shape[2]
    return _sdpa(q, k, v, attn_mask=rows[:, None] >= torch.arange(k.shape[2])[None, :])


def _only_k(q, k, v):
    k = funcol_gather(k, 2)
    return _sdpa(q, k, v.repeat(1, 1, dist.get_world_size(), 1))


def _q_whole_sequence(q, k, v):
    k, v = (funcol_gather(t, 2) for t in (k, v))
    return _sdpa(q.repeat(1, 1, dist.get_world_size(), 1), k, v)  # every rank's queries: not a shard


@pytest.mark.parametrize("fake_world", [4], indirect=True)
@pytest.mark.parametrize("program,h_kv,reason", [
    (_q_whole_sequence, 2, "q is not this rank's sequence shard"),
    (_head_gather, 1, "lands on dim 1, not the sequence dim 2"),
    (_q_gathered_too, 2, "operands come from all_gather (q), all_gather (k), all_gather (v)"),
    (_local_causal, 2, "top-left aligned"),
    (_explicit_mask, 2, "explicit attention mask: not the global causal mask"),
    (_only_k, 2, "from None (q), all_gather (k), None (v)"),
])
def test_collective_fed_attention_that_cannot_be_taken_is_skipped_with_the_reason(fake_world, program, h_kv, reason):
    (regions, skips), *_ = _found(program, *_qkv(fake_world, h=4, h_kv=h_kv))
    assert regions == [] and len(skips) == 1 and reason in skips[0].reason, skips


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_a_mask_that_is_the_global_causal_mask_makes_a_causal_region(fake_world):
    # the mask is evaluated at compile time (it is built from constants: the rank and aranges)
    (regions, skips), *_ = _found(_global_causal_mask, *_qkv(fake_world, h=4, h_kv=2))
    assert skips == [] and len(regions) == 1 and regions[0]["causal"], (regions, skips)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("plan", ["tp", "tp_sp"])
def test_head_parallel_attention_yields_nothing(fake_world, plan):
    """DTensor TP (heads sharded; TP+SP too, whose gather feeds the projections) on a Llama block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_commopt.testing.models import LlamaBlock, tp_plan, tp_sp_plan

    model = LlamaBlock(32, 4, 64)
    parallelize_module(model, init_device_mesh("cpu", (fake_world,)), (tp_plan if plan == "tp" else tp_sp_plan)(model))
    x = torch.randn(2, 8 // (fake_world if plan == "tp_sp" else 1), 32)
    for regions, skips in _found(model, x):
        assert regions == [] and skips == []


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_the_post_grad_graph_gives_the_same_region(fake_world):
    """What the backend's post-grad pass would see (compile_fx + a capturing custom pass)."""
    from torch._inductor.compile_fx import compile_fx

    seen = []

    class Capture(CustomGraphPass):
        def __call__(self, graph):
            seen.append([r.summary() for r in find_attention(graph)[0]])

        def uuid(self):
            return None

    def backend(gm, inputs):
        return compile_fx(gm, inputs, config_patches={"post_grad_custom_post_pass": Capture()})

    q, k, v = _qkv(fake_world)
    torch.compile(_gather_kv_dim2, backend=backend)(q, k, v)
    torch._dynamo.reset()
    (aot_regions, _), = _found(_gather_kv_dim2, q.clone(), k.clone(), v.clone())[:1]
    keys = ("form", "op", "world", "shape", "causal", "scale", "input_shapes", "collectives")
    assert len(seen) == 1 and len(seen[0]) == len(aot_regions) == 1
    assert {k: seen[0][0][k] for k in keys} == {k: aot_regions[0][k] for k in keys}


def _flex_gathered(q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    k, v = (funcol_gather(t, 2) for t in (k, v))
    if q.shape[2] < 128:  # no block mask: flex's full-attention sentinel
        return flex_attention(q, k, v)
    # rank 0's rows (offset 0) against every key, causal
    mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, q.shape[2], k.shape[2], device="cpu")
    return flex_attention(q, k, v, block_mask=mask)


def _flex_found(seq_local: int):
    found = []

    def capture(gm, _):
        found.append(find_attention(gm.graph))
        return make_boxed_func(gm)

    q, k, v = (torch.randn(1, 2, seq_local, 16) for _ in range(3))  # inference: flex has no CPU backward
    torch.compile(_flex_gathered, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(q, k, v)
    (found,) = found
    return found


def test_flex_attention_with_gathered_kv_is_a_region_with_its_mask(fake_world):
    """K/V gathered along the sequence into flex_attention with local queries: a flex_allgather_kv
    region holding the mask as the graph does (its tables, the mask graph's code, [rows, keys, block])."""
    regions, skips = _flex_found(256)
    assert skips == [] and [r.form for r in regions] == ["flex_allgather_kv"]
    (r,) = regions
    assert r.world == fake_world and tuple(r.shape) == (1, 2, 2, 256 * fake_world, 16)
    assert r.flex.sizes == [256, 256 * fake_world, 128] and len(r.flex.tables) == 4
    assert "def forward(self" in r.flex.code and len(r.collectives) == 2


def test_flex_attention_in_partial_blocks_is_a_skip_with_the_reason(fake_world):
    regions, skips = _flex_found(8)  # 8 rows a rank, no block mask: not whole 128-token blocks
    assert regions == [] and len(skips) == 1
    assert "flex_attention:" in skips[0].reason and "whole square blocks" in skips[0].reason


def _decode_program(mask_kind):
    def program(q, k, v):
        k, v = (funcol_gather(t, 2) for t in (k, v))
        q = q[:, :, :1]  # one new token's query: not a sequence shard
        if mask_kind == "cache":
            return _sdpa(q, k, v, attn_mask=torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool))
        if mask_kind == "short":  # a mask over part of the cache only
            return _sdpa(q, k[:, :, :4], v[:, :, :4], attn_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))
        if mask_kind == "causal":
            return _sdpa(q, k, v, is_causal=True)
        return _sdpa(q, k, v)
    return program


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("mask_kind", ["none", "cache"])
def test_a_few_queries_against_a_gathered_cache_are_decoding(fake_world, mask_kind):
    (regions, skips), *_ = _found(_decode_program(mask_kind), *_qkv(fake_world, h=4, h_kv=2))
    assert skips == [] and len(regions) == 1, (regions, skips)
    region = regions[0]
    assert region["form"] == "decode_kv" and region["shape"] == [2, 4, 2, 8 * fake_world, 16]
    assert ("mask" in region["inputs"]) == (mask_kind == "cache")


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("mask_kind,reason", [("causal", "is_causal with decoding queries"),
                                              ("short", "")])
def test_decoding_that_cannot_be_taken_is_left_alone(fake_world, mask_kind, reason):
    (regions, skips), *_ = _found(_decode_program(mask_kind), *_qkv(fake_world, h=4, h_kv=2))
    assert regions == [] and (not reason or (len(skips) == 1 and reason in skips[0].reason)), (regions, skips)


@pytest.mark.parametrize("fill, read", [(float("-inf"), True), (-65504.0, True), (torch.finfo(torch.bfloat16).min, True),
                                        (torch.finfo(torch.float32).min, True), (-1024.0, False), (-1.0, False)])
def test_sdpa_s_additive_forms_of_a_boolean_mask_are_read_back_to_the_boolean(fill, read):
    """where(~mask, fill, 0) is SDPA's boolean mask made additive: -inf before flash/efficient
    kernels, a large finite negative before cuDNN (ATen's convert_boolean_attn_mask_cudnn: -65504
    or the dtype's lowest by release); where(mask, 0, fill) the same; a fill above -65504 is a bias
    of the program's own, not a boolean's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_commopt.passes.attention.mask_forms import boolean_of as _boolean_of

    aten = torch.ops.aten
    zero = lambda: aten.scalar_tensor(0.0, dtype=torch.bfloat16)  # noqa: E731
    held = torch.tensor(fill, dtype=torch.float32)  # a tensor constant of the traced graph (get_attr)
    forms = [lambda m: aten.where.ScalarSelf(aten.logical_not(m), fill, zero()),
             lambda m: aten.where.ScalarOther(m, zero(), fill).expand(2, 4, 8, 8),
             lambda m: aten.where.self(m, zero(), held)]
    for i, form in enumerate(forms):
        gm = make_fx(form, tracing_mode="real" if i == 2 else "fake")(torch.rand(1, 1, 8, 8) > 0.5)
        mask = next(n for n in gm.graph.nodes if n.op == "placeholder")
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert (_boolean_of(out) is mask) == read, (fill, gm.code)
