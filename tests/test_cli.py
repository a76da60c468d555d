"""The metainfer command line."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

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


def test_version_and_help_answer_without_importing_torch(python_c):
    code = ("import sys\n"
            "from metainfer.cli import main\n"
            "for argv in (['--version'], ['--help'], ['optimize', '--help']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    stdout = python_c(code)
    import metainfer
    import torch

    assert stdout.startswith(f"metainfer {metainfer.__version__} (torch {torch.__version__}, triton ")


def test_every_option_says_what_it_does():
    from metainfer.cli import parser

    def actions(p):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from actions(sub)
            elif not isinstance(a, argparse._HelpAction):
                yield p.prog, a

    missing = [(prog, a.option_strings or a.dest) for prog, a in actions(parser()) if not a.help]
    assert not missing


def test_numbers_are_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["optimize", "--model", "llama-tiny", "--batch", "0"])
    assert e.value.code == 2 and "--batch: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_target_on_a_machine_without_one_is_worded_for_the_shell(capsys):
    assert main(["optimize", "--model", "llama-tiny", "--target", "pcie8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("metainfer: error: --target pcie8: it drives CUDA GPUs")
    assert "this machine has none" in err and "--target cpu" in err and "metainfer plan" in err
    assert ".to(" not in err


def test_target_and_config_are_checked_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    from metainfer import models

    def no_build(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models, "build", no_build)
    assert main(["optimize", "--model", "llama-tiny", "--target", "nosuch"]) == 2
    assert "--target nosuch: unknown target 'nosuch'" in capsys.readouterr().err
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", "hidden_size": 64,')
    assert main(["optimize", "--model", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"--model {broken}: {broken} is not valid JSON: Expecting property name" in err
    assert "Traceback" not in err
    broken.write_text('{"hidden_size": 64}')
    assert main(["optimize", "--model", str(broken)]) == 2
    assert 'has no "model_type": not a Hugging Face model config' in capsys.readouterr().err
    broken.write_text('{"model_type": "no-such-arch"}')
    assert main(["optimize", "--model", str(broken)]) == 2
    assert "transformers cannot read this config" in capsys.readouterr().err
    assert main(["optimize", "--model", "llama-tny"]) == 2
    assert "--model llama-tny: neither a models/ name (llama-tiny" in capsys.readouterr().err


def test_bench_serving_checks_its_arguments(tmp_path, capsys):
    bad = tmp_path / "w.json"
    bad.write_text('{"requests": 3}')
    assert main(["bench-serving", "--workload", str(bad)]) == 2
    assert "not a workload" in capsys.readouterr().err
    assert main(["bench-serving", "--model", "gpt-17"]) == 2
    from metainfer import servebench

    assert f"neither a benchmark model ({', '.join(servebench.MODELS)})" in capsys.readouterr().err
