"""fuse_rmsnorm, fuse_swiglu and fuse_rope: fire on the forms models write, do not fire
where they must not, and preserve the computed function."""

import pytest
import torch
import torch.nn.functional as F

from metainfer.kernels.rope import rotate_half
from metainfer.testing import assert_graphs_equivalent, capture_graph, count_calls, fresh_like, run_pass

mi = torch.ops.metainfer


def apply(name, fn, *inputs, expect=None):
    """Run pass `name` on fn's graph, check equivalence; `expect` (op, n): the graph after holds n
    calls of op and the pass says it matched n times (n counted by hand from fn)."""
    gm, args = capture_graph(fn, *inputs)
    after, rec = run_pass(name, gm)
    assert_graphs_equivalent(gm, after, fresh_like(args))
    if expect is not None:
        op, n = expect
        assert count_calls(gm, op) == 0 and count_calls(after, op) == n and rec.matches == n
    return rec, after


# ---- RMSNorm -----------------------------------------------------------------------------

def llama_norm(x, w, eps=1e-6):
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def gemma_norm(x, w, eps=1e-6):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


def sqrt_div_norm(x, w, eps=1e-5):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm, offset", [(llama_norm, 0.0), (gemma_norm, 1.0), (sqrt_div_norm, 0.0)])
def test_rmsnorm_forms(norm, offset, dtype):
    x, w = torch.randn(2, 5, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    rec, after = apply("fuse_rmsnorm", norm, x, w, expect=(mi.rmsnorm.default, 1))
    assert rec.matches == 1
    (node,) = [n for n in after.graph.nodes if n.target is mi.rmsnorm.default]
    assert node.args[3] == offset and node.args[4] == dtype


def test_llama_norm_whose_upcast_is_read_elsewhere():
    def f(x, w):  # the float32 upcast also feeds another node: it stays, the op reads it
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * normed.to(x.dtype), xf.sum()

    rec, after = apply("fuse_rmsnorm", f, torch.randn(2, 5, 64, dtype=torch.bfloat16),
                       torch.randn(64, dtype=torch.bfloat16), expect=(mi.rmsnorm.default, 1))
    (node,) = [n for n in after.graph.nodes if n.target is mi.rmsnorm.default]
    assert rec.matches == 1 and node.args[0].meta["val"].dtype == torch.float32 and node.args[4] == torch.bfloat16


def test_residual_add_is_fused_and_sum_is_reused():
    def f(x, r, w):
        h = x + r
        return llama_norm(h, w), h * 2  # the residual stream reads h too

    rec, after = apply("fuse_rmsnorm", f, torch.randn(2, 4, 32), torch.randn(2, 4, 32), torch.randn(32),
                       expect=(mi.add_rmsnorm.default, 1))
    assert rec.matches == 1 and "add+rmsnorm" in rec.decisions[0]
    assert count_calls(after, torch.ops.aten.add) == 0, "the add now happens inside the op"


def test_broadcast_add_is_not_a_residual():
    def f(x, bias, w):
        return llama_norm(x + bias, w)

    rec, after = apply("fuse_rmsnorm", f, torch.randn(2, 4, 32), torch.randn(32), torch.randn(32),
                       expect=(mi.rmsnorm.default, 1))
    assert rec.matches == 1 and count_calls(after, mi.add_rmsnorm.default) == 0


def test_rmsnorm_not_fused_when_intermediate_is_reused():
    def f(x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * w, var

    rec, _ = apply("fuse_rmsnorm", f, torch.randn(3, 16), torch.randn(16))
    assert rec.matches == 0 and "also used" in rec.near_misses[0]


def test_rms_of_a_centered_input_fuses_and_an_unweighted_norm_does_not():
    def centered(x, w):  # LayerNorm-like, but still the RMS form over xc
        xc = x - x.mean(-1, keepdim=True)
        return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def unweighted(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) + w

    for f in (centered, unweighted):
        rec, _ = apply("fuse_rmsnorm", f, torch.randn(3, 16), torch.randn(16))
        assert rec.matches == (1 if f is centered else 0)


def test_rmsnorm_weight_of_wrong_size_not_fused():
    def f(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    rec, _ = apply("fuse_rmsnorm", f, torch.randn(3, 16), torch.randn(3, 1))
    assert rec.matches == 0


# ---- SwiGLU ------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["F.silu", "x*sigmoid", "fused_gate_up_chunk", "bf16"])
def test_swiglu_forms(form):
    dtype = torch.bfloat16 if form == "bf16" else torch.float32

    def f(x, wg, wu):
        if form == "fused_gate_up_chunk":
            g, u = (x @ torch.cat([wg, wu], 0).t()).chunk(2, dim=-1)
        else:
            g, u = x @ wg.t(), x @ wu.t()
        if form == "x*sigmoid":
            return g * torch.sigmoid(g) * u
        return F.silu(g) * u

    rec, _ = apply("fuse_swiglu", f, torch.randn(2, 3, 16, dtype=dtype), torch.randn(24, 16, dtype=dtype),
                   torch.randn(24, 16, dtype=dtype), expect=(mi.swiglu.default, 1))
    assert rec.matches == 1


def test_swiglu_not_fused_on_broadcast_or_reused_silu():
    def bcast(g, u):
        return F.silu(g) * u

    def reused(g, u):
        s = F.silu(g)
        return s * u, s.sum()

    rec, _ = apply("fuse_swiglu", bcast, torch.randn(4, 8), torch.randn(8))
    assert rec.matches == 0 and "broadcast" in rec.near_misses[0]
    rec, _ = apply("fuse_swiglu", reused, torch.randn(4, 8), torch.randn(4, 8))
    assert rec.matches == 0


def test_gelu_gate_is_not_swiglu():
    def f(g, u):
        return F.gelu(g) * u

    rec, _ = apply("fuse_swiglu", f, torch.randn(4, 8), torch.randn(4, 8))
    assert rec.matches == 0 and not rec.near_misses


# ---- RoPE --------------------------------------------------------------------------------

def rotate_half_slices(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("rot", [rotate_half_slices, rotate_half], ids=["slices", "chunk"])
@pytest.mark.parametrize("order", ["x*cos+rot*sin", "sin*rot+cos*x"])
def test_rope_forms(rot, order):
    def f(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if order == "x*cos+rot*sin":
            return q * cos + rot(q) * sin, k * cos + rot(k) * sin
        return sin * rot(q) + cos * q, sin * rot(k) + cos * k

    q = torch.randn(2, 5, 8, 16).transpose(1, 2)  # (B, H, S, D) from a (B, S, H, D) projection
    k = torch.randn(2, 5, 2, 16).transpose(1, 2)
    rec, _ = apply("fuse_rope", f, q, k, torch.randn(2, 5, 16), torch.randn(2, 5, 16), expect=(mi.rope.default, 2))
    assert rec.matches == 2


def test_rope_not_fused_on_wrong_rotation():
    def swapped(x, cos, sin):  # cat(x2, -x1): rotates the other way
        h = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., h:], -x[..., :h]), -1) * sin

    def other_tensor(x, y, cos, sin):  # rotate_half of a different tensor
        return x * cos + rotate_half(y) * sin

    rec, _ = apply("fuse_rope", swapped, torch.randn(2, 8), torch.randn(8), torch.randn(8))
    assert rec.matches == 0
    rec, _ = apply("fuse_rope", other_tensor, torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(8))
    assert rec.matches == 0


def test_rope_not_fused_when_cos_broadcasts_x_or_is_float64():
    def f(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    rec, _ = apply("fuse_rope", f, torch.randn(5, 8), torch.randn(3, 5, 8), torch.randn(3, 5, 8))
    assert rec.matches == 0 and "not fused" in rec.near_misses[0]
    rec, _ = apply("fuse_rope", f, torch.randn(5, 8), torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8))
    assert rec.matches == 0 and "dtype" in rec.near_misses[0]


# ---- GeGLU (docs/adding-a-pass.md's worked example) ---------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_fires_on_gemmas_mlp(dtype):
    def mlp(x, wg, wu, wd):  # Gemma: down(gelu_pytorch_tanh(gate(x)) * up(x))
        return (F.gelu(x @ wg.t(), approximate="tanh") * (x @ wu.t())) @ wd.t()

    x, wg, wu, wd = (torch.randn(*s, dtype=dtype) for s in ((2, 3, 16), (24, 16), (24, 16), (16, 24)))
    rec, _ = apply("fuse_geglu", mlp, x, wg, wu, wd, expect=(mi.geglu.default, 1))
    assert rec.matches == 1 and "geglu" in rec.decisions[0]


def test_geglu_does_not_fire_on_exact_gelu_or_broadcast():
    exact, _ = apply("fuse_geglu", lambda g, u: F.gelu(g) * u, torch.randn(4, 8), torch.randn(4, 8))
    assert exact.matches == 0 and not exact.near_misses  # erf GeLU: another function, no tanh to anchor on
    bcast, _ = apply("fuse_geglu", lambda g, u: F.gelu(g, approximate="tanh") * u, torch.randn(4, 8), torch.randn(8))
    assert bcast.matches == 0 and "broadcast" in bcast.near_misses[0]


def test_geglu_on_hugging_face_gemma():
    from metainfer.testing import tiny_hf_model

    model = tiny_hf_model("Gemma", hidden_activation="gelu_pytorch_tanh")
    ids = torch.randint(3, 100, (2, 8))
    rec, after = apply("fuse_geglu", model, ids, expect=(mi.geglu.default, model.config.num_hidden_layers))
    assert rec.matches == model.config.num_hidden_layers
