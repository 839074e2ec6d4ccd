"""The fused ops of ``te_compile.functional.fused_linear``, ``fused_linear_add`` and ``fused_norm``
beyond the registry test: weight-gradient accumulation into ``main_grad``, an unused branch
output, and bad input raising a ValueError that names the argument, in eager and under
compile."""

from __future__ import annotations

import pytest
import torch

from te_compile import functional as F
from tests.utils import DEVICES, assert_close


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "call",
    [
        lambda x, w, b, mg: F.linear_bias_activation(x, w, b, "srelu", main_grad=mg),
        lambda x, w, b, mg: F.linear_add(x, w, b, torch.zeros_like(x[:, :8]), 2.0, main_grad=mg),
        lambda x, w, b, mg: F.branch_linear(x, w, b, main_grad=mg)[0],
    ],
    ids=["linear_bias_activation", "linear_add", "branch_linear"],
)
def test_weight_gradient_goes_into_main_grad(call, device):
    x = torch.randn(6, 16, device=device)
    w = torch.randn(8, 16, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    main_grad = torch.ones(8, 16, device=device)
    y = call(x, w, b, main_grad)
    y.backward(torch.ones_like(y))
    assert w.grad is None and b.grad is not None
    w_ref = w.detach().clone().requires_grad_()
    call(x, w_ref, b.detach(), None).backward(torch.ones_like(y))
    assert_close(main_grad, 1 + w_ref.grad.double(), torch.float32, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_unused_branch_outputs_get_a_zero_gradient(device):
    x = torch.randn(6, 16, device=device, requires_grad=True)
    w = torch.randn(8, 16, device=device)
    out, _branch = F.branch_linear(x, w)
    out.backward(torch.ones_like(out))
    assert_close(x.grad, torch.ones(6, 8, dtype=torch.float64) @ w.double().cpu(), torch.float32)
    x.grad = None
    weight = torch.ones(16, device=device)
    _out, branch = F.branch_rmsnorm(x, weight)
    branch.backward(torch.full_like(branch, 3.0))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def _x(*shape):
    return torch.randn(*shape)


BAD = [
    (
        lambda: F.linear_add(_x(4, 16), _x(8, 16), None, _x(4, 6)),
        r"te.linear_add: residual must have the output's shape \[4, 8\]",
    ),
    (
        lambda: F.linear_add(_x(4, 16), _x(8, 16), None, _x(4, 8).double()),
        "te.linear_add: residual must have .* inp's dtype torch.float32",
    ),
    (
        lambda: F.linear_add(_x(4, 12), _x(8, 16), None, _x(4, 8)),
        r"te.linear: inp.shape\[-1\] \(12\) must equal in_features",
    ),
    (
        lambda: F.linear_bias_activation(_x(4, 16), _x(8, 16), _x(6), "gelu"),
        r"te.activation: bias must have shape \[inp.shape\[-1\]\] = \[8\]",
    ),
    (
        lambda: F.linear_bias_activation(_x(4, 16), _x(7, 16), None, "swiglu"),
        r"te.gated_activation: inp.shape\[-1\] \(7\) must be even",
    ),
    (
        lambda: F.linear_bias_activation(_x(4, 16), _x(8, 16), None, "swiglu", 3),
        r"glu_interleave_size \(3\) must divide half the last dim",
    ),
    (
        lambda: F.linear_bias_activation(_x(4, 16), _x(8, 16), None, "tanh"),
        "te.linear_bias_activation: activation must be one of",
    ),
    (
        lambda: F.branch_linear(_x(4, 16), _x(8, 16), _x(8).half()),
        r"te.linear: bias.dtype \(torch.float16\) must equal weight.dtype",
    ),
    (
        lambda: F.branch_rmsnorm(_x(4, 16), _x(15)),
        r"te.rmsnorm: weight must have shape \[inp.shape\[-1\]\] = \[16\]",
    ),
    (
        lambda: F.branch_rmsnorm(_x(4, 16), _x(16), eps=0.0),
        "te.rmsnorm: eps must be > 0",
    ),
]


@pytest.mark.parametrize(("call", "match"), BAD)
def test_bad_input_names_the_argument_eager_and_compiled(call, match):
    with pytest.raises(ValueError, match=match):
        call()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(call, fullgraph=True)()


def test_branch_rmsnorm_backward_checks_the_branch_gradient():
    x, w = _x(4, 16), _x(16)
    _out, _branch, rsigma = torch.ops.te.branch_rmsnorm_fwd(x, w, 1e-5, False)
    with pytest.raises(ValueError, match=r"te\.branch_rmsnorm: grad_branch must have inp's shape"):
        torch.ops.te.branch_rmsnorm_bwd(_x(4, 16), _x(4, 8), x, rsigma, w, False)
