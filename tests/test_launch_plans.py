"""kernels/_common.GuardedPlans: a launcher's plans found by a guard over its tensors' metadata
(Dynamo's TensorGuards in C++, or the Python guard that stands in for it), the signature dict
behind them. Which calls must reuse a plan and which must not is written out by hand here."""

import pytest
import torch

from metainfer.kernels import _common


@pytest.fixture(params=["TensorGuards", "python"])
def guard_kind(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(_common, "_TensorGuards", None)
    elif _common._TensorGuards is None:
        pytest.skip("this torch has no TensorGuards")
    return request.param


class Counting:
    """A GuardedPlans with its guard misses (key_fn calls) and builds counted."""

    def __init__(self, **kw):
        self.plans, self.misses, self.builds = _common.GuardedPlans(**kw), 0, 0

    def key(self, tensors, scalars):
        self.misses += 1
        return tuple(_common.signature(*tensors)) + scalars

    def build(self, tensors, scalars):
        self.builds += 1
        return ("plan", self.builds)

    def __call__(self, tensors, scalars=(), config=None):
        return self.plans.get_guarded(scalars, tuple(tensors), config, self.key, self.build, tuple(tensors), scalars)


def test_same_metadata_reuses_the_plan_anything_else_does_not(guard_kind):
    plans = Counting()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    first = plans((x, w))
    assert plans((x, w)) is first and plans((torch.randn(4, 8), torch.randn(8, 8))) is first
    assert plans.misses == 1, "new tensors of the same shapes, strides, dtype: one guard check"
    others = [
        (torch.randn(5, 8), w),                      # another shape
        (torch.randn(8, 4).t(), w),                  # same shape, other strides
        (torch.randn(4, 8, dtype=torch.float64), w),  # another dtype
    ]
    for args in others:
        assert plans(args) is not first
    assert plans.builds == 1 + len(others)
    misses = plans.misses
    assert plans((x, torch.randn(8, 8).requires_grad_())) is first, "the signature behind has no requires_grad"
    assert plans.misses == misses + 1, "but the guard checks it"
    assert plans((x, w), scalars=(2,)) is not first, "other scalars: another plan"


def test_first_dims_that_may_vary_do_not_make_new_plans(guard_kind):
    plans = Counting(vary={1: ((0,), ())})
    q, pool = torch.randn(4, 8), torch.randn(100, 2, 8)
    first = plans((q, pool))
    assert plans((q, torch.randn(37, 2, 8))) is first and plans.misses == 1
    assert plans((q, torch.randn(37, 3, 8))) is not first, "only the first dim may vary"
    assert plans((torch.randn(5, 8), pool)) is not first, "only at the positions given"


def test_a_cache_grown_by_concatenation_keeps_its_plan(guard_kind):
    """A contiguous cache one key longer each step: its length and the strides that follow from it
    vary, its rank, dtype and the other dims do not."""
    plans = Counting(vary={1: ((2,), None)})
    q = torch.randn(2, 4, 1, 16)
    first = plans((q, torch.randn(2, 2, 10, 16)))
    for n in range(11, 16):
        assert plans((q, torch.randn(2, 2, n, 16))) is first
    assert plans.misses == 1
    assert plans((q, torch.randn(2, 3, 12, 16))) is not first, "another head count"
    assert plans((q, torch.randn(2, 2, 12, 16, dtype=torch.float64))) is not first, "another dtype"
    assert plans((q, torch.randn(4, 12, 16))) is not first, "another rank"


def test_grad_mode_does_not_change_the_plan(guard_kind):
    plans = Counting()
    x = torch.randn(4, 8)
    first = plans((x,))
    with torch.no_grad():
        assert plans((x,)) is first
    assert plans.misses == 1, "grad mode is not in the guard"
    with torch.inference_mode():
        assert plans((torch.randn(4, 8),)) is first and plans((torch.randn(4, 8),)) is first
    # inference tensors carry other dispatch keys, which TensorGuards checks: one more guard
    assert plans.misses == (2 if guard_kind == "TensorGuards" else 1) and plans.builds == 1


def test_a_tensor_given_twice_is_guarded_too(guard_kind):
    """TensorGuards passes only distinct tensors: tied arguments take the Python guard."""
    plans = Counting()
    w = torch.randn(8, 8)
    first = plans((w, w))
    assert plans((w, w)) is first and plans.misses == 1
    assert plans((w, torch.randn(8, 8))) is first and plans.builds == 1, "untied, same metadata: same plan"


def test_more_signatures_than_the_recent_ones_are_built_once_each(guard_kind):
    plans = Counting(recent=4)
    xs = [torch.randn(n, 8) for n in range(1, 11)]
    made = [plans((x,)) for x in xs]
    assert [plans((x,)) for x in xs] == made
    assert plans.builds == 10


def test_many_signatures_of_the_same_scalars_told_apart_by_a_cheap_scalar(guard_kind):
    """A step's linears: more weight shapes than `recent`, called in a cycle; with the weight's
    shape among the scalars each finds its plan by its guard after the first step."""
    plans = Counting(recent=2)
    x = torch.randn(4, 64)
    ws = [torch.randn(n, 64) for n in range(8, 16)]
    for _ in range(3):
        for w in ws:
            plans((x, w), scalars=(tuple(w.shape),))
    assert plans.misses == len(ws) and plans.builds == len(ws)


def test_a_given_config_and_a_target_s_rows_keep_plans_apart(guard_kind, monkeypatch):
    monkeypatch.setattr(_common, "CONFIG_GENERATION", _common.CONFIG_GENERATION)
    plans = Counting()
    x, given = torch.randn(4, 8), {"BLOCK_M": 16}
    looked_up = plans((x,))
    assert plans((x,), config=given) is not looked_up
    assert plans((x,), config=given) is plans((x,), config=given)
    _common.CONFIG_GENERATION += 1  # what configs.activate does
    assert plans((x,)) is not looked_up, "a plan that looked its row up is made again"
    assert plans.builds == 3


def test_a_non_tensor_argument_reaches_the_launcher_s_checks(guard_kind):
    plans = Counting()
    plans((torch.randn(4, 8),))

    def checked(tensors, scalars):
        raise _common.KernelInputError("x must be a tensor")

    with pytest.raises(_common.KernelInputError, match="must be a tensor"):
        plans.plans.get_guarded((), (3,), None, lambda *a: ("key",), checked, (3,), ())
