"""flashgen.torch without a GPU: the operators' fake implementations (what torch.compile traces
with) and the argument checks that run before any GPU work."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
FakeTensorMode = pytest.importorskip("torch._subclasses.fake_tensor").FakeTensorMode

import flashgen.torch as ft  # noqa: E402
from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.torch import ops  # noqa: E402

OPTIONS = dict(causal=1, scale=None, dropout_p=0.0, seed=0, offset=0, window_left=-1, window_right=-1, softcap=0.0,
               deterministic=False)


NO_MOD = ("", "", [])  # the operators' score_mod, mod_names, mod_tensors


def forward_fake(q, k, v, cu_q=None, cu_k=None, max_seqlen_q=0, bias=None):
    return torch.ops.flashgen.attention_forward(q, k, v, bias, cu_q, cu_k, max_seqlen_q, *OPTIONS.values(), *NO_MOD)


@pytest.mark.parametrize("M,N,H,Hk,K,Kv", [(1, 1, 1, 1, 8, 8), (7, 129, 4, 4, 64, 32), (1000, 7, 8, 2, 128, 128),
                                           (129, 1000, 16, 2, 256, 256)])
def test_forward_fake_has_the_real_shapes_and_strides(M, N, H, Hk, K, Kv):
    """out is a contiguous [B, M, H, Kv]; lse [B, H, M] lies in rows padded to 32, as the kernels
    write it (the real implementation returns exactly that layout, test_torch_gpu checks)."""
    with FakeTensorMode():
        q = torch.empty(2, M, H, K, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, N, Hk, K, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(2, N, Hk, Kv, device="cuda", dtype=torch.bfloat16)
        out, lse = forward_fake(q, k, v)
    padded = -(-M // 32) * 32
    assert (out.shape, out.stride(), out.dtype) == ((2, M, H, Kv), (M * H * Kv, H * Kv, Kv, 1), torch.bfloat16)
    assert (lse.shape, lse.stride(), lse.dtype) == ((2, H, M), (H * padded, padded, 1), torch.float32)


def test_forward_fake_for_packed_sequences_sizes_lse_by_max_seqlen_q():
    with FakeTensorMode():
        q = torch.empty(1, 300, 4, 64, device="cuda", dtype=torch.float16)
        cu = torch.empty(6, device="cuda", dtype=torch.int32)  # 5 sequences
        out, lse = forward_fake(q, q, q, cu, cu, max_seqlen_q=100)
    assert out.shape == (1, 300, 4, 64)
    assert (lse.shape, lse.stride()) == ((5, 4, 100), (4 * 128, 128, 1))


@pytest.mark.parametrize("longest,rows", [(90, 130), (1, 7), (100, 128), (33, 1000)])
def test_a_packed_lse_shorter_than_max_seqlen_q_is_padded_into_the_promised_layout(longest, rows):
    """The runtime's lse covers the longest sequence; the op promises max_seqlen_q rows in rows padded
    to 32, the pad (and rows past the longest) +inf -- also past the last head, where an allocation
    sized for ``rows`` alone would end."""
    lse = torch.randn(3, 4, longest)
    fixed = ops._with_lse_layout(lse, 4, rows)
    padded = -(-rows // 32) * 32
    assert (fixed.shape, fixed.stride()) == ((3, 4, rows), (4 * padded, padded, 1))
    assert torch.equal(fixed[:, :, :longest], lse)
    whole = fixed.as_strided((3, 4, padded), fixed.stride())
    assert bool((whole[:, :, longest:] == float("inf")).all())


@pytest.mark.parametrize("bias_grad,bias_shape,dbias_shape", [
    (False, (1, 8, 33, 65), (0,)),
    (True, (1, 8, 33, 65), (1, 8, 33, 65)),    # summed over the batch, as the runtime returns it
    (True, (2, 8, 33, 65), (2, 8, 33, 65)),
    (True, (2, 1, 1, 65), (2, 1, 33, 65)),     # over the heads; a broadcast query dim stays whole
    (True, (33, 65), (1, 1, 33, 65)),
])
def test_backward_fake_returns_contiguous_gradients_shaped_like_the_inputs(bias_grad, bias_shape, dbias_shape):
    with FakeTensorMode():
        q = torch.empty(2, 33, 8, 64, device="cuda", dtype=torch.float16)
        k = torch.empty(2, 65, 2, 64, device="cuda", dtype=torch.float16)
        v = torch.empty(2, 65, 2, 32, device="cuda", dtype=torch.float16)
        bias = torch.empty(bias_shape, device="cuda", dtype=torch.float16)
        out, lse = forward_fake(q, k, v, bias=bias)
        options = dict(OPTIONS)
        del options["deterministic"]
        grads = torch.ops.flashgen.attention_backward(out, q, k, v, out, lse, bias, bias_grad, None, None,
                                                      *options.values(), False, *NO_MOD)
    assert [tuple(g.shape) for g in grads[:3]] == [(2, 33, 8, 64), (2, 65, 2, 64), (2, 65, 2, 32)]
    assert all(g.is_contiguous() for g in grads)
    assert tuple(grads[3].shape) == dbias_shape


def cpu_qkv(shape=(1, 8, 2, 64)):
    return tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(3))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(causal="yes"), ValueError, "causal must be None, 'top_left' or 'bottom_right'"),
    (dict(causal=1), ValueError, "causal must be"),
    (dict(window=5), TypeError, r"window must be \(left, right\)"),
    (dict(window=(-1, 2)), ValueError, "window sides must be ints >= 0 or None"),
    (dict(window=(1.5, None)), ValueError, "window sides"),
    (dict(deterministic="yes"), TypeError, "deterministic must be True or False"),
    (dict(dropout_p=0.1, seed=2**63), ValueError, r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed must be"),
])
def test_bad_options_are_refused_before_any_gpu_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        ft.attention(*cpu_qkv(), **kwargs)


def test_cpu_tensors_are_refused_with_what_to_do():
    q, k, v = cpu_qkv()
    with pytest.raises(TypeError, match=r"^q is on cpu, not a CUDA tensor: .*\.cuda\(\)"):
        ft.attention(q, k, v)
    with pytest.raises(TypeError, match=r"^q is a ndarray, not a CUDA tensor"):
        ft.attention(q.numpy(), k, v)


def test_sdpa_drop_in_checks_like_torch():
    q = torch.zeros(1, 8, 4, 64, dtype=torch.float16)  # [B, H, L, E]
    k = torch.zeros(1, 2, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ft.scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="attn_mask or is_causal, not both"):
        ft.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="4-D"):
        ft.scaled_dot_product_attention(q[0], q[0], q[0])


def test_varlen_takes_packed_3d_tensors_and_a_positive_max_seqlen():
    q = torch.zeros(10, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be 3-D \[total, heads, head_dim\]"):
        ft.attention_varlen(q[None], q, q, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_q must be a positive int"):
        ft.attention_varlen(q, q, q, cu, cu, 0, 6)


def test_varlen_offsets_that_are_not_tensors_are_refused_naming_them():
    """A CuPy caller's PackedOffsets is pointed back at what flashgen.torch does instead; lists and
    NumPy arrays are named too (torch's dispatcher would only say it wanted a Tensor)."""
    from flashgen.runtime.packed import PackedOffsets

    q = torch.zeros(10, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    packed = PackedOffsets(None, cu.numpy(), 0)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q must be an int32 CUDA tensor; got a PackedOffsets; "
                                        r"flashgen.packed_offsets is for the CuPy API"):
        ft.attention_varlen(q, q, q, packed, cu, 6, 6)
    with pytest.raises(TypeError, match=r"^cu_seqlens_k must be an int32 CUDA tensor; got a list$"):
        ft.attention_varlen(q, q, q, cu, [0, 4, 10], 6, 6)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q must be an int32 CUDA tensor; got a ndarray$"):
        ft.attention_varlen(q, q, q, cu.numpy(), cu, 6, 6)


def test_window_and_causal_reach_the_runtime_as_its_options():
    assert ops._runtime_options(2, 0.5, 0.0, 7, 3, 4, -1, 2.0) == dict(
        causal="bottom_right", scale=0.5, dropout_p=0.0, seed=None, offset=3, window=(4, None), softcap=2.0)
    assert ops._runtime_options(0, None, 0.1, 7, 0, -1, -1, 0.0)["window"] is None
    assert ops._runtime_options(0, None, 0.1, 7, 0, -1, -1, 0.0)["seed"] == 7


def test_a_block_mask_reaches_the_runtime_forward_and_backward_eagerly(monkeypatch):
    """The eager autograd.Function carries the mask (no operator schema can) to both directions."""
    from flashgen.runtime.block_masks import block_mask

    bm = block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 5, 5, device="cpu")
    seen = {}

    def forward(q, k, v, **options):
        seen["forward"] = options["block_mask"]
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(grad_out, q, k, v, out, lse, **options):
        seen["backward"] = options["block_mask"]
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(ops.api, "attention_forward", forward)
    monkeypatch.setattr(ops.api, "attention_backward", backward)
    q, k, v = (torch.zeros(1, 5, 2, 8, requires_grad=True) for _ in range(3))
    out, _ = ops.forward(q, k, v, None, None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0, False, block_mask=bm)
    out.sum().backward()
    assert seen == {"forward": bm, "backward": bm}
    assert (q.grad == 1).all() and (v.grad == 1).all()


