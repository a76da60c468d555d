"""Int4 checkpoint formats read into the layout metainfer's kernel takes (models/quantized.py's
from_compressed_tensors, from_gptq, from_awq): tensors written as each format's own spec lays
them out (metainfer.checkpoint_writers; the specs in models/quantized.py) come back as the same
real weight, act-order checkpoints included; where compressed-tensors is installed, its own
packer writes the bytes our writer writes."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer.kernels.ops  # noqa: F401
from metainfer.kernels import int4_gemm as K
from metainfer.models import quantized as Q
from metainfer.checkpoint_writers import int4_as_awq, int4_as_compressed_tensors, int4_as_gptq


def _layer(N, Kd, group, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    G = math.ceil(Kd / group)
    q = torch.randint(0, 16, (N, Kd), generator=g)
    scales = (torch.rand(N, G, generator=g) + 0.1).to(torch.float16)
    zeros = None if symmetric else torch.randint(0, 16, (N, G), generator=g).to(torch.uint8)
    return q, scales, zeros


def _real(q, scales, zeros, group):
    """The real weight (N, K), the checkpoint's own column order, in float32."""
    z = zeros.float() if zeros is not None else torch.full(scales.shape, 8.0)
    G = scales.shape[1]
    cols = torch.arange(q.shape[1]) // group
    return (q.float() - z[:, cols]) * scales.float()[:, cols] if G else q.float()


def _layer_output(layout, x, group):
    qweight, scales, zeros, perm = layout
    return torch.ops.metainfer.int4_linear(x, qweight, scales, zeros, perm, None, group)


@settings(max_examples=25, deadline=None)
@given(N=st.sampled_from([8, 16, 40]), words=st.integers(1, 12), group=st.sampled_from([16, 32, 64]),
       symmetric=st.booleans(), act_order=st.booleans(), fmt=st.sampled_from(["ct", "gptq", "gptq_v2", "awq"]),
       seed=st.integers(0, 2**16))
def test_each_format_reads_back_the_real_weight(N, words, group, symmetric, act_order, fmt, seed):
    Kd = 8 * words * math.lcm(1, group // 8)  # whole groups: GPTQ's and AWQ's g_idx is k // group
    q, scales, zeros = _layer(N, Kd, group, symmetric, seed)
    if fmt == "gptq" and zeros is not None:  # v1 cannot store a zero point of 0 (it reads back 16, below)
        zeros = zeros.clamp(min=1)
    g_idx = None
    if act_order and fmt != "awq":  # the checkpoint's columns each in a group of their own choosing
        g_idx = torch.randperm(Kd, generator=torch.Generator().manual_seed(seed)) // group
        z = zeros.float() if zeros is not None else torch.full(scales.shape, 8.0)
        real = (q.float() - z[:, g_idx]) * scales.float()[:, g_idx]
    else:
        real = _real(q, scales, zeros, group)
    if fmt == "ct":
        t = int4_as_compressed_tensors(q, scales, zeros, g_idx)
        layout = Q.from_compressed_tensors(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                           t["weight_shape"], t.get("weight_g_idx"), group)
    elif fmt.startswith("gptq"):
        t = int4_as_gptq(q, scales, zeros, g_idx, v1=fmt == "gptq")
        layout = Q.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group,
                             zero_offset=1 if fmt == "gptq" else 0)
    else:
        t = int4_as_awq(q, scales, zeros)
        layout = Q.from_awq(t["qweight"], t["qzeros"], t["scales"], group)
    x = torch.randn(3, Kd, generator=torch.Generator().manual_seed(seed + 1))
    ref = x @ real.T
    assert torch.allclose(_layer_output(layout, x, group), ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())
    scattered = g_idx is not None and not torch.equal(g_idx, torch.arange(Kd) // group)
    assert (layout[3] is not None) == scattered  # act-order kept as one permutation, where it is one
    assert (layout[2] is None) == (symmetric or fmt == "ct" and zeros is None)


def test_gptq_v1_zero_points_of_zero_read_back_as_16_as_every_v1_reader_does():
    q, scales, _ = _layer(8, 64, 32, True, 0)
    zeros = torch.zeros(8, 2, dtype=torch.uint8)  # stored as 15 in v1 (0 - 1 in four bits)
    t = int4_as_gptq(q, scales, zeros)
    _, _, z, _ = Q.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32)
    assert z.tolist() == torch.full((8, 2), 16).tolist()  # AutoGPTQ's v1 reads back 15 + 1


def test_our_compressed_tensors_layout_is_the_librarys():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q, scales, zeros = _layer(24, 64, 32, False, 3)
    ours = int4_as_compressed_tensors(q, scales, zeros)
    signed = (q - 8).to(torch.int8)
    assert torch.equal(helpers.pack_to_int32(signed, 4), ours["weight_packed"])
    assert torch.equal(helpers.pack_to_int32((zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0),
                       ours["weight_zero_point"])
    back = helpers.unpack_from_int32(ours["weight_packed"], 4, torch.Size([24, 64]))
    assert torch.equal(back, signed)
