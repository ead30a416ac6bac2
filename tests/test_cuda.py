"""The persistent CUDA kernel: one ``__global__`` per model, built by nvcc for sm_80 and sm_90,
co-resident on the A100 and H200 device models; the grid-size rules; behaviour without a GPU;
the TVM-free kernel artifact. Running on a GPU is tests/test_gpu.py."""

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest
from tvm import s_tir

import souffle
from analysis.device import co_resident_grid, get_device
from codegen.cuda import (
    argument_order,
    cuda_source,
    kernel_count,
    kernel_signature,
    persistent_kernel,
)
from souffle import models, recipe
from souffle.compiler import run_passes, staged_program
from souffle.errors import TargetError
from souffle.graph import GraphBuilder
from souffle.lower import lower_graph
from souffle.naming import c_name
from souffle.runtime.artifact import KernelArtifact
from souffle.runtime.cuda import compile_cubin, gpu_available

CONFIGS = [(name, config) for config in ("tiny", "paper") for name in models.MODELS]


@pytest.fixture(scope="module")
def compiled():
    """Each model and config compiled once for target cuda (H200 model, sm_90)."""
    cache = {}

    def get(name, config):
        if (name, config) not in cache:
            cache[name, config] = souffle.compile(models.build(name, config), target="cuda")
        return cache[name, config]

    return get


@pytest.mark.parametrize("name,config", CONFIGS)
def test_one_kernel_that_builds_and_is_co_resident(compiled, name, config):
    model = compiled(name, config)
    assert model.kernel_count == 1
    assert kernel_count(model.source) == 1
    assert "cg::this_grid().sync()" in model.source or model.plan.barrier_count() == 0
    assert model.cubin[:4] == b"\x7fELF"
    # dynamic shared memory: weights kept on chip across a loop, and the matmul stages' pool
    on_chip = max(launch.dynamic_shared for launch in model.kernel_plan.kernel_launches())
    h200 = co_resident_grid(model.resources.registers, model.resources.shared_bytes + on_chip, get_device("h200"), 256)
    assert h200.grid == model.occupancy.grid >= 132
    cubin, sm80 = compile_cubin(model.source, "sm_80")
    assert cubin[:4] == b"\x7fELF" and sm80.arch == "sm_80"
    a100 = co_resident_grid(sm80.registers, sm80.shared_bytes + on_chip, get_device("a100"), 256)
    assert a100.grid >= 108
    assert 1 <= model.grid <= h200.grid


def test_grid_sync_only_where_the_staging_put_barriers(compiled):
    model = compiled("lstm", "tiny")
    assert model.source.count("tvm_builtin_cuda_grid_sync();") == model.plan.barrier_count()


def test_occupancy_follows_the_cuda_rules():
    h200 = get_device("h200")
    # 32 registers x 256 threads = 8192 per block: 8 blocks by registers, 8 by threads (2048/256).
    assert co_resident_grid(32, 0, h200, 256).blocks_per_sm == 8
    # 128 registers: 32768 per block, 2 blocks.
    occupancy = co_resident_grid(128, 0, h200, 256)
    assert occupancy.blocks_per_sm == 2 and occupancy.limiter == "registers" and occupancy.grid == 264
    # 100 KiB of shared memory: (228 KiB) // (100 KiB + 1 KiB reserved) = 2 blocks.
    assert co_resident_grid(32, 100 * 1024, h200, 256).limits["shared memory"] == 2
    # registers are allocated per warp in units of 256: 33 registers cost 40 per thread.
    assert co_resident_grid(33, 0, h200, 256).limits["registers"] == 65536 // (40 * 256)


def test_a_kernel_that_cannot_be_resident_is_refused_with_numbers():
    with pytest.raises(TargetError, match=r"cannot be co-resident on h200: 255 registers x 1024 threads = 262144 "
                                          r"registers per block > 65536"):
        co_resident_grid(255, 0, get_device("h200"), threads=1024)
    with pytest.raises(TargetError, match=r"240000 bytes of shared memory per block > 232448"):
        co_resident_grid(32, 240_000, get_device("h200"), 256)