def test_a_block_mask_under_torch_compile_is_refused_with_what_to_do(monkeypatch):

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(UnsupportedError, match=r"^flashgen.torch: block_mask under torch.compile is not supported yet "
                                               r".*call this attention eagerly"):
        ops.forward(None, None, None, None, None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0, False, block_mask=object())


def test_a_score_mod_reaches_the_runtime_forward_and_backward_eagerly_without_plans(monkeypatch):
    """The eager autograd.Function carries the mod and its captured tensors to both directions, and
    its forward takes no shortcut plan (score-mod calls take none)."""
    slope = torch.ones(2)
    seen = {}

    def forward(q, k, v, **options):
        seen["forward"] = (options["score_mod"], options["mod_tensors"])
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(grad_out, q, k, v, out, lse, **options):
        seen["backward"] = (options["score_mod"], options["mod_tensors"])
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(ops.api, "attention_forward", forward)
    monkeypatch.setattr(ops.api, "attention_backward", backward)
    monkeypatch.setattr(ops, "_shortcut_key", lambda *a: pytest.fail("a score-mod call looked for a plan"))
    q, k, v = (torch.zeros(1, 5, 2, 8, requires_grad=True) for _ in range(3))
    out, _ = ops.forward(q, k, v, None, None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0, False,
                         mods=("alibi", {"slope": slope}))
    out.sum().backward()
    assert seen == {"forward": ("alibi", {"slope": slope}), "backward": ("alibi", {"slope": slope})}
    assert (k.grad == 1).all()


