"""The CUDA runtime: nvcc compilation and its cache, the ptxas report, the driver and launches, and
the refusal of bad arguments (sizes, kernel arguments, an artifact's inputs) before any driver call.

The default suite needs nvcc but no GPU; the ``gpu`` tests run a grid-synced kernel for real
(``pytest -m gpu`` on a machine with an NVIDIA GPU and cuda-bindings).
"""

import gc
import hashlib
import json
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from souffle import recipe
from souffle.errors import InputError, SouffleError, TargetError
from souffle.runtime import cuda
from souffle.runtime.artifact import KernelArtifact, TensorSlot
from souffle.runtime.cuda import KernelResources, compile_cubin, parse_resource_usage

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

# Stage 1 doubles the input, the grid syncs, stage 2 reads a neighbour that another block
# may have written: right only if every block finished stage 1 first.
TWO_STAGE = r"""
#include <cooperative_groups.h>

extern "C" __global__ void main_kernel(const float* __restrict__ in, float* out, float* out2, int n) {
  int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = in[i] * 2.0f;
  cooperative_groups::this_grid().sync();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out2[i] = out[(i + 1) % n];
}
"""

SCALE = r"""
extern "C" __global__ void scale(const float* in, float* out, float alpha, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * alpha;
}
"""


# ---------------------------------------------------------------------------------------------
# the ptxas report


def test_parse_resources_all_parts():
    text = textwrap.dedent("""\
        ptxas info    : Function properties for main_kernel
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 32 registers, used 1 barriers, 96 bytes smem, 400 bytes cmem[0]
        """)
    assert parse_resource_usage(text, "sm_80") == KernelResources("sm_80", 32, 96, 0, 0, 1)


def test_parse_resources_parts_left_out_are_zero():
    # nvcc 13 for sm_90: no smem part when there is no static shared memory.
    text = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function 'main_kernel' for 'sm_90'
        ptxas info    : Function properties for main_kernel
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 32 registers, used 1 barriers
        ptxas info    : Compile time = 28.886 ms
        """)
    assert parse_resource_usage(text, "sm_90") == KernelResources("sm_90", 32, 0, 0, 0, 1)
    only_registers = "ptxas info    : Function properties for main_kernel\nptxas info    : Used 10 registers, 352 bytes cmem[0]\n"
    assert parse_resource_usage(only_registers, "sm_80") == KernelResources("sm_80", 10, 0, 0, 0, 0)


def test_parse_resources_picks_the_named_kernel():
    text = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function 'other' for 'sm_90'
        ptxas info    : Function properties for other
            8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 255 registers, used 0 barriers, 1024 bytes smem, 368 bytes cmem[0]
        ptxas info    : Compiling entry function 'main_kernel' for 'sm_90'
        ptxas info    : Function properties for _Z6helperPf
            16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Function properties for main_kernel
            40 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads
        ptxas info    : Used 168 registers, used 1 barriers, 4096 bytes smem, 380 bytes cmem[0], 8 bytes cmem[2]
        """)
    assert parse_resource_usage(text, "sm_90") == KernelResources("sm_90", 168, 4096, 40, 24, 1)
    assert parse_resource_usage(text, "sm_90", kernel="other") == KernelResources("sm_90", 255, 1024, 8, 4, 0)


def test_parse_resources_missing_kernel():
    text = "ptxas info    : Compiling entry function '_Z11main_kernelPf' for 'sm_90'\nptxas info    : Used 8 registers\n"
    with pytest.raises(TargetError, match="no resource usage for kernel 'main_kernel'.*extern"):
        parse_resource_usage(text, "sm_90")


