"""The metainfer command line."""

import json
import subprocess
import sys

from metainfer.cli import main


def test_targets(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "pcie8" in out and "4 + 4" in out


def test_optimize_models_name_with_dump(tmp_path, capsys):
    assert main(["optimize", "--model", "llama-tiny", "--target", "cpu", "--seq", "8", "--lowering", "aot_eager",
                 "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fuse_attention" in out and "metainfer.attention" in out
    assert (tmp_path / "report.json").is_file()


def test_optimize_hugging_face_config_json(tmp_path, capsys):
    cfg = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["optimize", "--model", str(tmp_path / "config.json"), "--attn", "eager", "--seq", "8",
                 "--lowering", "aot_eager", "--verify"]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out


def test_bad_target_is_an_error_not_a_traceback(capsys):
    assert main(["optimize", "--model", "llama-tiny", "--target", "tpu"]) == 2
    assert "unknown target" in capsys.readouterr().err


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "metainfer", "passes"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "fuse_rmsnorm" in r.stdout