def test_under_torch_compile_a_score_mod_reaches_both_operators_by_name_with_its_tensors_sorted(monkeypatch):
    """The traced forward passes the mod's name, its tensors' names (one string) and the tensors in
    that order; autograd saves the tensors and hands the backward operator the same three."""
    seen = {}

    def forward_op(q, k, v, bias, *rest):
        seen["forward"] = rest[-3:]
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward_op(grad_out, q, k, v, out, lse, *rest):
        seen["backward"] = rest[-3:]
        return [torch.ones_like(q), torch.ones_like(k), torch.ones_like(v), q.new_empty((0,))]

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(ops, "attention_forward", forward_op)
    slope, bias = torch.ones(2), torch.zeros(3)
    out, lse = ops.forward(torch.zeros(1, 5, 2, 8), None, None, None, None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0,
                           False, mods=("alibi", {"slope": slope, "bias": bias}))
    name, names, tensors = seen["forward"]
    assert (name, names) == ("alibi", "bias,slope") and tensors[0] is bias and tensors[1] is slope

    class Ctx:  # what the operator's setup_context and autograd formula see
        needs_input_grad = (True, True, True, False)

        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

        def mark_non_differentiable(self, *tensors):
            pass

    q, k, v = torch.zeros(1, 5, 2, 8), torch.zeros(1, 6, 1, 8), torch.zeros(1, 6, 1, 8)
    options = (None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0, False)
    ctx = Ctx()
    ops._setup_context(ctx, (q, k, v, None, *options, name, names, tensors), (out, lse))
    monkeypatch.setattr(ops, "attention_backward", backward_op)
    grads = ops._operator_gradients(ctx, torch.ones_like(q), None)
    assert seen["backward"][:2] == ("alibi", "bias,slope") and list(seen["backward"][2]) == [bias, slope]
    # one gradient per input in the inputs' structure: none for the options, a list of None for the tensors
    assert len(grads) == 4 + len(options) + 3 and (grads[1] == 1).all() and grads[3] is None
    assert grads[4:-1] == (None,) * (len(options) + 2) and grads[-1] == [None, None]


@pytest.mark.parametrize("mods,error,match", [
    (("alibi", {"slope": torch.ones(2, requires_grad=True)}), UnsupportedError,
     r"mod_tensors\['slope'\] requires grad, but gradients into captured tensors are not computed"),
    ((object(), {}), UnsupportedError, r"under torch.compile a score mod goes by its name"),
    (("alibi", [torch.ones(2)]), TypeError, r"mod_tensors must be a dict"),
    (("alibi", {"slope": [1.0]}), TypeError, r"mod_tensors\['slope'\] is a list"),
    (("alibi", {"a,b": torch.ones(2)}), ValueError, r"mod_tensors key 'a,b' is not a name"),
])
def test_under_torch_compile_what_a_traced_score_mod_cannot_carry_is_refused_before_tracing(monkeypatch, mods,
                                                                                           error, match):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(ops, "attention_forward", lambda *a: pytest.fail("a refused call reached the operator"))
    with pytest.raises(error, match=match):
        ops.forward(None, None, None, None, None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0, False, mods=mods)


