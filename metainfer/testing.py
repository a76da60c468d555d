"""Helpers for testing passes, for this project's tests and for users' own passes.

    gm, args = capture_graph(fn, *inputs)    # functional ATen, Inductor's decompositions
    after, rec = run_pass("fuse_attention", gm)
    assert rec.matches == 1
    assert_graphs_equivalent(gm, after, args)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import torch

from metainfer.api import resolve_target
from metainfer.lowering.capture import DYNAMO_CONFIG
from metainfer.passes import Pass, PassManager, PassRecord, get_pass
from metainfer.verify import mismatch


def capture_graph(fn, *inputs, dynamic: bool | None = False) -> tuple[torch.fx.GraphModule, list]:
    """The graph metainfer's passes would see for `fn(*inputs)`: Dynamo capture, AOTAutograd with
    Inductor's decompositions, Inductor's graph passes up to the slot where the pass manager
    runs (functional ATen with fake-tensor metadata; the same graph under every lowering).
    Returns the graph and its inputs in the graph's order (Dynamo orders them by first use;
    a module's parameters are inputs too). With `dynamic=True` every size is symbolic (sizes
    of 1 stay specialised, as Dynamo does); with `dynamic=None`, those marked with
    `torch._dynamo.mark_dynamic`. The inputs list then holds ints for the symbols:
    `graph_inputs(gm, tensors)` builds it for other sizes."""
    from metainfer.lowering.capture import post_grad
    from metainfer.passes.lookahead import copy_graph

    box: dict = {}

    def backend(gm, example_inputs):
        box["inputs"] = list(example_inputs)

        def keep(fx_gm):
            if "gm" in box:
                raise RuntimeError("capture_graph: the function has a graph break; capture one graph at a time")
            # a copy as the passes' slot sees it (Inductor's later post-grad passes go on with the original)
            box["gm"] = torch.fx.GraphModule(fx_gm, copy_graph(fx_gm.graph))

        return post_grad(gm, example_inputs, keep)

    # every capture of the same code (a test's closure, say) is a new cache entry for Dynamo
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20,
                                                     **DYNAMO_CONFIG):
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    gm = box["gm"]
    if dynamic is not False:
        tensors = [x for x in box["inputs"] if isinstance(x, torch.Tensor)]
        return gm, graph_inputs(gm, tensors)
    return gm, box["inputs"]


def graph_inputs(gm: torch.fx.GraphModule, tensors) -> list:
    """The argument list of a captured graph for these tensor inputs (in the graph's order):
    each symbolic-size input gets the size it names, read off the tensors' shapes."""
    tensors = list(tensors)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensor_ph = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    if len(tensor_ph) != len(tensors):
        raise ValueError(f"the graph takes {len(tensor_ph)} tensors, got {len(tensors)}")
    sizes = {}
    for n, t in zip(tensor_ph, tensors):
        for s, real in zip(n.meta["val"].shape, t.shape):
            if isinstance(s, torch.SymInt):
                sizes.setdefault(s.node.expr, real)
    args, it = [], iter(tensors)
    for n in placeholders:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            args.append(next(it))
        elif isinstance(v, torch.SymInt):
            if v.node.expr not in sizes:
                raise ValueError(f"no tensor input has a dimension of size {v.node.expr}")
            args.append(sizes[v.node.expr])
        else:
            raise ValueError(f"graph input {n.name} is neither a tensor nor a size")
    return args


def fresh_like(inputs) -> list:
    """New random values for the floating-point inputs (others kept): equivalence on inputs
    the graph was not captured with."""
    return [torch.randn_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]


def run_pass(p: "Pass | str", gm: torch.fx.GraphModule, target="cpu", options: dict | None = None
             ) -> tuple[torch.fx.GraphModule, PassRecord]:
    """Run one pass (even where it would not pay) on a copy of `gm`."""
    p = get_pass(p) if isinstance(p, str) else p
    out = copy.deepcopy(gm)
    mgr = PassManager([p], resolve_target(target), explicit=True, options=options)
    mgr(out.graph)
    out.recompile()
    return out, mgr.records[0]


def assert_graphs_equivalent(before: torch.fx.GraphModule, after: torch.fx.GraphModule, inputs) -> None:
    with torch.no_grad():
        ref, out = before(*inputs), after(*inputs)
    why = mismatch(ref, out)
    if why is not None:
        raise AssertionError(f"graphs differ: {why}")


def count_calls(gm: torch.fx.GraphModule, op) -> int:
    """How many call_function nodes target `op` (an OpOverload or its packet)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and (n.target is op or getattr(n.target, "overloadpacket", None) is op))


def tiny_hf_model(arch: str = "Llama", attn: str = "eager", layers: int = 2, seed: int = 0, **config):
    """A Hugging Face causal LM of family `arch` ("Llama", "Qwen2", "Mistral", ...) from a tiny
    config with random weights (nothing downloaded), in eval mode: vocabulary 128, hidden 64,
    4 heads / 2 kv heads; `config` overrides any field."""
    import transformers

    from metainfer.models import transformers_adapter as hf

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = getattr(transformers, f"{arch}Config")(**{**fields, **config})
    hf.set_attention_implementation(cfg, attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()



# ---- host reads: what would stall a GPU step ---------------------------------------------------

_PROJECT_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
                      for d in ("metainfer", "kernels", "lowering", "passes", "models"))
_TENSOR_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def host_reads(allow: tuple[str, ...] = ()):
    """A list of the host reads metainfer's own code makes while the context is open: a tensor's
    item(), tolist(), nonzero(), bool()/int()/float(), torch.nonzero and torch.cuda.synchronize,
    each as "function at file:line" of the innermost metainfer frame that called it. On a GPU each
    of these waits for the device; a decode or serving step must make none. Calls made from
    another library's frames (the engine's bookkeeping, Triton's interpreter) are not metainfer's
    and are not listed; `allow` names "file.py:function" pairs that may read (with a reason where
    they are granted)."""
    import sys

    reads: list[str] = []
    here = os.path.abspath(__file__)

    def culprit() -> str | None:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name != here and not name.startswith(os.path.dirname(torch.__file__)):
                if not name.startswith(_PROJECT_DIRS):
                    return None  # another library asked
                where = f"{os.path.basename(name)}:{frame.f_code.co_name}"
                return None if where in allow else f"{where} line {frame.f_lineno}"
            frame = frame.f_back
        return None

    def spy(owner, attr):
        real = getattr(owner, attr)

        @functools.wraps(real)
        def read(*args, **kwargs):
            who = culprit()
            if who is not None:
                reads.append(f"{attr} at {who}")
            return real(*args, **kwargs)
        return read

    patched = [(torch.Tensor, a) for a in _TENSOR_READS] + [(torch, "nonzero"), (torch.cuda, "synchronize")]
    saved = [(owner, attr, owner.__dict__.get(attr, _UNSET)) for owner, attr in patched]
    try:
        for owner, attr in patched:
            setattr(owner, attr, spy(owner, attr))
        yield reads
    finally:
        for owner, attr, value in saved:
            if value is _UNSET:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


_UNSET = object()


def functional_collectives_check(rank: int, world_size: int, device: str) -> list[str]:
    """Run on each rank of a job (metainfer.parallel.multirank.run): all_reduce, all_gather and
    reduce_scatter through torch's functional collectives on `device` tensors, eager and inside
    a torch.compile graph (where metainfer's collective passes meet them); the mismatches found,
    each as text (empty when all agree with the sums computed locally)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # this rank's GPU (multirank sets it for NCCL)
    x = torch.arange(12, dtype=torch.float32, device=device) * (rank + 1)
    total = torch.arange(12, dtype=torch.float32, device=device) * sum(range(1, world_size + 1))
    gathered = torch.cat([torch.arange(12, dtype=torch.float32, device=device) * (r + 1) for r in range(world_size)])

    def ops(t):
        return (fc.all_reduce(t, "sum", group), fc.all_gather_tensor(t, 0, group),
                fc.reduce_scatter_tensor(t, "sum", 0, group))

    expected = (total, gathered, total.chunk(world_size)[rank])
    bad = []
    for how, fn in (("eager", ops), ("compiled", torch.compile(ops, backend="aot_eager", fullgraph=True))):
        for name, got, want in zip(("all_reduce", "all_gather", "reduce_scatter"), fn(x), expected):
            got = fc.wait_tensor(got) if hasattr(fc, "wait_tensor") else got
            if got.device.type != torch.device(device).type or not torch.equal(got, want):
                bad.append(f"rank {rank} {how} {name}: got {got.tolist()}, want {want.tolist()}")
    return bad


# ---- a `metainfer serve` process for tests (needs the serve and test extras: httpx)

def tiny_model_folder(path, quantized: str | None = None, **options):
    """The benchmark's hf-llama-tiny (random weights, 512 positions) and its word tokenizer (with a
    chat template), saved as a Hugging Face model folder at `path`; `quantized`: a format of
    metainfer.checkpoint_writers (`options` go to its save_quantized) instead of float weights."""
    from metainfer import servebench

    model = servebench.build_model("hf-llama-tiny")
    model.config.max_position_embeddings = 512
    if quantized is None:
        model.save_pretrained(path)
    else:
        from metainfer.checkpoint_writers import save_quantized

        save_quantized(model, path, quantized, **options)
    servebench.word_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {'name{labels}': value}."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class ServerProcess:
    """`metainfer serve --model folder --lowering aot_eager *args` on 127.0.0.1, started in `tmp`
    (not the checkout: `python -m` puts the working directory first on sys.path, where kernels/
    would shadow the `kernels` package transformers imports) and waited for until /ready
    (`wait=False`: not waited for). `env`: variables added to the server's environment."""

    def __init__(self, folder, tmp, *args: str, key: str | None = None, ready_timeout_s: float = 600,
                 env: dict | None = None, wait: bool = True):
        import subprocess
        import sys
        import time

        import httpx

        self.key = key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(tmp, "server.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metainfer", "serve", "--model", str(folder), "--port", str(self.port),
             "--lowering", "aot_eager", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=tmp)
        self._ranks: list[int] = [self.proc.pid]
        if not wait:
            self._follow_ranks()
            return
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.tail()}"
            self._follow_ranks()
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready in {ready_timeout_s:g} s: {self.tail()}")

    def _follow_ranks(self) -> None:
        """Note the rank processes the server spawned (its children running metainfer; not, say,
        the C compiler building the shared-memory library), while it lives."""
        import threading

        def follow():
            import psutil

            me = psutil.Process(self.proc.pid)
            while self.proc.poll() is None:
                try:
                    for child in me.children():
                        if child.pid not in self._ranks and "metainfer" in child.cmdline():
                            self._ranks.append(child.pid)
                except psutil.Error:  # a child gone between listing and reading it
                    pass
                threading.Event().wait(0.05)

        if not getattr(self, "_following", False):
            self._following = True
            threading.Thread(target=follow, daemon=True).start()

    @property
    def rank_pids(self) -> list[int]:
        """The server's process (rank 0) and every rank process it spawned so far."""
        return list(self._ranks)

    def tail(self, chars: int | None = 3000) -> str:
        """The end of the server's log (None: all of it)."""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        return text if chars is None else text[-chars:]

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def headers(self, key: str | None = "default") -> dict:
        key = self.key if key == "default" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, path: str, body, key: str | None = "default", **kw):
        import json

        import httpx

        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, headers=self.headers(key), timeout=120, **kw)

    def rss_bytes(self) -> int:
        """The server process's resident memory (Linux /proc)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def stop(self, timeout_s: float = 60) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)


def defined_names(tree) -> set[str]:
    """The names a module's source defines (an `ast` tree): functions, classes, module or local
    names, and attributes it sets on `self` or `cls`; the source checks of tests/test_layers.py
    and tests/test_transformers_adapter.py tell the project's names from other packages' by it."""
    import ast

    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
    return out
