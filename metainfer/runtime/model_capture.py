"""How metainfer captures a model, on the user's side: the model-side switches that keep a
forward in one graph (Dynamo's settings and the graph the passes see are
metainfer.lowering.capture's), and what a user is told when capture fails.

- Hugging Face MoE models whose experts run transformers' eager loop (a Python loop over the
  experts that received tokens: one graph break per expert) are captured through
  transformers' own `grouped_mm` experts implementation, the same function written with
  sort + grouped GEMMs; the model is switched back after each call.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref

import torch

from metainfer.lowering.capture import DYNAMO_CONFIG


_HAS_EXPERTS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()

HF_EXPERTS_NOTE = ("capture: transformers' eager experts loop breaks the graph once per expert; its experts "
                   "were captured through transformers' grouped_mm implementation (the same function)")


def hf_eager_experts(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers model whose MoE experts run the eager loop."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, tf.PreTrainedModel):
        return False
    from metainfer.models import transformers_adapter as hf

    if hf.experts_implementation(model.config) != "eager":
        return False
    if model not in _HAS_EXPERTS:  # scanned once per model, not on every call
        _HAS_EXPERTS[model] = any(hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate") for m in model.modules())
    return _HAS_EXPERTS[model]


@contextlib.contextmanager
def capturable(model: torch.nn.Module):
    """Inside the block the model's forward can be captured as one graph; yields the notes
    (what was switched) for the report."""
    notes = []
    switched = hf_eager_experts(model)
    if switched:
        model.set_experts_implementation("grouped_mm")
        notes.append(HF_EXPERTS_NOTE)
    try:
        with torch._dynamo.config.patch(**DYNAMO_CONFIG):
            yield notes
    finally:
        if switched:
            model.set_experts_implementation("eager")


class CaptureError(RuntimeError):
    """Dynamo could not capture the model on these inputs. The message starts with what
    metainfer knows (the inputs, the module and line where tracing failed, the cause) and
    ends with Dynamo's own text; the Dynamo exception is the __cause__."""


def translate(err: Exception, model: torch.nn.Module, args: tuple, kwargs: dict, target_name: str) -> Exception:
    """The exception to raise for a Dynamo failure while compiling `model` on these inputs:
    a pass's own PassError where a pass failed, else a CaptureError led by what metainfer
    knows. Errors of metainfer's lowering (a bug of ours) come back as they are."""
    from torch._dynamo.exc import BackendCompilerFailed

    from metainfer.runtime.inputs import describe

    if isinstance(err, BackendCompilerFailed):
        from metainfer.passes import PassError

        inner = err.inner_exception
        return inner if isinstance(inner, PassError) else err
    dynamo_text = str(err).strip()
    where = _where(model, err)
    lines = [f"metainfer could not capture {type(model).__name__}.forward for target {target_name}: {_cause(err)}",
             f"  inputs: {describe(model, args, kwargs)}"]
    if where:
        lines.append(f"  where: {where}")
    lines.append("  (the model's own forward on these inputs most likely fails the same way without metainfer)")
    lines += ["", "Dynamo's message:", dynamo_text]
    return CaptureError("\n".join(lines))


def _cause(err: Exception) -> str:
    """The underlying error, which Dynamo puts on an 'Explanation:' line ('... got X("...")')."""
    import re

    text = str(err)
    m = re.search(r"got (\w+(?:Error|Exception))\((['\"])(.*)\2\)\s*$", text, re.MULTILINE)
    if m:
        return f"{m.group(1)}: {m.group(3)}"
    cause = err.__cause__ or err.__context__
    if cause is not None and not isinstance(cause, type(err)):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return text.splitlines()[0] if text else type(err).__name__


def _where(model: torch.nn.Module, err: Exception) -> str:
    """Where tracing failed: the module (from the partial graph's last node, else from the
    stack where that is unambiguous), the line of its forward, and the innermost frame."""
    frames = list(getattr(err, "real_stack", None) or [])
    path = _failing_module(model, err)
    classes: dict[type, list[str]] = {}
    for name, m in model.named_modules():
        classes.setdefault(type(m), []).append(name or "(the model)")
    spans = []
    for cls, names in classes.items():
        forward = getattr(cls, "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None  # past decorators
        if code is None:
            continue
        last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
        spans.append((code.co_filename, code.co_firstlineno, last, cls, names))
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        hit = next((s for s in spans if s[0] == f.filename and s[1] <= f.lineno <= s[2]), None)
        if hit is None:
            continue
        _, _, _, cls, names = hit
        if path is not None and type(model.get_submodule(path)) is cls:
            who = path or "(the model)"
        else:
            who = names[0] if len(names) == 1 else f"one of {len(names)} {cls.__name__} modules ({names[0]}, ...)"
        out = f"{who} in {cls.__name__}.forward ({_frame(f)})"
        if i < len(frames) - 1:
            out += f", inside {frames[-1].name} ({_frame(frames[-1])})"
        return out
    if path:
        return f"{path} ({type(model.get_submodule(path)).__name__})"
    return _frame(frames[-1]) if frames else ""


def _failing_module(model: torch.nn.Module, err: Exception) -> str | None:
    """The module path of the op Dynamo was adding when it failed: the last node of the graph
    it was building carries the module stack (private Dynamo state; None where absent)."""
    import re

    try:
        out = err._torch_dynamo_tracer_output  # noqa: SLF001
        graph = (out.output_graph or out.output_graph_for_cleanup).graph
        stack = next(reversed(graph.nodes)).meta.get("nn_module_stack") or {}
    except Exception:
        return None
    if not stack:
        return ""  # the model's own forward
    path = list(stack.values())[-1][0]
    # the model as the compiled function reaches it: `self` of its forward, or (metainfer's own
    # entry, api._own_entry) the forward it calls
    path = re.sub(r"^L\['(?:self|forward)'\](?:\.__self__)?\.?", "", str(path))
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
    try:
        model.get_submodule(path)
    except AttributeError:
        return None
    return path


def _frame(f) -> str:
    path = f.filename
    for marker in ("site-packages/", "/models/", "/metainfer/"):
        if marker in path:
            path = (marker.strip("/") + "/" if marker != "site-packages/" else "") + path.split(marker, 1)[1]
            break
    code = (f.line or "").strip()  # a statement's first line only
    if code.endswith(("(", "[", "{", ",")):
        code += " ..."
    return f"{path}:{f.lineno}" + (f": {code}" if code else "")
