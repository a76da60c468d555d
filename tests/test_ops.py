"""metainfer's custom ops: schema and fake implementations agree with the real ones
(torch.library.opcheck), and each op dispatches to its kernel as documented."""

import pytest
import torch

import metainfer.kernels.ops  # noqa: F401
from metainfer import kernels

m = torch.ops.metainfer


def cases():
    q = torch.randn(2, 4, 5, 16).transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous
    k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 8)
    x, w, r = torch.randn(3, 5, 32), torch.randn(32), torch.randn(3, 5, 32)
    gu = torch.randn(3, 2 * 24)
    return [
        (m.attention.default, (q, k, v, None, 0.25, True, 2, False)),
        (m.attention.default, (q, k, v, torch.randn(2, 1, 5, 7), 0.25, False, 0, True)),
        (m.rmsnorm.default, (x, w, 1e-6, 0.0, torch.float32)),
        (m.rmsnorm.default, (x.bfloat16(), w.bfloat16(), 1e-6, 1.0, torch.float32)),
        (m.add_rmsnorm.default, (x, r, w, 1e-5, 0.0, torch.float32)),
        (m.swiglu.default, (gu[:, :24], gu[:, 24:])),
        (m.geglu.default, (gu[:, :24], gu[:, 24:])),
        (m.rope.default, (q, torch.randn(5, 16), torch.randn(1, 1, 5, 16))),
        *deepseek_cases(),
    ]


def int4_weights(n: int, k: int, group: int, symmetric: bool):
    from metainfer.kernels.int4_gemm import quantize_weight

    return quantize_weight(torch.randn(n, k), group, symmetric=symmetric)


def deepseek_cases():
    """Inputs drawn from a fixed seed (cases are built at collection, whatever ran before), weights
    scaled so outputs are O(1) and the fp32 comparison is about rounding, not magnitude."""
    from metainfer.kernels.fp8_gemm import quantize_activations, quantize_weight

    torch.manual_seed(0)
    wq, ws = quantize_weight(torch.randn(40, 48), 16, 32)
    x = torch.randn(3, 5, 48)
    E, H, I = 4, 24, 16
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(6)])
    gate_up = torch.randn(E, 2 * I, H) * H ** -0.5
    q, k, v = torch.randn(2, 4, 5, 24), torch.randn(2, 2, 9, 24), torch.randn(2, 2, 9, 12)
    idx = torch.randn(2, 5, 9).topk(3, dim=-1)[1]
    mask = torch.randn(2, 1, 5, 9).masked_fill(torch.rand(2, 1, 5, 9) < 0.5, torch.finfo(torch.float32).min)
    return [
        (m.fp8_linear.default, (x, wq, ws, torch.randn(40), 16, 32, False)),
        (m.fp8_linear.default, (x.bfloat16(), wq, ws, None, 16, 32, True)),
        (m.fp8_quantize_activations.default, (x.bfloat16(), 32)),
        (m.fp8_linear_quantized.default, (x.bfloat16(), *quantize_activations(x.bfloat16(), 32), wq, ws, None, 16, 32)),
        (m.int4_linear.default, (x, *int4_weights(40, 48, 16, symmetric=False), None, torch.randn(40), 16)),
        (m.int4_linear.default, (x.bfloat16(), *int4_weights(40, 48, 16, symmetric=True), torch.randperm(48), None,
                                 16)),
        (m.moe_experts.default, (torch.randn(6, H), ids, torch.rand(6, 2), gate_up[:, :I], gate_up[:, I:],
                                 torch.randn(E, H, I) * I ** -0.5, None, None, None, 128, 128)),
        (m.sparse_attention.default, (q, k, v, idx, None, 0.3, True, 4, False, float("-inf"))),
        (m.sparse_attention.default, (q, k, v, idx, mask, 0.3, False, 0, False, torch.finfo(torch.float32).min)),
        (m.mla_decode.default, (torch.randn(2, 4, 1, 32), torch.randn(2, 4, 1, 8), torch.randn(2, 9, 32),
                                torch.randn(2, 9, 8), None, None, 0.2, True, 8, False)),
        (m.mla_decode.default, (torch.randn(2, 4, 5, 32), torch.randn(2, 4, 5, 8), torch.randn(2, 9, 32),
                                torch.randn(2, 9, 8), idx, None, 0.2, False, 0, False)),
        # serving, keys given in cu_k order (MLA): two requests of 3 and 1 query tokens over 5 and 4 keys
        (m.paged_attention.default, (torch.randn(4, 4, 24), torch.randn(9, 2, 24), torch.randn(9, 2, 12), None, None,
                                     torch.tensor([0, 3, 4], dtype=torch.int32),
                                     torch.tensor([0, 5, 9], dtype=torch.int32), 3, 5, 0, 0.2)),
    ]


