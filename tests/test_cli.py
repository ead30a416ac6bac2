import json

import pytest

from souffle.cli import main


def test_compile_check_prints_the_report(capsys):
    assert main(["compile", "mmoe", "--check", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "kernels        1" in out
    assert "check          PASS" in out
    assert "max abs error" in out


def test_compile_json_report(capsys):
    assert main(["compile", "lstm", "--json", "--repeat", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "lstm" and report["kernels"] == 1 and report["loops"] >= 2
    assert report["run_seconds"] > 0


def test_explain_prints_graph_and_te_program(capsys):
    assert main(["compile", "mmoe", "--explain", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph mmoe(") and "TE program mmoe" in out


@pytest.mark.parametrize("argv, message", [
    (["compile", "gpt5"], "unknown model 'gpt5'; available: lstm, bert, resnext, mmoe"),
    (["compile", "lstm", "--config", "huge"], "'huge'"),
    (["compile", "lstm", "--target", "tpu"], "unknown target 'tpu'"),
])
def test_bad_arguments_exit_2_with_a_reason(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("souffle: error: ") and message in err