def test_kernel_arguments_are_matched_by_name(compiled):
    model = compiled("mmoe", "tiny")
    order = argument_order(model.source, model.plan)
    names = {b.name for b in model.plan.parameters()} | {"grid_size"}
    assert sorted(order) == sorted(names)
    assert kernel_signature(model.source)[-1] == ("int", "grid_size")


def test_unknown_device_model_and_bad_threads_are_refused():
    graph = models.build("mmoe", "tiny")
    with pytest.raises(TargetError, match="needs a GPU device model"):
        souffle.compile(graph, target="cuda", device="cpu")
    with pytest.raises(souffle.SouffleError, match="unknown device 'v100'"):
        souffle.compile(graph, target="cuda", device="v100")
    with pytest.raises(TargetError, match="threads must be a multiple of 32"):
        souffle.compile(graph, target="cuda", threads=100)


@pytest.mark.skipif(gpu_available(), reason="checks the behaviour on a machine without a GPU")
def test_without_a_gpu_the_source_works_and_running_says_why(compiled):
    model = compiled("mmoe", "tiny")
    assert "__global__" in model.source
    assert "co-residency" in str(model.report())
    with pytest.raises(TargetError, match="needs an NVIDIA GPU and driver"):
        model(**models.make_inputs("mmoe", "tiny"))


def test_the_report_names_local_memory_only_where_a_kernel_has_some():
    """ptxas' stack frame (an array nvcc could not keep in registers) is shown beside the spills
    where a kernel has one; no paper or tiny kernel does now."""
    model = souffle.compile(models.build("mmoe", "tiny"), target="cuda")
    assert model.report().extra["cuda"].endswith("0 B spilled")
    model.kernel_resources = {name: dataclasses.replace(r, stack_bytes=112) for name, r in model.kernel_resources.items()}
    assert model.report().extra["cuda"].endswith("0 B spilled, 112 B more of local memory")
    model.kernel_resources = {name: dataclasses.replace(r, stack_bytes=8, spill_bytes=8)
                              for name, r in model.kernel_resources.items()}
    model.resources = dataclasses.replace(model.resources, stack_bytes=8, spill_bytes=8)
    assert model.report().extra["cuda"].endswith("8 B spilled")  # the stack frame holds the spills alone


def test_artifact_round_trip_rebuilds_the_weights(compiled, tmp_path):
    model = compiled("lstm", "tiny")
    artifact = model.artifact(config="tiny", seed=0)
    loaded = KernelArtifact.load(artifact.save(tmp_path / "lstm"))
    assert loaded == artifact
    arrays = loaded.weight_arrays()  # from the model's seeded initialisation, not from the files
    assert [w["buffer"] for w in loaded.weights] == [b.name for b in model.plan.weight_buffers]
    for buffer, (_, value) in zip(model.plan.weight_buffers, model.plan.weights):
        np.testing.assert_array_equal(arrays[buffer.name], value.reshape(-1))
    # the wavefront's stacked, gate-interleaved weight is a recipe over the per-layer model weights
    assert {w["recipe"][0] for w in loaded.weights} == {"concat", "stack", "const"}
    stacked = next(w for w in loaded.weights if w["recipe"][0] == "concat")
    assert recipe.sources(stacked["recipe"]) == {f"weight_{kind}_l{layer}" for kind in ("ih", "hh") for layer in range(3)}


def test_artifact_refuses_weights_of_the_wrong_shape(compiled):
    artifact = compiled("mmoe", "tiny").artifact()
    weights = dict(models.build("mmoe", "tiny").weights)
    first = min(recipe.sources(artifact.weights[0]["recipe"]))
    weights[first] = np.zeros((3, 3), "float32")
    with pytest.raises(souffle.SouffleError, match=f"weight {artifact.weights[0]['buffer']!r}: "):
        artifact.weight_arrays(weights)


