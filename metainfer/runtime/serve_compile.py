"""When a serving engine's steps start running compiled graphs: only once compiling pays.

A step of transformers' continuous batching runs one of two ways under metainfer:
- eager: the model's own forward, with metainfer's paged attention and its traceable cache
  update (metainfer.runtime.serving) but no compiled graph;
- compiled: the one graph metainfer compiles for every packed step (symbolic sizes).

Compiling costs seconds to a minute (Inductor on CPU compiles C++), and a short batch can be
over long before that pays back. So, by default ("auto"), the first steps run eagerly and the
graph is compiled at the first step where its predicted cost is at most BUDGET (20%) of the
eager serving time: what this model has spent serving eagerly so far plus what the work the
engine already knows of would take eagerly at the rate measured so far. Compiled steps are no
slower than eager ones, so a batch (or a server's life) that compiles costs at most 1.2x what
serving it eagerly would, and the eager path is itself faster than the plain engine
(bench/bench_serving.py). It is the ski-rental rule with a lookahead: a one-off short batch
never waits on a compile; a long batch compiles at once; a server compiles once it has served
for five times the compile's cost.

The compile's cost is measured, not assumed: the seconds of every compile are kept in the
compile cache (<cache>/serving/), per model, target, lowering and versions, split by whether
Inductor's cache already held the graph (a warm compile skips codegen); a model never compiled
is predicted at the highest cost per layer measured on this machine for another one, or, for
none, at DEFAULT_SECONDS_PER_LAYER, measured on the project's 2-core VM (a faster machine
compiles sooner than predicted; the error only delays the switch).

"always" compiles at the first step (a server that warms up before taking traffic), "never"
serves eagerly throughout.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

MODES = ("auto", "always", "never")
BUDGET = 0.2  # compile seconds at most this share of the eager serving time they replace
# seconds per decoder layer of one serving graph compiled with an empty cache, Dynamo's trace
# included, on the 2-core dev VM (HF Llama 512 hidden x 4 layers, bf16, one thread: Inductor
# 20.2 s, aot_eager 5.1 s; 5.6 s in fp32)
DEFAULT_SECONDS_PER_LAYER = {"inductor": 5.0, "aot_eager": 1.4}
# an Inductor compile whose graph is in the cache (Dynamo's trace, AOTAutograd and Inductor's
# caches hit) over the same compile from an empty cache: 4.7 s / 20.2 s on the dev VM, same model
WARM_SHARE = 0.25


def _layers(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return max(1, int(getattr(cfg, "num_hidden_layers", 0) or 1))


class ServingCompile:
    """Per OptimizedModel: which of its serving graphs exist, and the figures behind each switch.
    Steps come in two shapes Dynamo compiles apart (sizes of 1 are specialised): steps of
    several query tokens, and steps of one (a single request decoding); each switches on its
    own measurements."""

    SHAPES = ("several tokens", "one token")

    def __init__(self, opt, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"serve_compile must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self._opt = opt
        self.compiled: dict[str, str] = {}  # step shape -> why its graph was compiled
        self.eager = {shape: [0.0, 0, 0] for shape in self.SHAPES}  # seconds, tokens, steps served eagerly
        self.job = False  # a tensor-parallel job's rank: compiled at the first step
        self.failure: str | None = None  # why the graph could not be compiled
        self._dir = Path(opt.cache_dir) / "serving"
        self._key_cache: str | None = None
        self._predicted: tuple[float, str] | None = None  # read from the records once, until one is stored

    @staticmethod
    def shape(tokens: int) -> str:
        return "one token" if tokens == 1 else "several tokens"

    @property
    def eager_steps(self) -> int:
        return sum(e[2] for e in self.eager.values())

    # -- the decision --------------------------------------------------------------------
    def use_compiled(self, tokens: int, remaining_tokens: int = 0) -> bool:
        """Whether a step of `tokens` query tokens runs a compiled graph (compiling it now if
        none exists for its shape). `remaining_tokens`: query tokens the engine is known to have
        left, this step's included."""
        shape = self.shape(tokens)
        if shape in self.compiled:
            return True
        if self.mode == "always":
            self.compiled[shape] = ("compiled at the first step: ranks of a job switch together" if self.job
                                    else "serve_compile='always': compiled at the first step")
            return True
        seconds, done, steps = self.eager[shape]
        if self.mode == "never" or done == 0:  # measure the eager rate first
            return False
        predicted, source = self.predicted_compile_seconds()
        rate = seconds / done
        work = seconds + rate * remaining_tokens
        if predicted > BUDGET * work:
            return False
        self.compiled[shape] = (f"compiled after {steps} eager steps: predicted compile {predicted:.1f} s ({source}) "
                                f"<= {BUDGET:.0%} of {work:.1f} s of eager serving ({seconds:.1f} s done, "
                                f"{remaining_tokens} tokens known to come at {rate * 1e3:.2f} ms a token)")
        return True

    def ran(self, seconds: float, tokens: int, compiled: bool, compiled_now: bool, warm: bool) -> None:
        """A step ran: eager, or compiled (`compiled_now`: its graph was compiled by this step,
        from Inductor's cache if `warm`)."""
        e = self.eager[self.shape(tokens)]
        if not compiled:
            e[0] += seconds
            e[1] += tokens
            e[2] += 1
        elif compiled_now:
            step = e[0] / e[1] * tokens if e[1] else 0.0
            self._store("warm" if warm else "cold", max(0.0, seconds - step))

    def in_a_job(self) -> None:
        """Ranks of a tensor-parallel job must run the same steps the same way (the eager and the
        compiled step issue their collectives differently), and each rank measures its own times:
        "auto" compiles at the first step there."""
        if self.mode == "auto":
            self.mode = "always"
            self.job = True

    def failed(self, error: Exception) -> None:
        """The graph could not be compiled: every step from here on runs eagerly."""
        self.mode = "never"
        self.failure = str(error).splitlines()[0][:300]

    def note(self) -> str:
        if self.failure:
            return f"serving compile: the graph could not be compiled, every step eager: {self.failure}"
        if self.mode == "never":
            return "serving compile: serve_compile='never': every step eager (metainfer's paged attention, no graph)"
        predicted, source = self.predicted_compile_seconds()
        parts = []
        for shape in self.SHAPES:
            seconds, _, steps = self.eager[shape]
            if shape in self.compiled:
                parts.append(f"steps of {shape}: {self.compiled[shape]}")
            elif steps:
                parts.append(f"steps of {shape}: not yet, {steps} served eagerly ({seconds:.1f} s); its graph compiles "
                             f"once the predicted {predicted:.1f} s ({source}) is at most {BUDGET:.0%} of the eager "
                             "serving time")
        return "serving compile: " + "; ".join(parts or ["no step served yet"])

    # -- measured compile costs ----------------------------------------------------------
    def predicted_compile_seconds(self) -> tuple[float, str]:
        """(seconds, where the figure comes from) a compile of this model's serving graph is
        predicted to take; read from the records once (an eager step asks), again after a store."""
        if self._predicted is None:
            self._predicted = self._predict()
        return self._predicted

    def _predict(self) -> tuple[float, str]:
        own = self._load(self._key)
        lowering = self._opt.lowering
        cached = lowering == "aot_eager" or (self._dir.parent / "inductor").is_dir()  # not cleared since
        if own.get("warm") is not None and cached:
            return own["warm"], "measured: this model's last compile from a warm cache"
        if own.get("cold") is not None:
            if lowering == "inductor" and cached:  # its graph is in the cache now
                return (own["cold"] * WARM_SHARE, f"this model's compile from an empty cache, {own['cold']:.1f} s, x "
                        f"{WARM_SHARE}, the warm / cold ratio measured on the dev VM")
            return own["cold"], "measured: this model's last compile"
        layers = _layers(self._opt.model)
        rates = [r["cold"] / r["layers"] for r in self._records()
                 if r.get("lowering") == lowering and r.get("cold") is not None and r.get("layers")]
        if rates:
            return max(rates) * layers, f"{layers} layers at the highest cost per layer measured here for another model"
        return (DEFAULT_SECONDS_PER_LAYER[lowering] * layers,
                f"{layers} layers x {DEFAULT_SECONDS_PER_LAYER[lowering]} s, measured on the project's dev VM")

    @property
    def _key(self) -> str:
        """The measurements' key, built when a serving step first needs it (only a served model,
        a transformers one, has the config it reads)."""
        if self._key_cache is None:
            self._key_cache = self._model_key()
        return self._key_cache

    def _model_key(self) -> str:
        import torch
        import triton

        from metainfer import __version__

        opt, model = self._opt, self._opt.model
        config = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else ""
        param = next(model.parameters())
        parts = (type(model).__qualname__, config, str(param.dtype), param.device.type, opt.target.name,
                 opt.lowering, ",".join(opt.pass_names), torch.__version__,
                 triton.__version__, __version__)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    def _load(self, key: str) -> dict:
        try:
            return json.loads((self._dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            return {}

    def _records(self) -> list[dict]:
        out = []
        for p in self._dir.glob("*.json") if self._dir.is_dir() else ():
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def _store(self, kind: str, seconds: float) -> None:
        self._predicted = None
        data = self._load(self._key)
        data.update({kind: round(seconds, 3), "layers": _layers(self._opt.model),
                     "lowering": self._opt.lowering, "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        if self._opt.lowering == "aot_eager":
            data["warm"] = data["cold"] = round(seconds, 3)  # nothing on disk to reuse: every compile is cold
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            tmp = self._dir / f"{self._key}.tmp{os.getpid()}"
            tmp.write_text(json.dumps(data))
            tmp.replace(self._dir / f"{self._key}.json")
        except OSError:
            pass  # a read-only cache only loses the measurement
