"""Configs that fit the GPU they launch on: the rows for wide heads and latents (their shared
memory is checked by tests/test_aot_compile.py), and the launchers' retry with a smaller config
when Triton refuses a launch for want of resources (which the interpreter never does, so the
refusal is injected here)."""

import pytest
from hypothesis import given, settings, strategies as st
import torch

from metainfer.kernels import _common
from metainfer.kernels import attention as A
from metainfer.kernels import mla_decode as MLA
from metainfer.kernels.configs import config_for_arch


def test_float32_wide_heads_get_rows_of_their_own():
    for arch in ("sm_80", "sm_89", "sm_90"):
        narrow = config_for_arch("attention", arch, head_dim=256, dtype=torch.bfloat16)
        for d in (192, 256):
            wide = config_for_arch("attention", arch, head_dim=d, dtype=torch.float32)
            assert wide["BLOCK_M"] * wide["BLOCK_N"] * wide["num_stages"] < \
                narrow["BLOCK_M"] * narrow["BLOCK_N"] * narrow["num_stages"], (arch, d)


def _mla_args(R, T=40, Sq=1):
    g = torch.Generator().manual_seed(1)
    B, H, P = 1, 4, 16
    return (torch.randn(B, H, Sq, R, generator=g), torch.randn(B, H, Sq, P, generator=g),
            torch.randn(B, T, R, generator=g), torch.randn(B, T, P, generator=g), None, None,
            (R + P) ** -0.5, True, T - Sq)