def test_shared_memory_is_pooled_across_stages():
    """Two stages each staging a 1 KiB tile in shared memory need 1 KiB, not 2: TVM pools
    the kernel's shared buffers by liveness."""
    b = GraphBuilder("two")
    y = b.op("relu", b.input("x", (64, 256)), name="y")
    staged = staged_program(lower_graph(b.build(b.op("tanh", y, name="z"))), "cuda", 256, opt_level=3)

    def staged_through_shared(stage):
        sch = s_tir.Schedule(stage.func)
        block = sch.get_child_blocks(sch.get_sblock("root"))[0]
        sch.compute_at(sch.cache_read(block, 0, "shared"), sch.get_loops(block)[0])
        return dataclasses.replace(stage, func=sch.mod["main"])

    staged.items = [staged_through_shared(stage) for stage in staged.items]
    source = cuda_source(persistent_kernel(staged), "sm_90")
    assert compile_cubin(source, "sm_90")[1].shared_bytes == 256 * 4


def test_artifact_loads_and_rebuilds_weights_without_tvm(compiled, tmp_path):
    """A lent GPU machine has no TVM: loading an artifact, rebuilding its weights and reaching
    the launcher must not import it (nor torch)."""
    compiled("lstm", "tiny").artifact(config="tiny").save(tmp_path / "lstm")
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('tvm', 'torch'): raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from souffle.runtime.artifact import KernelArtifact, Launcher\n"
        "from souffle.runtime.check import Check\n"
        f"artifact = KernelArtifact.load({str(tmp_path / 'lstm')!r})\n"
        "print(len(artifact.weight_arrays()), sorted(artifact.cubins))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "['sm_90']"]  # the wavefront's weight, bias and step masks


@pytest.mark.parametrize("name", models.MODELS)
def test_every_opt_level_builds_for_sm80_and_sm90(name):
    """O0-O2 give one kernel per stage (loops launch from the host), O3-O4 one kernel."""
    graph = models.build(name, "tiny")
    for level in range(5):
        model = souffle.compile(graph, target="cuda", opt_level=level)
        kernels = model.kernel_plan.kernel_names
        assert kernel_count(model.source) == model.kernel_count == len(kernels)
        assert len(kernels) == (model.plan.stage_count() if level <= 2 else 1), f"O{level}"
        cubin, resources = compile_cubin(model.source, "sm_80", tuple(kernels))
        assert cubin[:4] == b"\x7fELF" and set(resources) == set(kernels)
        assert model.cubin[:4] == b"\x7fELF"
        for kernel in kernels:
            order = model.argument_orders[kernel]
            assert "grid_size" in order and len(set(order)) == len(order)


def test_unfused_levels_launch_loop_bodies_from_the_host():
    from codegen.cuda import HostLoop, Launch, kernel_plan

    staged = staged_program(lower_graph(models.build("lstm", "tiny")), "cuda", 256, opt_level=0)
    launches = kernel_plan(staged).launches
    loops = [launch for launch in launches if isinstance(launch, HostLoop)]
    assert [loop.trips for loop in loops] == [5, 2]  # layer 0's time steps; the other layers
    assert [launch.trips for launch in loops[1].body if isinstance(launch, HostLoop)] == [5]  # ... each over time
    assert all(isinstance(k, Launch) and not k.cooperative for k in loops[0].body)
    assert sum(1 for launch in launches if isinstance(launch, Launch)) + len(loops[0].body) < staged.kernel_count()


