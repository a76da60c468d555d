"""The report of one optimize(): every pass on every compiled graph, and what it did.

`str(report)` is a compact table; `report.save(dir)` writes report.json, report.md and, for
each pass that changed a graph, the graph before and after it and their diff.
"""

from __future__ import annotations

import difflib
import json
import textwrap
from pathlib import Path
from typing import Any

from metainfer.lowering.section import GraphSection, format_seconds
from metainfer.passes.manager import PassRecord


class Report:
    def __init__(self, target, pipeline: list[str], notes: list[str] | None = None):
        self.target = target
        self.pipeline = list(pipeline)
        self.sections: list[GraphSection] = []
        self.notes: list[str] = list(notes or [])
        # speculative decoding: each change of the draft length, when and why (metainfer.runtime.speculative)
        self.speculation: list[dict[str, Any]] = []

    # -- access ------------------------------------------------------------------------
    @property
    def passes(self) -> list[PassRecord]:
        """Every pass record, graph by graph, in the order they ran."""
        return [r for s in self.sections for r in s.records]

    @property
    def recompilations(self) -> int:
        """Graphs compiled because an earlier graph's guards failed (new shapes, say)."""
        return sum(1 for s in self.sections if s.recompile_reasons)

    def compiles(self) -> list[dict[str, Any]]:
        """One line per compiled graph: index, phase, why, inputs."""
        return [{"index": s.index, "phase": s.phase, "why": s.why, "inputs": s.inputs, "cuda_graphs": s.cuda_graphs}
                for s in self.sections]

    @property
    def graph_breaks(self) -> list[str]:
        return [b for s in self.sections for b in s.break_reasons]

    def matches(self, pass_name: str) -> int:
        """Total matches of a pass over all graphs."""
        return sum(r.matches for r in self.passes if r.name == pass_name)

    def record(self, pass_name: str, graph: int = 0) -> PassRecord:
        for r in self.sections[graph].records:
            if r.name == pass_name:
                return r
        raise KeyError(f"no record of pass {pass_name!r} on graph {graph}")

    # -- output ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "target_description": self.target.description,
            "device_kind": self.target.device.kind,
            "pipeline": self.pipeline,
            "graphs_compiled": len(self.sections),
            "recompilations": self.recompilations,
            "graphs": [s.to_dict() for s in self.sections],
            "graph_breaks": self.graph_breaks,
            "notes": self.notes,
            "speculation": self.speculation,
            "collective_settings": {k: v for k, (v, _) in self.target.collective_settings().items()},
        }

    def __str__(self) -> str:
        out = _wrap(f"metainfer report: target {self.target.name} ({self.target.description}); "
                    f"{len(self.sections)} graph(s) compiled ({self.recompilations} recompilation(s)); "
                    f"pipeline: {', '.join(self.pipeline) or '(none)'}", "", "    ")
        settings = self.target.collective_settings()
        if settings:
            out += _wrap(f"collective settings for {self.target.collective_backend}: "
                         + ", ".join(f"{k}={v}" for k, (v, _) in settings.items()), "", "    ")
        if not self.sections:
            out.append("  (nothing compiled yet: the model has not been called)")
        for s in self.sections:
            head = (f"graph {s.index} [{s.lowering}{', cached' if s.from_cache else ''}"
                    f"{', CUDA graphs' if s.cuda_graphs else ''}] {s.phase}; {s.why}")
            if s.break_reasons:
                head += f"; ends at a graph break: {s.break_reasons[0]}"
            out += _wrap(head, "", "    ")
            pred = s.prediction_line(self.target.name)
            if pred:
                out += _wrap(pred, "  ", "    ")
            rows = [("pass", "ran", "matches", "nodes", "ms", "predicted", "what it did")]
            for r in s.records:
                ran = "yes" if r.ran else "skip"
                what = r.decisions[0] if r.decisions else (r.skipped_reason or (r.near_misses[0] if r.near_misses else ""))
                more = len(r.decisions) - 1
                if more > 0:
                    what += f" (+{more} more in report.md)"
                rows.append((r.name, ran, str(r.matches) if r.ran else "-", f"{r.nodes_before}->{r.nodes_after}",
                             f"{r.seconds * 1e3:.1f}" if r.ran else "-", _predicted(r), what))
            widths = [max(len(row[i]) for row in rows) for i in range(6)]
            for row in rows:
                lead = "  " + "  ".join(row[i].ljust(widths[i]) for i in range(6)) + "  "
                out += _wrap(row[6], lead, " " * len(lead), width=max(_WIDTH, len(lead) + 60)) if row[6] else [lead.rstrip()]
            for r in s.records:
                for nm in r.near_misses:
                    out += _wrap(nm, f"  near miss [{r.name}] ", "      ")
        for n in self.notes:
            out += _wrap(n, "note: ", "      ")
        for d in self.speculation:
            out += _wrap(_speculation_line(d), "speculation: ", "      ")
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"<Report target={self.target.name} graphs={len(self.sections)} passes={len(self.passes)}>"

    def to_markdown(self) -> str:
        md = ["# metainfer report", "", f"- target: `{self.target.name}` ({self.target.description})",
              f"- pipeline: {', '.join(f'`{p}`' for p in self.pipeline)}",
              f"- graphs compiled: {len(self.sections)} ({self.recompilations} recompilation(s))"]
        for n in self.notes:
            md.append(f"- note: {n}")
        for k, (v, why) in self.target.collective_settings().items():
            md.append(f"- collective setting `{k}={v}`: {why}")
        for d in self.speculation:
            md.append(f"- speculation: {_speculation_line(d)}")
        for s in self.sections:
            md += ["", f"## Graph {s.index}", ""]
            if s.break_reasons:
                md.append("Dynamo ended this graph at a graph break:")
                md += [f"- {b}" for b in s.break_reasons]
                md.append("")
            md.append(f"Phase: {s.phase}; compiled because: {s.why}."
                      + (" Replayed from CUDA graphs." if s.cuda_graphs else ""))
            md.append("")
            md.append(f"Lowering: {s.lowering}{' (compiled graph reused from cache)' if s.from_cache else ''}; "
                      f"inputs: {', '.join(s.inputs) if s.inputs else '-'}")
            pred = s.prediction_line(self.target.name)
            if pred:
                md += ["", pred[0].upper() + pred[1:] + "."]
                if s.schedule is not None:
                    md.append(f"Chrome trace of the predicted schedule: `graphs/{_trace_name(s.index)}`.")
            md += ["", "| pass | ran | matches | nodes before -> after | time (ms) | predicted before -> after "
                   "(gap to floor; exposed communication) |", "|---|---|---|---|---|---|"]
            for r in s.records:
                md.append(f"| `{r.name}` | {'yes' if r.ran else 'skipped: ' + (r.skipped_reason or '')} | "
                          f"{r.matches} | {r.nodes_before} -> {r.nodes_after} | {r.seconds * 1e3:.1f} | "
                          f"{_predicted(r, full=True)} |")
            for r in s.records:
                if r.decisions or r.near_misses:
                    md += ["", f"### `{r.name}`", ""]
                    md += [f"- {d}" for d in r.decisions]
                    md += [f"- near miss: {d}" for d in r.near_misses]
                    if r.changed:
                        md.append(f"- graph dumps: `{_dump_name(s.index, r)}.before.txt`, `.after.txt`, `.diff`")
        return "\n".join(md) + "\n"

    def save(self, directory) -> Path:
        """Write report.json, report.md and graphs/ (before/after/diff of each change, and the
        Chrome trace of each graph's predicted schedule)."""
        d = Path(directory)
        gdir = d / "graphs"
        gdir.mkdir(parents=True, exist_ok=True)
        (d / "report.json").write_text(json.dumps(self.to_dict(), indent=2, default=str))
        (d / "report.md").write_text(self.to_markdown())
        for s in self.sections:
            if s.schedule is not None:
                s.schedule.save_trace(gdir / _trace_name(s.index))
            for r in s.records:
                if not r.changed:
                    continue
                stem = gdir / _dump_name(s.index, r)
                stem.with_suffix(".before.txt").write_text(r.graph_before)
                stem.with_suffix(".after.txt").write_text(r.graph_after)
                diff = difflib.unified_diff(r.graph_before.splitlines(True), r.graph_after.splitlines(True),
                                            fromfile=f"before {r.name}", tofile=f"after {r.name}", n=2)
                stem.with_suffix(".diff").write_text("".join(diff))
        return d