def _recording_blocks(monkeypatch, module, attr):
    """Record each launch's constexpr blocks and run it."""
    real = getattr(module, attr)
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append({k: kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N", "num_stages")})
                return real[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(module, attr, Spy())
    return seen


def test_mla_takes_its_wide_latent_blocks_above_max_r(interpret, monkeypatch):
    seen = _recording_blocks(monkeypatch, MLA, "_mla_fwd")
    cfg = {**config_for_arch("mla_decode", "interpreter"), "BLOCK_N": 32,
           "WIDE_R": {"MAX_R": 32, "BLOCK_N": 16, "num_stages": 1}}
    for R, block_n in ((32, 32), (64, 16)):
        args = _mla_args(R)
        torch.testing.assert_close(MLA.launch(*args, config=cfg), MLA.reference(*args), atol=2e-5, rtol=2e-5)
        assert seen[-1]["BLOCK_N"] == block_n
    assert config_for_arch("mla_decode", "sm_89")["WIDE_R"]["MAX_R"] == 512


def test_smaller_config_steps_down_to_the_least_tile():
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4, "AUTOTUNE": ({"BLOCK_M": 64},)}
    steps = []
    while cfg is not None:
        cfg = _common.smaller_config(cfg)
        steps.append(cfg and (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]))
    assert steps == [(32, 32, 1), (32, 16, 1), (16, 16, 1), None]


def _refusing(monkeypatch, most_shared):
    """attention's kernel refused, as Triton refuses it on a GPU, while BLOCK_M x BLOCK_N x stages
    is above `most_shared`; the launches tried are recorded."""
    from triton.runtime.errors import OutOfResources

    real = A._attention_fwd
    tried = []

    class Refusing:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                need = kwargs["BLOCK_M"] * kwargs["BLOCK_N"] * kwargs["num_stages"]
                tried.append((kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_stages"]))
                if need > most_shared:
                    raise OutOfResources(need, most_shared, "shared memory")
                return real[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(A, "_attention_fwd", Refusing())
    monkeypatch.setattr(_common, "_fitted", {})
    return tried


def test_a_refused_launch_is_retried_smaller_and_the_fit_remembered(interpret, monkeypatch):
    tried = _refusing(monkeypatch, most_shared=32 * 16)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    args = (q, k, v, None, 0.25, True, 0, False)
    cfg = {**config_for_arch("attention", "interpreter"), "BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2}
    with pytest.warns(UserWarning, match="attention: .*retrying with"):
        out = A.launch(*args, config=cfg)
    torch.testing.assert_close(out, A.reference(*args), atol=2e-5, rtol=2e-5)
    assert tried == [(32, 32, 2), (32, 32, 1), (32, 16, 1)]
    tried.clear()
    A.launch(*args, config=cfg)  # the same launcher, config and dtypes: straight to the fit
    assert tried == [(32, 16, 1)]


def test_a_launch_without_a_config_steps_down_from_its_row(interpret, monkeypatch):
    """The ops call launchers with no config (the row is looked up per signature): a refusal
    steps down from the device's row, and the fit is remembered for the next call."""
    tried = _refusing(monkeypatch, most_shared=16 * 16)
    row = config_for_arch("attention", "interpreter", head_dim=16, dtype=torch.float32)
    assert (row["BLOCK_M"], row["BLOCK_N"], row.get("num_stages", 2)) == (16, 16, 2)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    args = (q, k, v, None, 0.25, True, 0, False)
    with pytest.warns(UserWarning, match="attention: .*retrying with"):
        out = A.launch(*args)
    torch.testing.assert_close(out, A.reference(*args), atol=2e-5, rtol=2e-5)
    assert tried == [(16, 16, 2), (16, 16, 1)]
    tried.clear()
    A.launch(*args)
    assert tried == [(16, 16, 1)]
    # another launcher never refused pays no fit lookup (no row lookup per call on its path)
    from metainfer.kernels import sparse_attention as S
    from metainfer.lowering import aot

    monkeypatch.setattr(_common, "_fit_key", lambda *a: pytest.fail("looked a fit up for a launcher never refused"))
    idx = torch.zeros(1, 40, 4, dtype=torch.int32)
    with aot._recording(89, names_only=True):
        S.launch(q, k, v, idx, None, 0.25, True, 0, False, config=config_for_arch("sparse_attention", "interpreter"))


def test_plans_that_looked_their_row_up_are_remade_when_a_target_activates_rows(monkeypatch):
    from metainfer import targets
    from metainfer.kernels import configs

    monkeypatch.setattr(configs, "_active", dict(configs._active))  # the activation is undone after
    monkeypatch.setattr(_common, "CONFIG_GENERATION", _common.CONFIG_GENERATION)
    plans, built = _common.LaunchPlans(), []

    def build(tag):
        built.append(tag)
        return tag

    assert plans.get(("sig",), None, build, 1) == 1
    assert plans.get(("sig",), None, build, 2) == 1, "the same signature reuses its plan"
    given = {"BLOCK_M": 16}
    assert plans.get(("sig",), given, build, 3) == 3, "a given config is a plan of its own"
    configs.activate(targets.get("cpu"))
    assert plans.get(("sig",), None, build, 4) == 4, "rows activated since: made again"
    assert plans.get(("sig",), given, build, 5) == 3, "a given config does not depend on the rows"
    assert built == [1, 3, 4]


def test_a_launch_nothing_fits_raises_triton_s_error(interpret, monkeypatch):
    from triton.runtime.errors import OutOfResources

    _refusing(monkeypatch, most_shared=0)
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(OutOfResources), pytest.warns(UserWarning):
        A.launch(q, q, q, None, 0.25, True, 0, False, config=config_for_arch("attention", "interpreter"))


def test_a_row_s_float32_blocks_apply_to_float32_heads_only():
    """sm_90's d256-wide row: 2-byte heads of 256 take its own blocks, float32 heads of 128 (the
    same width) its FP32 blocks, which do not spill (lowering/aot.py reads the cubin)."""
    bf16 = config_for_arch("attention", "sm_90", head_dim=256, dtype=torch.bfloat16)
    fp32 = config_for_arch("attention", "sm_90", head_dim=128, dtype=torch.float32)
    assert "FP32" not in bf16 and "FP32" not in fp32
    assert (bf16["BLOCK_M"], bf16["BLOCK_N"]) == (64, 64) and (fp32["BLOCK_M"], fp32["BLOCK_N"]) == (64, 32)
    assert fp32["SPLIT_MIN"] == bf16["SPLIT_MIN"]  # the rest of the row is shared


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 3), max_size=5), target=st.lists(st.integers(1, 3), max_size=4))
def test_broadcasts_to_agrees_with_torch(shape, target):
    """The launchers' cheap shape check against torch.broadcast_shapes (what it replaced)."""
    try:
        expected = torch.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except RuntimeError:
        expected = False
    assert _common.broadcasts_to(tuple(shape), tuple(target)) == expected


def test_a_cache_grown_by_concatenation_reuses_its_launch_plan(monkeypatch):
    """Decode over a contiguous cache one key longer each step (transformers' DynamicCache): the
    attention family builds its plan once, not per step (the cache's strides move with its
    length, so they stay out of the plan's key)."""
    from metainfer.kernels import mla_decode, sparse_attention
    from metainfer.lowering import aot

    builds = []
    for module in (A, sparse_attention, mla_decode):
        real = module._Launch
        monkeypatch.setattr(module, "_Launch", lambda *a, real=real, name=module.NAME: builds.append(name) or real(*a))
    g = torch.Generator().manual_seed(0)
    q, idx = torch.randn(2, 4, 1, 16, generator=g), torch.randint(0, 8, (2, 1, 4), generator=g, dtype=torch.int32)
    ql, qp = torch.randn(2, 4, 1, 32, generator=g), torch.randn(2, 4, 1, 8, generator=g)
    with aot._recording(89, names_only=True):
        for n in range(20, 26):
            k, v = torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)
            A.launch(q, k, v, None, 0.25, True, n - 1, False)
            sparse_attention.launch(q, k, v, idx, None, 0.25, True, n - 1, False)
            ckv, kpe = torch.randn(2, n, 32, generator=g), torch.randn(2, n, 8, generator=g)
            mla_decode.launch(ql, qp, ckv, kpe, None, None, 0.2, True, n - 1, False)
    assert sorted(builds) == ["attention", "mla_decode", "sparse_attention"], builds