def test_paper_lstm_keeps_its_weights_on_chip_at_the_grid_of_its_residency():
    """Paper LSTM's registers allow 4 blocks/SM: at that grid (528 blocks on an H200) a block runs
    up to 3 of the wavefront step's 1280 tiles, whose weight slices (48 KB) fit in the shared memory
    that keeps 4 blocks/SM, where at 132, 264 or 396 blocks they would not, so the weights are read
    once per inference, not once per step. ptxas is held to that grid. At fp16 the slices fit at 264
    blocks or more (1 of 32 KB: its warps reduce 4 rows together, 320 tiles). On an A100 (164 KB of shared memory per
    SM: 40 KB a block at 4 blocks/SM) they stay in global memory; tiny LSTM's fit too."""
    from codegen.traffic import memory_traffic

    graph = models.build("lstm", "paper")
    h200 = run_passes(graph, "cuda", stop="co_residency", device="h200")
    assert h200.notes("on chip")[0] == (
        "weight (read by wavefront_step_r0/gate_product+state_next in loop wavefront) on chip: 3 tiles per block x "
        "4096 elements, 49152 B of shared memory per block at 528 blocks or more, loaded once per inference")
    assert h200.ir.plan.min_grids() == {"main_kernel": 528}
    assert h200.ir.occupancy["main_kernel"].grid >= 528
    staged = run_passes(graph, "cuda", stop="plan_arena", device="h200").ir
    # one per wavefront step (the first orders the loop after the stage before it) and one after the loop
    assert staged.barrier_count(executed=True) == 109 + 1
    weights = sum(v.nbytes for v in graph.weights.values())
    assert memory_traffic(staged).read_bytes < 3 * weights  # the weights once; the states and inputs each step
    fp16 = run_passes(graph, "cuda", stop="plan_arena", device="h200", precision="fp16")
    # at fp16 its warps reduce 4 rows together (codegen.schedule.GEMV_ROWS_TOGETHER): 320 tiles of 32 rows
    assert " on chip: 1 tiles per block x 16384 elements, 32768 B of shared memory per block at 320 blocks or more" \
        in fp16.notes("on chip")[0]
    a100 = run_passes(graph, "cuda", stop="plan_arena", device="a100")
    assert "stays in global memory: 3 tiles per block x 16384 B = 49152 B > 40928 B" in a100.notes("on chip")[0]
    tiny = run_passes(models.build("lstm", "tiny"), "cuda", stop="plan_arena", device="h200")
    assert " on chip: 1 tiles per block x 256 elements, 1024 B " in tiny.notes("on chip")[0]


def test_placed_for_one_block_per_sm_paper_lstm_weights_would_not_fit(monkeypatch):
    """The mutant: slices placed for a grid of one block per SM (132 on an H200), as before the
    placement followed the residency, are 10 a block (160 KB) and refused: the weights stay in
    global memory, read again at every one of the 109 steps."""
    from codegen import on_chip

    residency = on_chip._Placement.residency

    def one_block_per_sm(self, stages, threads):
        residency(self, stages, threads)  # the shared memory cap at the registers' residency stays
        return 1

    monkeypatch.setattr(on_chip._Placement, "residency", one_block_per_sm)
    h200 = run_passes(models.build("lstm", "paper"), "cuda", stop="plan_arena", device="h200")
    assert "stays in global memory: 10 tiles per block x 16384 B = 163840 B > 57312 B, the shared memory per " \
           "block that keeps 4 blocks/SM on h200" in h200.notes("on chip")[0]


def test_a_kernel_whose_on_chip_weights_need_more_blocks_than_ptxas_leaves_is_bounded_to_them(monkeypatch):
    """ptxas gives tiny LSTM's kernel 48 registers (5 blocks/SM of 256 threads); asked for a grid of
    6 blocks per SM, ``cuda_compile`` holds it to 40 registers with ``__launch_bounds__``, and
    says so."""
    from codegen import cuda

    device = get_device("h100")
    source = run_passes(models.build("lstm", "tiny"), "cuda", stop="validate_threads", device="h100").ir
    launches = cuda._launches_by_kernel(source.plan)
    monkeypatch.setattr(cuda, "_launches_by_kernel", lambda plan: {
        name: dataclasses.replace(launch, min_grid=6 * device.sms) for name, launch in launches.items()})
    outcome = cuda.cuda_compile(source, device)
    (note,) = outcome.notes
    assert note.startswith(f"main_kernel: its on-chip weights need {6 * device.sms} blocks (6 blocks/SM), ptxas took ")
    assert "__launch_bounds__(256, 6)" in outcome.ir.source.text
    assert co_resident_grid(outcome.ir.resources["main_kernel"].registers, 0, device, 256).blocks_per_sm >= 6


