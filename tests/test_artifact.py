"""Kernel artifacts and check bundles as files: what ``KernelArtifact.save`` and
``souffle.compiler.export_check`` write loads back equal, and every damaged or malformed file is
refused by ``KernelArtifact.load`` or ``Check.load`` with a SouffleError naming the file; the
launcher refuses inputs of the wrong shape or dtype before anything reaches the GPU.

The cases are made from one real bundle (mmoe, tiny), exported once per module.
"""

import json
import re
import shutil

import numpy as np
import pytest

import souffle
from souffle import models
from souffle.errors import InputError, SouffleError
from souffle.graph import GraphBuilder
from souffle.runtime.artifact import KernelArtifact, Launcher
from souffle.runtime.check import Check


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The compiled model and the directory of its check bundle."""
    from souffle.compiler import export_check

    directory = tmp_path_factory.mktemp("bundle") / "mmoe"
    return export_check("mmoe", "tiny", directory, archs=()), directory


@pytest.fixture
def exported(export):
    return export[1]


@pytest.fixture
def bundle(exported, tmp_path):
    """A fresh copy of the exported bundle, to damage."""
    return shutil.copytree(exported, tmp_path / "mmoe")


def _refused(load, directory, file, problem):
    """``load(directory)`` raises a SouffleError that names ``file`` of ``directory`` and says ``problem``."""
    with pytest.raises(SouffleError) as caught:
        load(directory)
    message = str(caught.value)
    assert str(directory / file) in message or f"{directory} is an incomplete" in message and file in message, message
    assert re.search(problem, message), message
    return caught.value


def _edit_manifest(directory, change):
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------------------------
# what is written loads back


def test_the_exported_bundle_loads_back(exported):
    check = Check.load(exported)
    artifact = check.artifact
    assert (artifact.model, artifact.config, sorted(artifact.cubins)) == ("mmoe", "tiny", ["sm_90"])
    assert artifact.cubins["sm_90"][:4] == b"\x7fELF"
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert set(manifest["cubins"]) == {"sm_90"} and len(manifest["source_sha256"]) == 64
    inputs = models.make_inputs("mmoe", "tiny", seed=1)
    assert [slot.name for slot in artifact.inputs] == list(inputs)
    for given, (name, array) in zip(check.inputs, inputs.items()):
        np.testing.assert_array_equal(given, array)
    assert [(e.shape, str(e.dtype)) for e in check.expected] == [(s.shape, s.dtype) for s in artifact.outputs]
    assert (check.rtol, check.atol) == models.tolerance("mmoe", "tiny")


def test_save_then_load_is_the_same_artifact(exported, tmp_path):
    artifact = KernelArtifact.load(exported)
    assert KernelArtifact.load(artifact.save(tmp_path / "again")) == artifact


def test_artifact_of_several_kernels_builds_cubins_for_other_archs():
    """Below O3 every stage is a kernel of its own; a cubin for another arch is built for all of them."""
    b = GraphBuilder("two")
    graph = b.build(b.op("tanh", b.op("relu", b.input("x", (64, 256)), name="y"), name="z"))
    artifact = souffle.compile(graph, target="cuda", opt_level=0).artifact(archs=("sm_80",))
    assert len(artifact.kernels) == 2
    assert sorted(artifact.cubins) == ["sm_80", "sm_90"] and artifact.cubins["sm_80"][:4] == b"\x7fELF"


# ---------------------------------------------------------------------------------------------
# the manifest


@pytest.mark.parametrize("content, problem", [
    (b"", "empty file, expected JSON"),
    (b"   \n", "empty file, expected JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", r"not valid JSON \(not UTF-8 text\)"),
    (b"{not json", r"not valid JSON \(Expecting property name"),
    (b"[1, 2]", "expected an object, got a list"),
], ids=["empty", "blank", "binary", "garbage", "a list"])
def test_a_malformed_manifest_is_refused(bundle, content, problem):
    (bundle / "manifest.json").write_bytes(content)
    _refused(KernelArtifact.load, bundle, "manifest.json", problem)


def test_a_truncated_manifest_is_refused(bundle):
    path = bundle / "manifest.json"
    path.write_bytes(path.read_bytes()[:200])
    _refused(KernelArtifact.load, bundle, "manifest.json", r"not valid JSON \(.*: line \d+ column \d+\): truncated")


def test_a_missing_manifest_is_refused(bundle):
    (bundle / "manifest.json").unlink()
    with pytest.raises(SouffleError, match=f"{re.escape(str(bundle))} is not a kernel artifact: no manifest.json"):
        KernelArtifact.load(bundle)


def _set(path, value):
    """An edit of the manifest: the value at ``path`` (keys and indices) set to ``value``."""
    def change(manifest):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        manifest[last] = value
    return change


def _delete(*path):
    def change(manifest):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        del manifest[last]
    return change


@pytest.mark.parametrize("change, problem", [
    (_delete("format_version"), r"no format_version \(an artifact from before versions\); this souffle reads "
                                r"version 2: export the artifact again"),
    (_set(["format_version"], 3), "format_version 3; this souffle reads version 2"),
    (_delete("threads"), "missing key 'threads'"),
    (_delete("inputs", 0, "dtype"), r"inputs\[0\]: missing key 'dtype'"),
    (_set(["extra"], 1), "unexpected key 'extra'"),
    (_set(["launches", 0, "grid"], 4), r"launches\[0\]: unexpected key 'grid'"),
    (_set(["threads"], "256"), 'threads: expected an integer of at least 32, got a string "256"'),
    (_set(["threads"], 100), "threads: expected a multiple of 32 up to 1024, got 100"),
    (_set(["seed"], True), "seed: expected an integer of at least 0, got a boolean true"),
    (_set(["model"], None), "model: expected a non-empty string, got null"),
    (_set(["kernels"], []), "kernels: expected an object, got a list"),
    (_set(["inputs", 0, "shape"], [1, "10"]),
     r'inputs\[0\].shape\[1\]: expected an integer of at least 1, got a string "10"'),
    (_set(["inputs", 0, "shape"], [1, 0]),
     r"inputs\[0\].shape\[1\]: expected an integer of at least 1, got an integer 0"),
    (_set(["outputs", 1, "dtype"], "float13"),
     r'outputs\[1\].dtype: expected one of float32, .*got a string "float13"'),
    (_set(["arenas", "arena_float32"], ["float32"]), r"arenas.arena_float32: expected \[dtype, elements\]"),
    (_set(["launches", 0, "cooperative"], 0),
     r"launches\[0\].cooperative: expected true or false, got an integer 0"),
    (_set(["launches", 0, "kernel"], "other_kernel"),
     r"launches\[0\].kernel: 'other_kernel' is not one of the kernels"),
    (_set(["launches", 0, "min_grid"], 2), r"launches\[0\].min_grid: 2 is more than max_tiles 1"),
    (_set(["inputs", 0, "buffer"], "y"), r"launches\[0\]: kernel 'main_kernel' takes 'x', which no input, output, "
                                         "weight, arena or enclosing loop provides"),
    (_set(["outputs", 1, "buffer"], "x"), r"buffers \(inputs, outputs, weights and arenas\): 'x' named more than once"),
    (_set(["weights", 0, "recipe"], ["model"]), r"weights\[0\].recipe: not a weight recipe"),
    (_set(["weights", 0, "recipe", 2, 1], ["take", 0, [0], ["nope", 1]]),
     r"weights\[0\].recipe\[2\]\[1\]\[3\]: not a weight recipe"),
    (_set(["source_sha256"], "abc"), "source_sha256: expected a SHA-256 of 64 lowercase hex digits"),
    (_set(["cubins"], {"../../x": "0" * 64}), "cubins: '../../x' is not a CUDA arch like 'sm_90'"),
], ids=["no version", "newer version", "missing key", "missing slot key", "extra key", "extra launch key",
        "threads a string", "threads not warps", "seed a boolean", "model null", "kernels a list", "shape of strings",
        "empty dimension", "unknown dtype", "short arena", "cooperative an int", "unknown kernel", "min grid too wide",
        "unbound parameter", "buffer twice", "bad recipe", "bad nested recipe", "bad digest", "arch not an arch"])
def test_a_manifest_of_the_wrong_schema_is_refused(bundle, change, problem):
    _edit_manifest(bundle, change)
    _refused(KernelArtifact.load, bundle, "manifest.json", problem)


def test_artifact_errors_are_souffle_value_errors(bundle):
    from souffle.runtime.artifact import ArtifactError

    _edit_manifest(bundle, _delete("threads"))
    error = _refused(KernelArtifact.load, bundle, "manifest.json", "missing key")
    assert isinstance(error, ArtifactError) and isinstance(error, ValueError)


# ---------------------------------------------------------------------------------------------
# the kernel's files


@pytest.mark.parametrize("file", ["kernel.cu", "kernel.sm_90.cubin"])
def test_a_missing_kernel_file_is_refused(bundle, file):
    (bundle / file).unlink()
    _refused(KernelArtifact.load, bundle, file, f"is an incomplete kernel artifact: {re.escape(file)} is missing")


@pytest.mark.parametrize("file, damage", [
    ("kernel.sm_90.cubin", lambda data: data[:100]),
    ("kernel.sm_90.cubin", lambda data: b""),
    ("kernel.sm_90.cubin", lambda data: data[:-1] + bytes([data[-1] ^ 1])),
    ("kernel.cu", lambda data: data.replace(b"main_kernel", b"main_kernal", 1)),
    ("kernel.cu", lambda data: data[: len(data) // 2]),
], ids=["truncated cubin", "empty cubin", "one bit of the cubin", "edited source", "truncated source"])
def test_a_kernel_file_that_does_not_match_its_hash_is_refused(bundle, file, damage):
    path = bundle / file
    path.write_bytes(damage(path.read_bytes()))
    _refused(KernelArtifact.load, bundle, file, r"its SHA-256 is not the one manifest.json records \(\d+ bytes\): "
                                                "the file was changed or truncated after export")


def test_a_cubin_hash_edited_in_the_manifest_is_refused(bundle):
    _edit_manifest(bundle, _set(["cubins", "sm_90"], "0" * 64))
    _refused(KernelArtifact.load, bundle, "kernel.sm_90.cubin", "its SHA-256 is not the one manifest.json records")


# ---------------------------------------------------------------------------------------------
# the check bundle's files


@pytest.mark.parametrize("file", ["check.json", "inputs.npz", "expected.npz"])
def test_a_missing_check_file_is_refused(bundle, file):
    (bundle / file).unlink()
    _refused(Check.load, bundle, file, f"is an incomplete check bundle: {re.escape(file)} is missing")


@pytest.mark.parametrize("file", ["inputs.npz", "expected.npz"])
@pytest.mark.parametrize("damage, problem", [
    (lambda data: data[: len(data) // 2], r"not a readable .npz archive \(File is not a zip file\): truncated"),
    (lambda data: b"", r"not an .npz archive \(no zip header\)"),
    (lambda data: data[:60] + bytes([data[60] ^ 0xFF]) + data[61:], r"not a readable .npz archive"),
], ids=["truncated", "empty", "a flipped byte"])
def test_a_damaged_npz_is_refused(bundle, file, damage, problem):
    path = bundle / file
    path.write_bytes(damage(path.read_bytes()))
    _refused(Check.load, bundle, file, problem)


def test_an_npy_in_place_of_an_npz_is_refused(bundle):
    np.save(bundle / "inputs.npy", np.zeros((1, 10), np.float32))
    (bundle / "inputs.npy").rename(bundle / "inputs.npz")
    _refused(Check.load, bundle, "inputs.npz", r"not an .npz archive \(no zip header\)")


@pytest.mark.parametrize("arrays, problem", [
    ({"x": np.zeros((10, 1), np.float32)}, r"array 'x' is \(10, 1\) float32, but input 'x' is \(1, 10\) float32"),
    ({"x": np.zeros((1, 10), np.float64)}, r"array 'x' is \(1, 10\) float64, but input 'x' is \(1, 10\) float32"),
    ({"y": np.zeros((1, 10), np.float32)}, r"no array 'x' \(of 1 inputs\)"),
    ({"x": np.zeros((1, 10), np.float32), "y": np.zeros(1)}, "array 'y' is no input of the artifact"),
], ids=["wrong shape", "wrong dtype", "missing input", "extra array"])
def test_inputs_that_do_not_fit_the_slots_are_refused(bundle, arrays, problem):
    np.savez(bundle / "inputs.npz", **arrays)
    _refused(Check.load, bundle, "inputs.npz", problem)


@pytest.mark.parametrize("arrays, problem", [
    ([np.zeros((1, 1), np.float32)], r"no array 'arr_1' \(of 2 outputs\)"),
    ([np.zeros((1, 1), np.float32), np.zeros((1,), np.float32)],
     r"array 'arr_1' is \(1,\) float32, but output 'task_1' is \(1, 1\) float32"),
], ids=["missing output", "wrong shape"])
def test_expected_outputs_that_do_not_fit_the_slots_are_refused(bundle, arrays, problem):
    np.savez(bundle / "expected.npz", *arrays)
    _refused(Check.load, bundle, "expected.npz", problem)


@pytest.mark.parametrize("content, problem", [
    (b'{"rtol": 1e-5, "atol"', r"not valid JSON"),
    (b"", "empty file"),
    (b'{"rtol": "1e-5", "atol": 0, "report": ""}', 'rtol: expected a finite non-negative number, got a string "1e-5"'),
    (b'{"rtol": NaN, "atol": 0, "report": ""}', "rtol: expected a finite non-negative number"),
    (b'{"rtol": 0, "atol": 0}', "missing key 'report'"),
    (b'{"rtol": 0, "atol": 0, "report": "", "seed": 1}', "unexpected key 'seed'"),
], ids=["truncated", "empty", "rtol a string", "rtol NaN", "missing key", "extra key"])
def test_a_malformed_check_json_is_refused(bundle, content, problem):
    (bundle / "check.json").write_bytes(content)
    _refused(Check.load, bundle, "check.json", problem)


# ---------------------------------------------------------------------------------------------
# the launcher's inputs


class _Buffer:
    def download(self, dtype, shape):
        return np.zeros(shape, dtype)


class _RecordingDevice:
    """What the launcher uses of a Device and its kernels; records every call."""

    def __init__(self):
        self.calls = []

    def upload(self, array):
        self.calls.append(("upload", array.shape))
        return _Buffer()

    def alloc(self, nbytes):
        self.calls.append("alloc")
        return _Buffer()

    def synchronize(self):
        self.calls.append("synchronize")

    def prepare(self, grid, threads, args, cooperative, shared_bytes, stream=None):
        self.calls.append("prepare")
        return lambda: self.calls.append("launch")


def _launcher(artifact) -> tuple[Launcher, _RecordingDevice]:
    """A launcher of ``artifact`` on a recording device, without a GPU: the parts that run() uses."""
    device = _RecordingDevice()
    launcher = Launcher.__new__(Launcher)
    launcher.artifact = artifact
    launcher.device = device
    launcher.resident = {name: _Buffer() for name in [w["buffer"] for w in artifact.weights] + list(artifact.arenas)}
    launcher.kernels = {name: device for name in artifact.kernels}
    launcher.grids = {name: 1 for name in artifact.kernels}
    return launcher, device


@pytest.mark.parametrize("given, problem", [
    (np.zeros((10, 1), np.float32), r"input 'x' needs \(1, 10\) float32, got \(10, 1\) float32"),
    (np.zeros(10, np.float32), r"input 'x' needs \(1, 10\) float32, got \(10,\) float32"),
    (np.zeros((1, 10), np.float16), r"input 'x' needs \(1, 10\) float32, got \(1, 10\) float16"),
], ids=["transposed", "flat", "float16"])
def test_the_launcher_refuses_an_input_of_the_wrong_shape_or_dtype_before_any_driver_call(exported, given, problem):
    launcher, device = _launcher(KernelArtifact.load(exported))
    with pytest.raises(InputError, match=problem):
        launcher.run([given])
    assert device.calls == []
    outputs = launcher.run([np.zeros((1, 10), np.float32)])
    assert device.calls == [("upload", (10,)), "alloc", "alloc", "prepare", "launch", "synchronize"]
    assert [o.shape for o in outputs] == [(1, 1), (1, 1)]


def test_a_compiled_model_gives_the_launcher_its_inputs_in_their_shapes(export, monkeypatch):
    model, _ = export
    launcher, device = _launcher(model.artifact())
    monkeypatch.setattr(model, "_gpu", launcher)
    model(**models.make_inputs("mmoe", "tiny"))
    assert device.calls[0] == ("upload", (10,)) and "launch" in device.calls


def test_a_check_counts_the_elements_outside_its_tolerance_and_the_worst_excess():
    from souffle.runtime.check import Check

    expected = np.array([1.0, 2.0, -4.0, 0.0], dtype=np.float32)
    check = Check(None, [], [expected], rtol=0.1, atol=0.05)  # bounds 0.15, 0.25, 0.45, 0.05
    assert check.outside([expected + np.float32(0.01)]) == (0, pytest.approx(-0.04))
    count, worst = check.outside([np.array([1.2, 2.0, -4.0, 0.06], dtype=np.float32)])
    assert (count, worst) == (2, pytest.approx(0.05, abs=1e-6)) and not check.passes([expected + 0.2])
    assert check.outside([np.array([1.0, np.nan, -4.0, 0.0], dtype=np.float32)]) == (1, np.inf)