@pytest.mark.parametrize("op, args", cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_opcheck(op, args):
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    # test_schema perturbs every input with a multiply, which float8 tensors do not implement on CPU
    utils = ("test_faketensor", "test_aot_dispatch_static") if fp8 else (
        "test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(op, args, test_utils=utils)


@pytest.mark.parametrize("op, args", cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_outputs_contiguous_and_match_interpreted_kernels(op, args, interpret):
    with kernels.interpret(False):
        cpu = op(*args)
    triton = op(*args)
    # the ops are not custom_op's (kernels/ops.py): nothing checks aliasing at run time, so here
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (cpu, triton))):
        assert a.untyped_storage().data_ptr() not in inputs and b.untyped_storage().data_ptr() not in inputs
        assert a.is_contiguous() and b.is_contiguous()
        if a.dtype == torch.float8_e4m3fn:  # (assert_close has no float8 on CPU)
            a, b = a.float(), b.float()
        tol = 1e-5 if a.dtype == torch.float32 else 2e-2  # one rounding to bf16 may differ by an ulp
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, equal_nan=True)


def test_serving_ops_write_the_active_pool_and_read_it_back(interpret):
    """paged_attention / paged_latents write the new rows into the pool of the serving step on
    this thread (kernels/kv_pool.py) and read each request's rows there; opcheck in that step."""
    from metainfer.kernels import paged_attention as P
    from metainfer.kernels import kv_pool

    k_pool, v_pool = torch.zeros(12, 2, 16), torch.zeros(12, 2, 16)
    k_pool[:5], v_pool[:5] = torch.randn(5, 2, 16), torch.randn(5, 2, 16)  # request 0's 5 cached keys
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    write = torch.tensor([5, 9, 6])  # request 0 decodes 1 token (row 5), request 1 prefills 2 (rows 9, 6)
    read = torch.tensor([0, 1, 2, 3, 4, 5, 9, 6])
    cu_q, cu_k = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 6, 8], dtype=torch.int32)
    with kv_pool.active(lambda layer: (k_pool, v_pool)):
        args = (q, k, v, write, read, cu_q, cu_k, 2, 6, 0, 0.25)
        torch.library.opcheck(m.paged_attention.default, args, test_utils=("test_faketensor", "test_aot_dispatch_static"))
        out = m.paged_attention(*args)
        assert torch.equal(k_pool[write], k) and torch.equal(v_pool[write], v)
        torch.testing.assert_close(out, P.reference(q, k_pool, v_pool, read, cu_q, cu_k, 0.25))
        with kernels.interpret(False):
            torch.testing.assert_close(m.paged_attention(*args), out)
        lat, rot = torch.zeros(12, 8), torch.zeros(12, 4)
    with kv_pool.active(lambda layer: (lat, rot)):
        new_lat, new_rot = torch.randn(3, 8), torch.randn(3, 4)
        all_lat, all_rot = m.paged_latents(new_lat, new_rot, write, read, 1)
        assert torch.equal(all_lat, lat[read]) and torch.equal(lat[write], new_lat) and torch.equal(rot[write], new_rot)
        fresh = m.paged_latents(new_lat, new_rot, write, read[:0], 1)  # nothing cached: the new rows as they are
        assert torch.equal(fresh[0], new_lat) and torch.equal(fresh[1], new_rot)


def test_a_ring_buffer_is_read_before_it_is_written():
    """A sliding-window layer's pool (transformers' ring buffer): the read index lists each
    request's cached rows, then the sentinel row for each new token; the new keys go to rows
    the step still reads (overwriting the oldest), so the op reads first. Request 0 holds 3 keys
    in rows 4, 5, 6 of a 3-slot ring and decodes one token, written to row 4 (its oldest)."""
    from metainfer.kernels import paged_attention as P
    from metainfer.kernels import kv_pool

    sentinel = 1
    k_pool, v_pool = torch.randn(8, 1, 4), torch.randn(8, 1, 4)
    old_k, old_v = k_pool[4:7].clone(), v_pool[4:7].clone()
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    read, write = torch.tensor([4, 5, 6, sentinel]), torch.tensor([4])
    cu_q, cu_k = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    with kv_pool.active(lambda layer: (k_pool, v_pool)):
        out = m.paged_attention(q, k, v, write, read, cu_q, cu_k, 1, 4, 0, 0.5, 3, 0.0, sentinel)
    assert torch.equal(k_pool[4], k[0]) and torch.equal(v_pool[4], v[0]), "the new key is in the pool after"
    keys, values = torch.cat([old_k, k]), torch.cat([old_v, v])  # what the step reads: old keys, then the new
    ref = P.reference(q, keys, values, None, cu_q, cu_k, 0.5, 3)  # window 3: the last 2 old keys and the new one
    torch.testing.assert_close(out, ref)
