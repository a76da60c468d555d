"""fuse_rmsnorm: RMSNorm as models write it (and residual-add + RMSNorm) -> one op.

The forms, each with x^2 as pow or x*x, and rsqrt-multiply or sqrt-divide:
    x * rsqrt(mean(x^2, -1, keepdim) + eps) * w                   (plain, any dtype)
    w * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype), xf = x.float()   (Llama, Mistral, Qwen)
    (xf * rsqrt(mean(xf^2) + eps) * (1 + w.float())).to(x.dtype)     (Gemma)
    (x * rsqrt(mean(x^2) + eps)).to(w.dtype) * w    (Llama's, its upcast x read elsewhere too)
and each with the weight offset (1 + w) or without. When x is itself `a + b` of equal
shapes and dtypes, metainfer::add_rmsnorm returns (norm, a + b) and the sum's other users
(the residual stream) read its second output.
"""

from __future__ import annotations

import itertools

import torch


from .base import register
from .matching import FLOAT_DTYPES, aten, dtype, is_op, is_scalar, same, same_shape, shape
from .rules import Rule, PointwiseRulePass, positional

EPS, OFFSET = 0.0123, 0.0456  # stand-ins the tracer turns into the rule's scalars


def _normalise(x, eps, square: str, root: str):
    ms = (x.pow(2) if square == "pow" else x * x).mean(-1, keepdim=True) + eps
    return x * torch.rsqrt(ms) if root == "rsqrt" else x / torch.sqrt(ms)


def _norm_form(x, w, eps, c, *, square, root, cast):
    """The model's math; c is None for a plain weight, the offset for (c + w)."""
    if cast == "none":
        return _normalise(x, eps, square, root) * (w if c is None else w + c)
    if cast == "llama":
        return _normalise(x.float(), eps, square, root).to(x.dtype) * (w if c is None else w + c)
    if cast == "upcast elsewhere":  # Llama's form whose upcast other nodes read too: x is it
        return _normalise(x, eps, square, root).to(w.dtype) * (w if c is None else w + c)
    return (_normalise(x.float(), eps, square, root) * (w.float() if c is None else w.float() + c)).to(x.dtype)


def _out_dtype(x, w, cast: str) -> torch.dtype:
    if cast == "upcast elsewhere":
        return w.dtype
    return x.dtype if cast == "gemma" else torch.promote_types(x.dtype, w.dtype)


def _rules():
    for square, root, cast, offset, residual in itertools.product(
            ("pow", "mul"), ("rsqrt", "sqrt"), ("none", "llama", "gemma", "upcast elsewhere"), (True, False), (True, False)):
        form = dict(square=square, root=root, cast=cast)

        def pattern(w, eps, c=None, x=None, a=None, b=None, form=form, residual=residual):
            if residual:
                x = a + b
                return _norm_form(x, w, eps, c, **form), x
            return _norm_form(x, w, eps, c, **form)

        def replacement(w, eps, c=0.0, x=None, a=None, b=None, cast=cast, residual=residual):
            if residual:
                out = torch.ops.metainfer.add_rmsnorm(a, b, w, eps, c, _out_dtype(a, w, cast))
                return out[0], out[1]
            return torch.ops.metainfer.rmsnorm(x, w, eps, c, _out_dtype(x, w, cast))

        names = (("a", "b") if residual else ("x",)) + ("w", "eps") + (("c",) if offset else ())
        yield Rule("add+rmsnorm" if residual else "rmsnorm", "add_rmsnorm" if residual else "rmsnorm",
                   positional(pattern, names), positional(replacement, names), _example(residual, cast),
                   torch.float32 if cast == "none" else torch.bfloat16,
                   dict(eps=EPS, **({"c": OFFSET} if offset else {})), _proof, _detail)


def _example(residual: bool, cast: str):
    def tensors(dt):
        xdt = torch.float32 if cast == "upcast elsewhere" else dt
        return [torch.empty(2, 4, 8, dtype=xdt) for _ in range(2 if residual else 1)] + [torch.empty(8, dtype=dt)]

    return tensors


def _input(m):
    return m.kwargs["x"] if "x" in m.kwargs else m.kwargs["a"]


def _proof(m) -> str | None:
    k, x = m.kwargs, _input(m)
    w, eps, hidden = k["w"], k["eps"], shape(x)[-1]
    if not (is_scalar(eps) and eps >= 0):
        return f"eps {eps} is not a non-negative number"
    if shape(w) is None or len(shape(w)) != 1 or not same(shape(w)[0], hidden):
        return f"the scale applied after normalising is {list(shape(w) or [])}, not a weight vector of size {hidden}"
    if "b" in k and not (same_shape(shape(k["a"]), shape(k["b"])) and dtype(k["a"]) == dtype(k["b"])):
        return "the add before it broadcasts or mixes dtypes (a bias, not a residual)"
    out = m.output_nodes()[0]
    if not same_shape(shape(out), shape(x)):
        return "the weight multiply broadcasts to another shape"
    if dtype(x) not in FLOAT_DTYPES or dtype(w) not in FLOAT_DTYPES:
        return f"dtypes {dtype(x)}, {dtype(w)}"
    return None


def _detail(m) -> str:
    x, out = _input(m), m.output_nodes()[0]
    c = m.kwargs.get("c")
    return (f"dim {shape(x)[-1]}, eps {m.kwargs['eps']:g}{f', weight+{c:g}' if c else ''}, "
            f"{str(dtype(x)).replace('torch.', '')} -> {str(dtype(out)).replace('torch.', '')}")


@register
class FuseRMSNorm(PointwiseRulePass):
    """x * rsqrt(mean(x^2) + eps) * w (optionally after x = a + b) -> metainfer::rmsnorm / add_rmsnorm"""

    name = "fuse_rmsnorm"
    # at one node the matcher takes the first rule that applies: the larger forms (the
    # residual add, the weight offset) before the ones they contain
    what = "rmsnorm"
    rules = tuple(sorted(_rules(), key=lambda r: (r.name != "add+rmsnorm", "c" not in r.scalars)))

    @staticmethod
    def anchor(n) -> bool:  # the root of mean(x^2) + eps
        return is_op(n, aten.rsqrt, aten.sqrt) and is_op(n.args[0], aten.add) and is_op(n.args[0].args[0], aten.mean)