# ---------------------------------------------------------------------------------------------
# nvcc and the cache


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_and_cache_hit(arch, tmp_path, monkeypatch):
    cubin, resources = compile_cubin(TWO_STAGE, arch, cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    assert resources.arch == arch
    assert resources.registers > 0
    assert resources.barriers >= 1  # the grid sync needs a block barrier
    assert (resources.stack_bytes, resources.spill_bytes) == (0, 0)
    assert len(list(tmp_path.iterdir())) == 2  # the cubin and its resources

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a cache hit ran {args[0]}")

    monkeypatch.setattr(cuda.subprocess, "run", no_subprocess)
    assert compile_cubin(TWO_STAGE, arch, cache_dir=tmp_path) == (cubin, resources)


@needs_nvcc
def test_cache_key_and_default_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SOUFFLE_CACHE_DIR", str(tmp_path))
    compile_cubin(SCALE, "sm_90", kernel="scale")
    compile_cubin(SCALE, "sm_90", kernel="scale")
    assert len(list((tmp_path / "cubin").iterdir())) == 2
    compile_cubin(SCALE + "\n// changed\n", "sm_90", kernel="scale")
    assert len(list((tmp_path / "cubin").iterdir())) == 4


def _only_entry(directory: Path) -> tuple[Path, Path]:
    (meta,) = directory.glob("*.json")
    return meta.with_suffix(".cubin"), meta


@needs_nvcc
@pytest.mark.parametrize("damage", ["truncated cubin", "empty cubin", "truncated json", "garbage json",
                                    "json of a list", "tampered registers", "missing cubin"])
def test_an_entry_that_does_not_verify_is_rebuilt(tmp_path, damage):
    good = compile_cubin(SCALE, "sm_90", kernel="scale", cache_dir=tmp_path)
    cubin_path, meta_path = _only_entry(tmp_path)
    if damage == "truncated cubin":
        cubin_path.write_bytes(good[0][:100])
    elif damage == "empty cubin":
        cubin_path.write_bytes(b"")
    elif damage == "truncated json":
        meta_path.write_bytes(meta_path.read_bytes()[:40])
    elif damage == "garbage json":
        meta_path.write_bytes(b"\xff\xfe not json")
    elif damage == "json of a list":
        meta_path.write_text("[1, 2]")
    elif damage == "tampered registers":
        meta = json.loads(meta_path.read_text())
        meta["resources"]["registers"] = 1
        meta_path.write_text(json.dumps(meta))
    else:
        cubin_path.unlink()
    with pytest.warns(cuda.CacheWarning, match=f"nvcc cache entry {re.escape(str(meta_path))} does not verify"):
        rebuilt = compile_cubin(SCALE, "sm_90", kernel="scale", cache_dir=tmp_path)
    assert rebuilt == good
    assert cubin_path.read_bytes() == good[0]
    assert compile_cubin(SCALE, "sm_90", kernel="scale", cache_dir=tmp_path) == good  # verifies now, no warning


@needs_nvcc
def test_a_sealed_entry_of_the_wrong_form_is_rebuilt(tmp_path):
    """An entry whose seal matches but whose resources are not this kernel's is rebuilt, not a TypeError."""
    good = compile_cubin(SCALE, "sm_90", kernel="scale", cache_dir=tmp_path)
    _, meta_path = _only_entry(tmp_path)
    meta = json.loads(meta_path.read_text())
    meta["resources"] = {"registers": "many"}
    sealed = json.dumps({k: meta[k] for k in ("cubin_sha256", "resources")}, sort_keys=True)
    meta["sha256"] = hashlib.sha256(sealed.encode()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(cuda.CacheWarning, match="its resources are not sm_90's arch, registers"):
        assert compile_cubin(SCALE, "sm_90", kernel="scale", cache_dir=tmp_path) == good


@needs_nvcc
def test_an_unwritable_cache_compiles_uncached_and_warns_once(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("SOUFFLE_CACHE_DIR", str(blocker))  # its cubin/ subdirectory cannot be made
    with pytest.warns(cuda.CacheWarning, match=f"nvcc cache {re.escape(str(blocker / 'cubin'))} cannot be written "
                                               ".*compiling without caching") as caught:
        first = compile_cubin(SCALE, "sm_90", kernel="scale")
        second = compile_cubin(SCALE, "sm_90", kernel="scale")
    assert len(caught) == 1
    assert first == second and first[0][:4] == b"\x7fELF"
    assert blocker.read_text() == ""


@needs_nvcc
def test_cubins_are_reproducible_across_caches(tmp_path):
    """nvcc runs in a fresh temporary directory per compile, which line info used to record."""
    one, _ = compile_cubin(TWO_STAGE, "sm_90", cache_dir=tmp_path / "one")
    two, _ = compile_cubin(TWO_STAGE, "sm_90", cache_dir=tmp_path / "two")
    assert one == two
    assert b".nv_debug_line_sass" in one and b"kernel.cu" in one  # line info kept
    assert b"souffle-nvcc-" not in one


@needs_nvcc
def test_compile_error_shows_nvcc_message(tmp_path):
    bad = 'extern "C" __global__ void main_kernel(float* x) {\n  x[0] = undefined_name;\n}\n'
    with pytest.raises(TargetError, match=r"nvcc failed to compile 'main_kernel' for sm_90") as info:
        compile_cubin(bad, "sm_90", cache_dir=tmp_path)
    assert 'kernel.cu(2): error: identifier "undefined_name" is undefined' in str(info.value)
    assert isinstance(info.value, SouffleError)
    assert not any(tmp_path.iterdir())


@needs_nvcc
def test_mangled_kernel_name_is_reported(tmp_path):
    source = "__global__ void main_kernel(float* x) { x[0] = 1.0f; }\n"
    with pytest.raises(TargetError, match="extern \"C\""):
        compile_cubin(source, "sm_90", cache_dir=tmp_path)


@pytest.mark.parametrize("arch", ["sm80", "compute_90", "sm_9", "90", "SM_90", None])
def test_bad_arch(arch, tmp_path):
    with pytest.raises(TargetError, match="bad CUDA arch"):
        compile_cubin(TWO_STAGE, arch, cache_dir=tmp_path)


def test_nvcc_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(TargetError, match="nvcc not found on PATH: install the CUDA toolkit"):
        compile_cubin(TWO_STAGE, "sm_90", cache_dir=tmp_path)
    with pytest.raises(TargetError, match="nvcc not found"):
        cuda.nvcc_version()


@needs_nvcc
def test_nvcc_version():
    assert "Cuda compilation tools" in cuda.nvcc_version()


# ---------------------------------------------------------------------------------------------
# without a GPU


def test_module_imports_without_tvm():
    # Loads souffle.runtime.cuda with tvm made unimportable. The souffle package's own
    # __init__ is bypassed (it imports the TVM compiler); this checks the runtime's imports.
    root = Path(__file__).resolve().parents[1]
    script = textwrap.dedent(f"""
        import sys, types
        class NoTVM:
            def find_spec(self, name, path=None, target=None):
                if name == "tvm" or name.startswith("tvm."):
                    raise ImportError("tvm blocked")
        sys.meta_path.insert(0, NoTVM())
        package = types.ModuleType("souffle")
        package.__path__ = [{str(root / "souffle")!r}]
        sys.modules["souffle"] = package
        import souffle.runtime.cuda
        assert not any(m == "tvm" or m.startswith("tvm.") for m in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_bindings_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(TargetError, match="pip install cuda-bindings"):
        cuda.driver()
    assert cuda.gpu_available() is False


def test_no_gpu_gives_target_error():
    if cuda.gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="target 'cuda' needs an NVIDIA GPU and driver: .+"):
        cuda.driver()
    with pytest.raises(TargetError, match="target 'cuda' needs an NVIDIA GPU and driver"):
        cuda.Device()


# ---------------------------------------------------------------------------------------------
# bad arguments, refused before any driver call (a stand-in driver, no GPU needed)


class FakeDriver:
    """Stands in for cuda-bindings' driver module: every call succeeds (an allocation, a module
    or a function is 0x1000) and is recorded, so a test sees which calls a refusal let through."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=types.SimpleNamespace(value=1))
    CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1)
    HANDLES = ("cuMemAlloc", "cuModuleLoadData", "cuModuleGetFunction", "cuStreamCreate", "cuStreamEndCapture",
               "cuGraphInstantiate")

    def __init__(self, failures: dict | None = None):
        self.calls = []
        self.failures = failures or {}  # call name -> the CUresult it returns, by name

    def cuGetErrorName(self, err):
        return 0, {f"code {k}": name for k, name in enumerate(self.failures.values())}.get(err, "?").encode()

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name in self.failures:
                return (f"code {list(self.failures).index(name)}",)
            return (0, 0x1000) if name in self.HANDLES else (0,)

        return call


class FakeDevice:
    """What DeviceBuffer and Kernel use of a Device, on a FakeDriver."""

    name, arch, sms, cooperative_launch, context = "fake GPU", "sm_90", 1, True, None

    def __init__(self, driver: FakeDriver):
        self.driver = driver

    def _current(self):
        self.driver.cuCtxSetCurrent(self.context)
        return self.driver


@pytest.fixture
def fake_device(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cuda, "_bindings", lambda: driver)
    yield FakeDevice(driver)
    gc.collect()  # free the buffers and modules through the stand-in, not the real driver


@pytest.mark.parametrize("nbytes", [0, -8, 2.5, True])
def test_device_buffer_size_is_refused_before_the_driver(fake_device, nbytes):
    with pytest.raises(InputError, match=f"a device buffer needs a positive whole number of bytes, got {nbytes!r}"):
        cuda.DeviceBuffer(fake_device, nbytes)
    assert fake_device.driver.calls == []


def test_upload_and_download_that_do_not_fit_are_refused(fake_device):
    buffer = cuda.DeviceBuffer(fake_device, 16)
    calls = list(fake_device.driver.calls)
    with pytest.raises(InputError, match="cannot upload 20 bytes into a 16-byte device buffer"):
        buffer.upload(np.zeros(5, np.float32))
    with pytest.raises(InputError, match="cannot download 20 bytes from a 16-byte device buffer"):
        buffer.download(np.float32, (5,))
    assert fake_device.driver.calls == calls
    buffer.upload(np.zeros(4, np.float32))
    assert fake_device.driver.calls[-1] == "cuMemcpyHtoD"


@pytest.mark.parametrize(
    "bad, message",
    [(2**31, "kernel argument 1 = 2147483648 does not fit the int32 it is passed as"),
     (-(2**31) - 1, "kernel argument 1 = -2147483649 does not fit the int32"),
     (np.uint32(2**31), "kernel argument 1 = 2147483648 does not fit the int32"),
     ("0.5", "kernel argument 1 is a str: expected a DeviceBuffer, int or float"),
     (None, "kernel argument 1 is a NoneType")],
)
def test_kernel_arguments_are_refused_before_the_driver(fake_device, bad, message):
    kernel = cuda.Kernel(fake_device, b"cubin", "scale")
    buffer = cuda.DeviceBuffer(fake_device, 16)
    calls = list(fake_device.driver.calls)
    with pytest.raises(InputError, match=message) as err:
        kernel.launch(1, 32, [buffer, bad], cooperative=False)
    assert isinstance(err.value, SouffleError) and isinstance(err.value, ValueError)
    assert fake_device.driver.calls == calls
    kernel.launch(1, 32, [buffer, 7, np.int64(2**40), 0.5], cooperative=False)
    assert fake_device.driver.calls[-1] == "cuLaunchKernel"


def test_a_freed_buffer_is_refused_as_a_kernel_argument(fake_device):
    kernel = cuda.Kernel(fake_device, b"cubin", "scale")
    buffer = cuda.DeviceBuffer(fake_device, 16)
    buffer.free()
    calls = list(fake_device.driver.calls)
    with pytest.raises(TargetError, match="device buffer at 0x1000 was already freed"):
        kernel.launch(1, 32, [buffer], cooperative=False)
    assert fake_device.driver.calls == calls


def test_an_inference_is_captured_in_a_cuda_graph_on_a_stream_of_its_own_and_replayed(fake_device):
    """``Graph``'s driver calls: the launches between the capture's begin and end, one graph
    launch per replay, and the graph, its executable and its stream destroyed with it."""
    kernel = cuda.Kernel(fake_device, b"cubin", "scale")
    buffer = cuda.DeviceBuffer(fake_device, 16)
    launches = [kernel.prepare(1, 32, [buffer, 3], cooperative=False, stream=None)]
    calls = len(fake_device.driver.calls)

    def record(stream):
        assert stream == 0x1000  # the stream cuStreamCreate made
        for launch in launches:
            launch()

    graph = cuda.Graph(fake_device, record)
    graph.launch()
    graph.launch()
    del graph
    gc.collect()
    driver_calls = [c for c in fake_device.driver.calls[calls:] if c != "cuCtxSetCurrent"]
    assert driver_calls == ["cuStreamCreate", "cuStreamBeginCapture", "cuLaunchKernel", "cuStreamEndCapture",
                            "cuGraphInstantiate", "cuGraphLaunch", "cuGraphLaunch", "cuGraphExecDestroy",
                            "cuGraphDestroy", "cuStreamDestroy"]


def test_a_launch_that_cannot_be_captured_is_refused_with_the_drivers_reason(monkeypatch):
    driver = FakeDriver({"cuLaunchKernel": "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                         "cuStreamEndCapture": "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"})
    monkeypatch.setattr(cuda, "_bindings", lambda: driver)
    device = FakeDevice(driver)
    kernel = cuda.Kernel(device, b"cubin", "scale")
    launch = kernel.prepare(4, 32, [7], cooperative=False)
    with pytest.raises(TargetError, match=r"one inference cannot be captured in a CUDA graph: launch of 'scale' "
                                          r"\(4 blocks x 32 threads\) failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        cuda.Graph(device, lambda stream: launch())
    gc.collect()
    assert [c for c in driver.calls if c != "cuCtxSetCurrent"][-3:] == ["cuLaunchKernel", "cuStreamEndCapture",
                                                                         "cuStreamDestroy"]


def _artifact(**fields) -> KernelArtifact:
    """A one-input artifact; the launcher checks its inputs before anything reaches the GPU."""
    defaults = dict(
        model="toy", config=None, seed=0, threads=32, kernels={"main_kernel": ["x", "y", "grid_size"]}, launches=[],
        inputs=[TensorSlot("x", "x", (2, 3), "float32")], outputs=[TensorSlot("y", "y", (2,), "float32")],
        weights=[], arenas={}, source="// kernel", cubins={"sm_90": b"cubin"},
    )
    return KernelArtifact(**{**defaults, **fields})


def test_artifact_inputs_of_the_wrong_count_shape_or_dtype_are_refused():
    artifact = _artifact()
    with pytest.raises(InputError, match=r"toy takes 1 inputs \(x\), got 0"):
        artifact.checked_inputs([])
    with pytest.raises(InputError, match=r"input 'x' needs \(2, 3\) float32, got \(2, 2\) float32"):
        artifact.checked_inputs([np.zeros((2, 2), np.float32)])
    with pytest.raises(InputError, match=r"input 'x' needs \(2, 3\) float32, got \(3, 2\) float32"):
        artifact.checked_inputs([np.zeros((3, 2), np.float32)])  # the right size, read in the wrong order
    with pytest.raises(InputError, match=r"got \(2, 3\) float64"):
        artifact.checked_inputs([np.zeros((2, 3))])
    (flat,) = artifact.checked_inputs([np.arange(6, dtype=np.float32).reshape(3, 2).T])
    np.testing.assert_array_equal(flat, [0, 2, 4, 1, 3, 5])
    assert flat.flags.c_contiguous


@pytest.mark.parametrize("missing", ["kernel.cu", "kernel.sm_90.cubin"])
def test_incomplete_artifact_is_refused(tmp_path, missing):
    directory = _artifact().save(tmp_path / "toy")
    (directory / missing).unlink()
    with pytest.raises(SouffleError, match=f"is an incomplete kernel artifact: .*{missing} is missing"):
        KernelArtifact.load(directory)


def test_weight_recipe_indexing_past_a_given_weight_is_refused():
    artifact = _artifact(weights=[{"buffer": "w", "recipe": recipe.take(recipe.model("w0"), [5]), "shape": [1],
                                   "dtype": "float32"}])
    with pytest.raises(SouffleError, match="weight 'w': cannot be rebuilt from the given weights: index 5"):
        artifact.weight_arrays({"w0": np.zeros(3, np.float32)})


# ---------------------------------------------------------------------------------------------
# on a GPU


@pytest.fixture(scope="module")
def device():
    return cuda.Device(0)


@pytest.fixture(scope="module")
def two_stage(device, tmp_path_factory):
    cubin, _ = compile_cubin(TWO_STAGE, device.arch, cache_dir=tmp_path_factory.mktemp("cubin"))
    return cuda.Kernel(device, cubin)


@pytest.mark.gpu
def test_device_attributes(device):
    assert cuda.gpu_available()
    assert device.name and device.sms > 0
    assert device.arch.startswith("sm_") and device.arch[3:].isdigit()
    assert device.cooperative_launch is True


@pytest.mark.gpu
def test_buffer_round_trip(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    buffer = device.upload(x)
    assert buffer.nbytes == x.nbytes
    np.testing.assert_array_equal(buffer.download(np.float32, (3, 4)), x)
    with pytest.raises(InputError, match="cannot download"):
        buffer.download(np.float32, (4, 4))
    buffer.free()
    with pytest.raises(TargetError, match="already freed"):
        buffer.download(np.float32, (3, 4))


@pytest.mark.gpu
def test_two_stage_grid_sync_at_max_grid(device, two_stage, rng):
    threads = 256
    per_sm = two_stage.max_active_blocks_per_sm(threads)
    grid = device.sms * per_sm
    n = grid * threads * 3 + 17  # several grid-stride rounds, the last one partial
    x = rng.standard_normal(n).astype(np.float32)
    inp, out, out2 = device.upload(x), device.alloc(x.nbytes), device.alloc(x.nbytes)
    two_stage.launch(grid, threads, [inp, out, out2, n])
    device.synchronize()
    doubled = out.download(np.float32, n)
    np.testing.assert_array_equal(doubled, x * 2)
    np.testing.assert_array_equal(out2.download(np.float32, n), np.roll(doubled, -1))


@pytest.mark.gpu
def test_a_cooperative_launch_replayed_from_a_cuda_graph_syncs_its_grid(device, two_stage, rng):
    threads = 256
    grid = device.sms * two_stage.max_active_blocks_per_sm(threads)
    n = grid * threads * 2 + 5
    x = rng.standard_normal(n).astype(np.float32)
    inp, out, out2 = device.upload(x), device.alloc(x.nbytes), device.alloc(x.nbytes)
    graph = cuda.Graph(device, lambda stream: two_stage.prepare(grid, threads, [inp, out, out2, n], stream=stream)())
    out2.fill(0xFF)  # capturing ran nothing: the replay writes it
    device.synchronize()  # the graph's stream does not wait for the default stream's memset
    graph.launch()
    device.synchronize()
    np.testing.assert_array_equal(out2.download(np.float32, n), np.roll(x * 2, -1))
    times = cuda.time_kernel(graph.launch, device, warmup=2, repeat=5, stream=graph.stream)
    assert len(times) == 5 and all(t > 0 for t in times)


@pytest.mark.gpu
def test_oversized_cooperative_grid_is_refused_before_launch(device, two_stage):
    threads = 256
    per_sm = two_stage.max_active_blocks_per_sm(threads)
    grid = device.sms * per_sm + 1
    n = 1024
    zeros = np.zeros(n, np.float32)
    inp, out, out2 = device.upload(np.ones(n, np.float32)), device.upload(zeros), device.upload(zeros)
    expected = f"grid of {grid} blocks cannot be co-resident: {device.sms} SMs x {per_sm} blocks/SM = {grid - 1}"
    with pytest.raises(TargetError, match=expected):
        two_stage.launch(grid, threads, [inp, out, out2, n])
    device.synchronize()
    np.testing.assert_array_equal(out.download(np.float32, n), zeros)


@pytest.mark.gpu
def test_plain_launch_with_float_argument(device, tmp_path, rng):
    cubin, _ = compile_cubin(SCALE, device.arch, kernel="scale", cache_dir=tmp_path)
    kernel = cuda.Kernel(device, cubin, "scale")
    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    inp, out = device.upload(x), device.alloc(x.nbytes)
    kernel.launch((n + 127) // 128, 128, [inp, out, 0.5, n], cooperative=False)
    device.synchronize()
    np.testing.assert_array_equal(out.download(np.float32, n), x * np.float32(0.5))
    with pytest.raises(InputError, match="kernel argument 2 is a str"):
        kernel.launch(1, 128, [inp, out, "0.5", n], cooperative=False)


@pytest.mark.gpu
def test_unknown_kernel_name(device, tmp_path):
    cubin, _ = compile_cubin(SCALE, device.arch, kernel="scale", cache_dir=tmp_path)
    with pytest.raises(TargetError, match=r"cuModuleGetFunction\('nope'\) failed: CUDA_ERROR_NOT_FOUND"):
        cuda.Kernel(device, cubin, "nope")


@pytest.mark.gpu
def test_time_kernel(device, two_stage):
    threads = 256
    grid = device.sms * two_stage.max_active_blocks_per_sm(threads)
    n = 1 << 20
    inp, out, out2 = device.alloc(4 * n), device.alloc(4 * n), device.alloc(4 * n)
    times = cuda.time_kernel(lambda: two_stage.launch(grid, threads, [inp, out, out2, n]), device, warmup=2, repeat=7)
    assert len(times) == 7
    assert all(isinstance(t, float) and 0 < t < 1 for t in times)
