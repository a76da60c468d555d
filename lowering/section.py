"""What the backend records for each graph it compiles: its inputs, why it compiled, each
pass's record, the simulator's prediction and (when asked) its measured calls. The user's
Report (metainfer.report) is a list of these with the ways to show and save them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metainfer.passes.manager import PassRecord


@dataclass
class GraphSection:
    """One graph Dynamo captured (several when the model has graph breaks)."""

    index: int
    break_reasons: list[str] = field(default_factory=list)  # the graph break(s) that ended this graph
    inputs: list[str] = field(default_factory=list)  # dtype[shape] of each graph input
    records: list[PassRecord] = field(default_factory=list)
    lowering: str = "inductor"
    from_cache: bool = False  # Inductor reused a compiled graph; records come from metainfer's cache
    compile_seconds: float = 0.0
    phase: str = "forward"  # "forward", or "prefill"/"decode" when compiled inside generate()
    recompile_reasons: list[str] = field(default_factory=list)  # guards of earlier graphs that failed
    schedule: Any = None  # metainfer.hardware.simulate.Schedule of the final graph (None when served from cache)
    simulation_error: str | None = None
    call_seconds: list[float] = field(default_factory=list)  # wall time per call, when the backend times calls
    cuda_graphs: bool = False  # compiled to replay from CUDA graphs (lowering.backend.uses_cuda_graphs)

    @property
    def prediction(self) -> dict[str, Any] | None:
        """The simulator's figures for one call of this graph on the target: before the first
        pass, after the last, the floor and what the cost model priced by bytes only."""
        ran = [r for r in self.records if r.predicted_after_s is not None]
        if not ran:
            return None
        out = {"before_s": ran[0].predicted_before_s, "after_s": ran[-1].predicted_after_s,
               "floor_s": ran[-1].floor_after_s, "gap_to_floor": ran[-1].gap_to_floor, "predicted": True}
        if self.schedule is not None:
            out.update(exposed_comm_s=self.schedule.exposed_comm_seconds, comm_s=self.schedule.comm_seconds,
                       compute_s=self.schedule.compute_seconds, priced_by_bytes=self.schedule.priced_by_bytes)
        return out

    def prediction_line(self, target_name: str) -> str | None:
        p = self.prediction
        if p is None:
            return f"no prediction: {self.simulation_error}" if self.simulation_error else None
        line = (f"predicted on {target_name} (a model, not a measurement): {format_seconds(p['before_s'])} before passes -> "
                f"{format_seconds(p['after_s'])} after; floor {format_seconds(p['floor_s'])} (gap {p['gap_to_floor']:+.0%})")
        if p.get("comm_s"):
            line += f"; communication {format_seconds(p['comm_s'])}, exposed {format_seconds(p['exposed_comm_s'])}"
        if p.get("priced_by_bytes"):
            line += "; priced by bytes only (unknown to the cost model): " + ", ".join(
                f"{k} x{v}" for k, v in sorted(p["priced_by_bytes"].items()))
        return line

    @property
    def why(self) -> str:
        """Why this graph was compiled."""
        if self.recompile_reasons:
            return "recompiled: " + "; ".join(self.recompile_reasons)
        return "first compile of this code"

    def to_dict(self, with_graphs: bool = False) -> dict[str, Any]:
        return {
            "index": self.index, "phase": self.phase, "why": self.why,
            "recompile_reasons": self.recompile_reasons, "break_reasons": self.break_reasons, "inputs": self.inputs,
            "lowering": self.lowering, "from_cache": self.from_cache,
            "compile_seconds": round(self.compile_seconds, 4),
            "prediction": self.prediction, "simulation_error": self.simulation_error,
            "passes": [r.to_dict(with_graphs) for r in self.records],
        }


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
