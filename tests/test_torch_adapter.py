"""flashgen.torch.attention inside autograd, against torch's own SDPA (GPU + torch only)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytestmark_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_gradients_match_torch_sdpa(dtype, tol, causal):
    from flashgen.errors import UnsupportedError
    from flashgen.torch import attention

    torch.manual_seed(0)
    B, M, N, H, K = 2, 300, 300, 4, 64
    q, k, v = (torch.randn(B, S, H, K, device="cuda", dtype=dtype, requires_grad=True) for S in (M, N, N))
    bias = torch.randn(1, H, M, N, device="cuda", dtype=dtype, requires_grad=True)
    try:
        out = attention(q, k, v, bias, causal=causal)
    except UnsupportedError as e:
        pytest.skip(f"no kernels for this GPU: {e}")
    do = torch.randn_like(out)
    out.backward(do)
    mine = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    mask = bias
    if causal:
        keep = torch.ones(M, N, device="cuda", dtype=torch.bool).tril()
        mask = bias.masked_fill(~keep, float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    ref.backward(do)
    theirs = [t.grad for t in (q, k, v, bias)]
    err = lambda a, b: float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())  # noqa: E731
    assert err(out, ref) < tol
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), mine, theirs):
        assert a.shape == b.shape and err(a, b) < 2 * tol, name


@pytestmark_gpu
@pytest.mark.gpu
def test_runs_on_torchs_current_stream():
    from flashgen.torch import attention

    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = attention(q, q, q)
    side.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3).transpose(1, 2)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-3