def test_a_backward_replays_the_follower_of_its_forwards_plan(monkeypatch):
    """Step 1 (forward replayed plan F): the backward takes the runtime's path and F keeps the plan
    that path served as its follower for grad_out's strides and alignment; step 2 replays it with
    the step's own tensors, without the runtime's lookup."""
    from types import SimpleNamespace

    forward_plan, backward_plan = SimpleNamespace(followers={}), object()
    served = {"plan": forward_plan}
    calls = []

    def forward(q, k, v, **options):
        served["plan"] = forward_plan
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(grad_out, q, k, v, out, lse, **options):
        calls.append("runtime")
        served["plan"] = backward_plan
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    def replay(plan, memory, arrays, seed, offset, stream):
        calls.append(("replay", plan, len(arrays), seed, offset))
        return tuple(torch.full_like(x, 2.0) for x in arrays[1:4])

    monkeypatch.setattr(ops.api, "attention_forward", forward)
    monkeypatch.setattr(ops.api, "attention_backward", backward)
    monkeypatch.setattr(ops.plans, "served", lambda: served["plan"])
    monkeypatch.setattr(ops.families, "replay", replay)
    monkeypatch.setattr(ops, "memory_for", lambda q, cupy: "memory")
    monkeypatch.setattr(ops, "cupy_module", lambda: None)
    q, k, v = (torch.zeros(1, 5, 2, 8, requires_grad=True) for _ in range(3))
    grads = []
    for _ in range(2):
        out, _ = ops.forward(q, k, v, None, None, None, 0, 1, None, 0.1, 9, 4, -1, -1, 0.0, False)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    assert calls == ["runtime", ("replay", backward_plan, 6, 9, 4)]
    assert list(forward_plan.followers.values()) == [backward_plan]
    assert all((g == 1).all() for g in grads[0]) and all((g == 2).all() for g in grads[1])


@pytest.mark.parametrize("active", [False, True])
def test_functorch_transforms_take_function_apply(monkeypatch, active):
    """Eager calls go to torch's C apply, except under functorch transforms, which need Function.apply's
    own routing."""
    seen = []
    monkeypatch.setattr(ops, "_transforms_active", lambda: active)
    monkeypatch.setattr(ops, "_apply", lambda *args: seen.append("C apply") or ("out", "lse"))
    monkeypatch.setattr(ops.EagerAttention, "apply", lambda *args: seen.append("Function.apply") or ("out", "lse"))
    assert ops.forward(None, None, None, None, None, None, 0, 1, None, 0.0, 0, 0, -1, -1, 0.0, False) == ("out", "lse")
    assert seen == ["Function.apply" if active else "C apply"]


def test_an_eager_forward_replays_its_plan_under_the_adapters_own_key(monkeypatch):
    """Once api's path has replayed a plan for a forward, later forwards with the same tensors'
    signature and options replay it under the adapter's key, each with its own seed and offset;
    another family setting, registry or option is another key (api's path again), and a bad
    offset is still refused."""
    from types import SimpleNamespace

    from flashgen.runtime import plans, registry

    plans.clear()
    plan = SimpleNamespace(followers={})
    calls = []

    def forward(q, k, v, **options):
        calls.append(("api", options["dropout_p"]))
        plans.note_served(plan if len(calls) > 1 else None)  # the first call takes the full path
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def replay(made, memory, arrays, seed, offset, stream):
        calls.append(("replay", made, len(arrays), seed, offset))
        return torch.ones_like(arrays[0]), torch.zeros(1)

    monkeypatch.setattr(ops.api, "attention_forward", forward)
    monkeypatch.setattr(ops.plans, "tensor_signature", lambda arrays, tensor: tuple(x.shape for x in arrays))
    monkeypatch.setattr(ops.families, "replay", replay)
    monkeypatch.setattr(ops, "memory_for", lambda q, cupy: "memory")
    monkeypatch.setattr(ops, "cupy_module", lambda: None)
    monkeypatch.delenv(plans.FAMILIES_VARIABLE, raising=False)
    q = torch.zeros(1, 5, 2, 8)

    def call(dropout_p=0.1, seed=9, offset=4):
        return ops.forward(q, q, q, None, None, None, 0, 1, None, dropout_p, seed, offset, -1, -1, 0.0, False)[0]

    call(), call()
    assert calls == [("api", 0.1), ("api", 0.1)]
    assert (call(seed=11, offset=6) == 1).all()
    assert calls[-1] == ("replay", plan, 3, 11, 6)
    with pytest.raises(ValueError, match=r"offset must be an integer in \[0, 2\*\*64\); got -1"):
        call(offset=-1)
    call(dropout_p=0.2)
    assert calls[-1] == ("api", 0.2)
    monkeypatch.setenv(plans.FAMILIES_VARIABLE, "sm90_fwd")
    call()
    assert calls[-1] == ("api", 0.1)
    monkeypatch.delenv(plans.FAMILIES_VARIABLE)
    monkeypatch.setattr(ops, "default_registry", lambda: registry.Registry([]))
    call()
    assert calls[-1] == ("api", 0.1)
    monkeypatch.undo()
    plans.clear()
