"""The report: records, JSON, Markdown, graph dumps, METAINFER_DUMP, graph-break sections."""

import json

import pytest
import torch

import metainfer
from metainfer.passes.pipeline import DEFAULT_ORDER
from metainfer import models

FIELDS = ("name", "ran", "skipped_reason", "matches", "decisions", "seconds", "nodes_before", "nodes_after")


@pytest.fixture(scope="module")
def llama_opt():
    model = models.build("llama-tiny")
    (ids,) = models.example_inputs("llama-tiny", batch=1, seq=8)
    return metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager")


def test_records_have_the_contract_fields(llama_opt):
    r = llama_opt.report
    assert [p.name for p in r.passes] == list(DEFAULT_ORDER)
    records = json.loads(json.dumps(r.to_dict()))["graphs"][0]["passes"]
    for i, rec in enumerate(records):
        assert set(FIELDS) <= set(rec), f"{rec['name']} lacks {set(FIELDS) - set(rec)}"
        assert (rec["skipped_reason"] is None) == rec["ran"]
        if not rec["ran"]:  # a skipped pass neither matched nor touched the graph
            assert rec["matches"] == 0 and rec["nodes_before"] == rec["nodes_after"] and not rec["decisions"]
        if i:  # each pass starts from the graph the one before left
            assert rec["nodes_before"] == records[i - 1]["nodes_after"]
    att = r.record("fuse_attention")
    assert att.ran and att.matches == 2 and att.nodes_after < att.nodes_before and att.seconds > 0
    assert all(d.startswith("layers.") for d in att.decisions), "decisions name the layer"
    assert r.record("fuse_moe").ran and r.record("fuse_moe").matches == 0  # nothing MoE in Llama
    skipped = r.record("fuse_rope")
    assert not skipped.ran and "not profitable on cpu" in skipped.skipped_reason


def test_to_dict_is_json_and_str_is_a_table(llama_opt):
    d = llama_opt.report.to_dict()
    assert [p["name"] for p in json.loads(json.dumps(d))["graphs"][0]["passes"]] == list(DEFAULT_ORDER)
    text = str(llama_opt.report)
    assert "fuse_attention" in text and "matches" in text and "target cpu" in text


def test_console_report_wraps_decisions_instead_of_cutting_them(llama_opt):
    text = str(llama_opt.report)
    decision = llama_opt.report.record("fuse_attention").decisions[0]
    assert len(decision) > 100, "a decision long enough to have been cut before"
    assert " ".join(decision.split()) in " ".join(text.split()), "every word of it is there"
    assert "..." not in text
    assert max(len(line) for line in text.splitlines()) <= 140


def test_multi_device_passes_are_skipped_with_the_reason(llama_opt):
    """On a one-device target the communication passes cannot apply: skipped, not 'ran, 0'."""
    from metainfer.passes.lookahead import COMMUNICATION_PASSES

    for name in COMMUNICATION_PASSES:
        rec = llama_opt.report.record(name)
        assert not rec.ran and rec.skipped_reason == "a multi-device pass: target cpu has one device", name


def test_multi_device_passes_skip_a_graph_without_collectives():
    """A multi-device target in one process (no job): nothing is sharded, so nothing to do."""
    from metainfer.passes.lookahead import COMMUNICATION_PASSES

    model = models.build("llama-tiny", n_layers=1)
    report = metainfer.analyze(model, "pcie8", example_inputs=models.example_inputs("llama-tiny", seq=8))
    for name in COMMUNICATION_PASSES:
        rec = report.record(name)
        assert not rec.ran and "this graph has no collectives" in rec.skipped_reason, name


def test_save_writes_json_markdown_and_dumps_of_changed_graphs(llama_opt, tmp_path):
    llama_opt.report.save(tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["target"] == "cpu"
    assert "fuse_attention" in (tmp_path / "report.md").read_text()
    dumps = sorted(p.name for p in (tmp_path / "graphs").iterdir())
    assert dumps == ["graph0.trace.json", "graph0_fuse_attention.after.txt", "graph0_fuse_attention.before.txt",
                     "graph0_fuse_attention.diff"], "only passes that changed the graph are dumped"
    after = (tmp_path / "graphs" / "graph0_fuse_attention.after.txt").read_text()
    assert "metainfer.attention" in after
    assert "+" in (tmp_path / "graphs" / "graph0_fuse_attention.diff").read_text()


def test_dump_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("METAINFER_DUMP", str(tmp_path / "d"))
    model = models.build("llama-tiny", n_layers=1)
    (ids,) = models.example_inputs("llama-tiny", seq=8)
    metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager")
    assert (tmp_path / "d" / "report.json").is_file()


class Breaky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        print("a graph break")  # Dynamo cannot trace print
        return self.b(y).relu()


def test_graph_breaks_give_sections_with_reasons(capsys):
    opt = metainfer.optimize(Breaky().eval(), "cpu", example_inputs=(torch.randn(2, 8),), verify=True)
    r = opt.report
    assert len(r.sections) == 2
    assert any("print" in b for b in r.sections[0].break_reasons)
    assert r.graph_breaks and "graph break" in str(r)
    assert {p.graph for p in r.passes} == {0, 1}


def test_lazy_compile_fills_report_on_first_call():
    model = models.build("llama-tiny", n_layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    assert opt.report.sections == [] and "not been called" in str(opt.report)
    opt(torch.randint(0, 256, (1, 8)))
    assert opt.report.matches("fuse_attention") == 1


def test_prediction_before_and_after_each_pass(llama_opt, tmp_path):
    """Every pass that ran carries the simulator's time before and after it; a fusion lowers
    it; the section sums it up and save() writes the final schedule as a Chrome trace."""
    section = llama_opt.report.sections[0]
    ran = [r for r in section.records if r.ran]
    assert all(r.predicted_before_s > 0 and r.predicted_after_s > 0 and r.floor_after_s > 0 for r in ran)
    for a, b in zip(ran, ran[1:]):
        assert b.predicted_before_s == a.predicted_after_s, "each pass starts where the previous ended"
    att = llama_opt.report.record("fuse_attention")
    assert att.predicted_after_s < att.predicted_before_s, "fused attention moves fewer bytes"
    p = section.prediction
    assert p["before_s"] == ran[0].predicted_before_s and p["after_s"] == ran[-1].predicted_after_s
    assert p["predicted"] and p["floor_s"] <= p["after_s"] * (1 + 1e-9)
    assert "predicted on cpu" in str(llama_opt.report)
    llama_opt.report.save(tmp_path)
    trace = json.loads((tmp_path / "graphs" / "graph0.trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert "attention" in names and trace["metadata"]["predicted"]
    assert json.loads((tmp_path / "report.json").read_text())["graphs"][0]["prediction"]["after_s"] == p["after_s"]


class Spectral(torch.nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x, dim=-1).abs().sum(-1)


def test_ops_the_model_cannot_price_are_listed_not_fatal():
    opt = metainfer.optimize(Spectral().eval(), "cpu",
                             example_inputs=(torch.randn(4, 64),), lowering="aot_eager")
    p = opt.report.sections[0].prediction
    assert any("fft" in name for name in p["priced_by_bytes"]), p
    assert "priced by bytes only" in " ".join(str(opt.report).split())  # lines wrap
