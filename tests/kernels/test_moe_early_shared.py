"""EarlyShared (kernels/moe/module.py): a MoE's shared experts run while the routed tokens' counts
travel, their output handed to the MoE's own call for that very tensor, and the MoE itself again
after every forward, a failed one too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_commopt.kernels.moe.module import EarlyShared, _Deferred


class _MoE(nn.Module):
    """torchtitan's MoE.forward order: the routed experts (which run `early`), then the shared
    experts on x.view(-1, dim)."""

    def __init__(self, fail: bool = False, other_input: bool = False):
        super().__init__()
        self.shared_experts = nn.Linear(4, 4)
        self.experts = nn.Identity()
        self.fail, self.other_input, self.early = fail, other_input, None

    def forward(self, x):
        x = x.view(-1, x.shape[-1])
        self.early()  # where ExpertParallelForward calls it: between posting the counts and reading them
        if self.fail:
            raise RuntimeError("a failing routed path")
        return self.shared_experts(x.clone() if self.other_input else x)


def _calls(module: nn.Module) -> list:
    seen = []
    module.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    return seen


def test_the_early_output_is_the_one_the_moe_uses_and_the_module_comes_back():
    moe = _MoE()
    moe.early = EarlyShared(moe).run
    real, seen = moe.shared_experts, _calls(moe.shared_experts)
    x = torch.randn(2, 3, 4)
    out = moe(x)
    assert torch.equal(out, real(x.view(-1, 4)))
    assert moe.shared_experts is real and moe.early.__self__.runs == 1
    assert len(seen) == 2  # once early inside the forward, once just now: never twice in a forward


def test_another_input_gets_the_real_module_and_nothing_stale_is_kept():
    moe = _MoE(other_input=True)
    moe.early = EarlyShared(moe).run
    x = torch.randn(2, 3, 4)
    out = moe(x)
    assert torch.equal(out, moe.shared_experts(x.view(-1, 4)))
    early = moe.early.__self__
    assert early.runs == 0 and early.out is None and early.x is None


def test_a_failed_forward_leaves_the_moe_as_it_was():
    moe = _MoE(fail=True)
    moe.early = EarlyShared(moe).run
    real = moe.shared_experts
    with pytest.raises(RuntimeError, match="failing routed path"):
        moe(torch.randn(2, 3, 4))
    assert moe.shared_experts is real and not isinstance(moe._modules["shared_experts"], _Deferred)
    assert moe.early.__self__.x is None
