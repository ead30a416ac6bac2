import json

import pytest

from codegen.pipelines import CUDA, LLVM
from souffle.cli import main
from souffle.errors import TargetError
from souffle.runtime.cuda import gpu_available


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
    (["compile", "lstm", "--emit-source", "x.cu"], "--emit-source writes CUDA source: it needs --target cuda"),
    (["compile", "mmoe", "--target", "cuda", "--device", "cpu", "--no-run"], "needs a GPU device model"),
    (["compile", "mmoe", "--target", "llvm-persistent", "--opt-level", "7"], "opt level must be one of 0, 1, 2, 3, 4"),
    (["compile", "mmoe", "--opt-level", "2"], "opt levels are the persistent kernel's"),
    (["compile", "mmoe", "--print-after", "fusion"], "cannot print after 'fusion': target 'llvm' has no such pass"),
    (["compile", "mmoe", "--target", "cuda", "--opt-level", "1", "--print-after", "vertical"],
     "cannot print after 'vertical': it runs from opt level 2, and this compile is at O1"),
    (["passes", "--target", "tpu"], "unknown target 'tpu'"),
    (["compile", "mmoe", "--repeat", "0"], "--repeat is the number of timed runs: it must be at least 1, got 0"),
    (["compile", "mmoe", "--seed", "-1"],
     "seed must be a non-negative integer (numpy's random generator takes no other), got -1"),
    (["compile", "bert", "--config", '{"layerz": 2}'], "unknown config key 'layerz' for model 'bert'; allowed keys: "),
])
def test_bad_arguments_exit_2_with_a_reason(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("souffle: error: ") and message in err


def test_cuda_compile_without_running_prints_the_kernel_report(capsys, tmp_path):
    source = tmp_path / "mmoe.cu"
    assert main(["compile", "mmoe", "--target", "cuda", "--no-run", "--emit-source", str(source)]) == 0
    out = capsys.readouterr().out
    assert "kernels        1" in out and "co-residency   h200:" in out and "grid barriers  0 (0 executed)" in out
    assert source.read_text().count("__global__") == 2  # one kernel: its declaration and definition
    assert "latency model  h200: " in out and "(a static model, not a measurement)" in out
    assert "roofline bound " in out and "slowest stages " in out


def test_cuda_report_estimates_on_the_chosen_device(capsys):
    assert main(["compile", "mmoe", "--target", "cuda", "--no-run", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "co-residency   h100:" in out and "latency model  h100: " in out and " on h100 (the estimate is " in out


def test_emit_source_that_cannot_be_written_is_refused_before_compiling(capsys, tmp_path, monkeypatch):
    import souffle

    monkeypatch.setattr(souffle, "compile", lambda *args, **kwargs: pytest.fail("compiled before refusing"))
    missing = tmp_path / "missing" / "x.cu"
    assert main(["compile", "mmoe", "--target", "cuda", "--no-run", "--emit-source", str(missing)]) == 2
    assert capsys.readouterr().err == (f"souffle: error: --emit-source {missing}: "
                                       f"directory '{missing.parent}' does not exist\n")
    assert main(["compile", "mmoe", "--target", "cuda", "--no-run", "--emit-source", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"souffle: error: --emit-source {tmp_path}: is a directory, not a file\n"


@pytest.mark.skipif(gpu_available(), reason="checks the behaviour on a machine without a GPU")
def test_cuda_run_without_a_gpu_exits_2_with_the_reason(capsys):
    assert main(["compile", "mmoe", "--target", "cuda"]) == 2
    assert "target 'cuda' needs an NVIDIA GPU and driver" in capsys.readouterr().err


def test_a_cuda_run_reports_its_cuda_graph_replays_beside_the_direct_launches_or_why_not(monkeypatch, capsys):
    """Timed per call, the direct launches include the host's launch cost; the report also gives
    the inference replayed from a CUDA graph (the GPU's own run stood in for here)."""
    from souffle.cuda_model import CudaModel

    monkeypatch.setattr(CudaModel, "run", lambda self, inputs: [])
    monkeypatch.setattr(CudaModel, "benchmark",
                        lambda self, inputs, repeat, graph=False: [2e-5 if graph else 3e-5] * repeat)
    assert main(["compile", "mmoe", "--target", "cuda", "--device", "h100", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "min 0.030 ms, max 0.030 ms over 3 runs" in out
    assert "median 0.020 ms over 3 replays (the launches in one call: the host's launch cost left out)" in out

    def uncapturable(self, inputs, repeat, graph=False):
        if graph:
            raise TargetError("one inference cannot be captured in a CUDA graph: launch failed: CUDA_ERROR_X")
        return [3e-5] * repeat

    monkeypatch.setattr(CudaModel, "benchmark", uncapturable)
    assert main(["compile", "mmoe", "--target", "cuda", "--device", "h100", "--repeat", "3"]) == 0
    assert "not run: one inference cannot be captured in a CUDA graph: launch failed: CUDA_ERROR_X" in \
        capsys.readouterr().out


def test_persistent_cpu_target_checks_against_pytorch(capsys):
    assert main(["compile", "lstm", "--target", "llvm-persistent", "--threads", "32", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS" in out and "32 threads per block" in out


def test_analyze_prints_a_row_per_te_and_a_summary(capsys):
    assert main(["analyze", "lstm"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["TE", "op", "runs", "deps"]
    assert "layers/time/dense_2.T_matmul_NT" in out and "1:many" in out
    assert "lstm on h200: 46 TEs" in out


def test_analyze_json_for_tools(capsys):
    assert main(["analyze", "mmoe", "--device", "a100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summary"]["device"] == "a100"
    assert len(result["stages"]) == result["summary"]["tes"]
    assert {"name", "op", "inputs", "flops", "bytes_read", "intensity", "bound"} <= set(result["stages"][0])


@pytest.mark.parametrize("argv, message", [
    (["analyze", "lstm", "--device", "tpu"], "unknown device 'tpu'; known devices: h200, h100, a100, cpu"),
    (["analyze", "gpt5"], "unknown model 'gpt5'"),
])
def test_analyze_refuses_unknown_names(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_opt_level_zero_is_one_kernel_per_te_and_still_checks(capsys):
    assert main(["compile", "mmoe", "--target", "llvm-persistent", "--opt-level", "0", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "opt level      O0: one kernel per TE" in out and "kernels        58" in out
    assert "launches       58 kernel launches per inference" in out and "check          PASS" in out


def test_default_opt_level_reports_its_transformations(capsys):
    assert main(["compile", "lstm", "--target", "llvm-persistent", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "opt level      O4: + post-optimizations" in out and "launches       1 kernel launch per inference" in out
    assert "transform 1    wavefront: lstm: 3 layers x 5 steps -> one wavefront scan of 7 steps" in out
    assert "on chip 1      weight (read by wavefront_step_r0/gate_product+state_next" in out
    assert "partition      1 kernel: every stage co-resident" in out and "check          PASS" in out


@pytest.mark.parametrize("target, pipeline", [("cuda", CUDA), ("llvm", LLVM)])
def test_dump_ir_writes_one_file_per_pass_in_pipeline_order(capsys, tmp_path, target, pipeline):
    assert main(["compile", "bert", "--config", "tiny", "--target", target, "--no-run", "--dump-ir", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.graph.txt"] + [pipeline.dump_name(p) for p in pipeline.passes]
    assert (tmp_path / "00-input.graph.txt").read_text().startswith("graph bert(")
    lower = next(p for p in pipeline.passes if p.name == "lower")
    assert "TE program bert" in (tmp_path / pipeline.dump_name(lower)).read_text()
    if target == "cuda":
        dumped = {p.name: tmp_path / pipeline.dump_name(p) for p in pipeline.passes}
        assert "__global__" in dumped["cuda_source"].read_text()
        assert dumped["place_barriers"].read_text().startswith("staged program bert")


def test_print_after_prints_that_pass_ir(capsys):
    assert main(["compile", "mmoe", "--target", "llvm-persistent", "--no-run", "--print-after", "place_barriers"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("-- IR after place_barriers (staged) --\nstaged program mmoe: ")
    assert "\nmodel          mmoe (target llvm-persistent)" in out


def test_passes_prints_each_targets_pipeline(capsys):
    assert main(["passes", "--target", "cuda"]) == 0
    assert capsys.readouterr().out == CUDA.describe() + "\n"


def test_a_json_config_overrides_tiny(capsys):
    config = '{"batch": 2, "attention_mask": "int64", "token_type_ids": true}'
    assert main(["compile", "bert", "--config", config, "--check", "--repeat", "1"]) == 0
    assert "check          PASS" in capsys.readouterr().out


def test_a_config_that_is_not_json_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "bert", "--config", '{"layers": 2'])
    assert exit_info.value.code == 2
    assert "argument --config: not a JSON object of config overrides" in capsys.readouterr().err