def _speculation_line(d: dict) -> str:
    return (f"{d['when']}: draft length {d['draft_length']} ({d['drafter']}, batch {d['batch']}, acceptance "
            f"{d['acceptance']:.2f} from {d['observed']}): {d['why']}")


def _trace_name(graph_index: int) -> str:
    return f"graph{graph_index}.trace.json"


def _predicted(r: PassRecord, full: bool = False) -> str:
    if not r.ran or r.predicted_after_s is None:
        return "-"
    if full:
        gap = r.gap_to_floor
        out = f"{format_seconds(r.predicted_before_s)} -> {format_seconds(r.predicted_after_s)}" + (f" ({gap:+.0%})" if gap is not None else "")
        if r.exposed_after_s or r.exposed_before_s:
            out += f"; exposed comm {format_seconds(r.exposed_before_s or 0.0)} -> {format_seconds(r.exposed_after_s or 0.0)}"
        return out
    if r.predicted_after_s == r.predicted_before_s:
        return format_seconds(r.predicted_after_s)
    return f"{format_seconds(r.predicted_before_s)}->{format_seconds(r.predicted_after_s)}"


def _dump_name(graph_index: int, r: PassRecord) -> str:
    return f"graph{graph_index}_{r.name}"


_WIDTH = 120  # console report: lines wrap here (nothing is cut; report.md has one line per item)


def _wrap(text: str, first: str, rest: str, width: int = _WIDTH) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]