def test_launcher_runs_host_loops_and_passes_their_counters():
    """The launch order of an O0 artifact, with recording kernels in place of a GPU."""
    from souffle.runtime.artifact import Launcher

    model = souffle.compile(models.build("lstm", "tiny"), target="cuda", opt_level=0)
    artifact = model.artifact()
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def prepare(self, grid, threads, args, cooperative, shared_bytes, stream=None):
            counters = [int(a) for a in args if isinstance(a, np.int64)]
            return lambda: calls.append((self.name, grid, threads, counters, cooperative, shared_bytes))

    launcher = Launcher.__new__(Launcher)
    launcher.artifact = artifact
    launcher.kernels = {name: Recorder(name) for name in artifact.kernels}
    launcher.grids = {name: 7 for name in artifact.kernels}
    buffers = {name: object() for order in artifact.kernels.values() for name in order
               if name != "grid_size" and not name.endswith("_i")}
    launcher.launch(buffers)
    assert len(calls) == model.plan.kernel_count(executed=True) == 334
    assert all(grid == 7 and threads == (32, 8, 1) and not coop and shared == 0
               for _, grid, threads, _, coop, shared in calls)
    # layer 0's time loop passes its step; the layer loop's body passes layer and step
    assert sorted({tuple(c) for _, _, _, c, _, _ in calls if len(c) == 1}) == [(i,) for i in range(5)]
    assert sorted({tuple(c) for _, _, _, c, _, _ in calls if len(c) == 2}) == [(l, t) for l in range(2) for t in range(5)]


@pytest.mark.parametrize("name, expected", [("0.norm1.weight", "_0_norm1_weight"), ("layer.0.w", "layer_0_w"),
                                            ("é", "_"), ("", "_")])
def test_c_names_are_identifiers(name, expected):
    assert c_name(name) == expected


def test_a_weight_named_from_a_digit_builds():
    """A scan body's weights are named like the module's (Swin's pair of blocks: ``0.norm1.weight``);
    as a C identifier, ``0_norm1_weight_in``, nvcc refused the paper Swin-B kernel."""
    b = GraphBuilder("digit_names")
    out = b.op("mul", b.input("x", (4, 8)), b.param("0.scale", np.ones((4, 8), "float32")))
    model = souffle.compile(b.build(out), target="cuda")
    assert model.kernel_count == 1 and "_0_scale" in model.source


def test_a_kernel_ptxas_spills_is_bounded_to_fewer_blocks_per_sm_until_it_does_not(monkeypatch):
    """ptxas' own register choice for a large kernel may spill (paper BERT fp32: 80 registers,
    32 B); cuda_compile asks for one block per SM fewer until the spill is gone. Here a stand-in
    for nvcc spills unless the kernel is bounded to 1 block per SM."""
    from codegen import cuda
    from souffle.runtime.cuda import KernelResources

    source = run_passes(models.build("mmoe", "tiny"), "cuda", stop="cuda_source", opt_level=4).ir
    (kernel,) = source.plan.kernel_names
    builds = []

    def fake_nvcc(text, arch, names):
        builds.append(re.search(r"__launch_bounds__\(([^)]*)\)\s+" + kernel, text)[1])
        spill = 0 if builds[-1] == "256, 1" else 32
        return b"", {kernel: KernelResources(arch, 80, 0, spill, spill, 1)}

    monkeypatch.setattr(cuda, "compile_cubin", fake_nvcc)
    outcome = cuda.cuda_compile(source, get_device("h200"))
    assert builds == ["256", "256, 2", "256, 1"]  # 80 registers: 3 blocks/SM, then 2, then 1
    assert f"__launch_bounds__(256, 1) {kernel}(" in outcome.ir.source.text
    assert outcome.notes == [f"{kernel}: ptxas spilled 32 B at 80 registers (3 blocks/SM); bounded to 1 blocks/SM: "
                             "80 registers, 0 B spilled"]
    builds.clear()
    monkeypatch.setattr(cuda, "compile_cubin", lambda text, arch, names: (
        builds.append(1) or b"", {kernel: KernelResources(arch, 80, 0, 0, 0, 1)}))
    assert cuda.cuda_compile(source, get_device("h200")).notes == [] and builds == [1]  # no spill: one build
