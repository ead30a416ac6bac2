"""The thread-level validator (analysis/threads.py): it accepts correct kernels, rejects main's
known defects and a sample of injected faults with messages naming the stage, the buffer and the
two threads, and agrees with an independent concrete run (scripts/validate_mutants.py runs the
full mutation test)."""

import importlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tvm
from tvm import tirx

import analysis.threads as threads
import souffle
from analysis.threads import Converter, Form, NonAffine, _floordiv, _floormod, _mixed_radix, validate_kernel
from souffle import models
from souffle.compiler import run_passes
from souffle.errors import SouffleError, ValidationError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
mutants = importlib.import_module("scripts.validate_mutants")


@pytest.fixture(scope="module")
def lstm_o4():
    (kernel,) = mutants.kernels("lstm", 4)
    return kernel


def _violations(kernel, func=None):
    return mutants.validate(kernel, func).violations


@pytest.fixture
def without_block_barriers(monkeypatch):
    """Barrier placement as it was before issue 15's fix: no __syncthreads where data crosses the
    threads of one block, so tiny MMoE at O4 is the unsafe kernel the validator must refuse."""
    import codegen.barriers

    monkeypatch.setattr(codegen.barriers, "_thread_conflict", lambda *_: None)


def test_accepts_the_correct_kernels(lstm_o4):
    assert _violations(lstm_o4) == ()
    (o3,) = mutants.kernels("lstm", 3)
    assert _violations(o3) == ()
    assert mutants.concrete_faults(lstm_o4, lstm_o4.func) == []


def test_rejects_mmoe_o4_reading_another_threads_result_without_syncthreads(without_block_barriers):
    """Issue 15, defect 3: paper and tiny MMoE at O4 had no __syncthreads; the experts' and
    gates' matmul output (with its bias) written by threads 0-17 of block 0 is read by other
    threads of that block (the gates' softmax), with nothing ordering them."""
    (kernel,) = mutants.kernels("mmoe", 4)
    violations = _violations(kernel)
    assert violations[0].startswith("stage 0 (writes T_add) / stage 1 (writes T_softmax_maxelem): "
                                    "thread (17,0) of tile 0 and thread (0,0) of tile 0 (same block, grid size 1) "
                                    "write and read global T_add[17] / T_add_in[17] with no "
                                    "__syncthreads between them"), violations
    assert any(f.startswith("race:") for f in mutants.concrete_faults(kernel, kernel.func))


def test_the_pass_refuses_an_unsafe_kernel_with_a_souffle_error(without_block_barriers):
    graph = models.build("mmoe", config="tiny")
    with pytest.raises(ValidationError, match=r"kernel main_kernel: stage \d+ .* no __syncthreads") as err:
        run_passes(graph, "cuda", stop="validate_threads", validate=True)
    assert isinstance(err.value, SouffleError)
    skipped = run_passes(graph, "cuda", stop="validate_threads", validate=False)
    assert [r.notes for r in skipped.records if r.name == "validate_threads"] == [("skipped (validation off)",)]
    with pytest.raises(SouffleError, match="validate must be True, False or None"):
        souffle.compile(graph, target="cuda", validate="yes")


def test_the_pass_validates_lstm_o4():
    run = run_passes(models.build("lstm", config="tiny"), "cuda", stop="validate_threads", validate=True)
    (record,) = [r for r in run.records if r.name == "validate_threads"]
    assert record.notes[-1].startswith("1 kernels validated")


def test_an_accepted_verdict_is_cached_and_a_rejection_is_not(tmp_path, monkeypatch):
    """A recompile takes the validator's acceptance from the cache (keyed by the CUDA source and the
    validator's own source); an entry that does not verify is validated again; a rejected kernel
    is checked every time."""
    import codegen.validation_cache as cache
    from souffle.runtime.cuda import CacheWarning

    monkeypatch.setenv("SOUFFLE_CACHE_DIR", str(tmp_path))
    graph = models.build("lstm", config="tiny")

    def last_note():
        run = run_passes(graph, "cuda", stop="validate_threads", validate=True)
        return [r for r in run.records if r.name == "validate_threads"][0].notes[-1]

    assert last_note() == "1 kernels validated"
    assert last_note().startswith("1 kernels validated (verdict cached under ")
    (entry,) = (tmp_path / "validated").iterdir()
    entry.write_text(entry.read_text().replace('"main_kernel"', '"other_kernel"'))
    with pytest.warns(CacheWarning, match="does not verify"):
        assert last_note() == "1 kernels validated"
    monkeypatch.setattr(cache, "_validator_digest", lambda: "a changed validator")
    assert last_note() == "1 kernels validated"
    import codegen.barriers

    monkeypatch.setattr(codegen.barriers, "_thread_conflict", lambda *_: None)  # tiny MMoE O4 made unsafe
    for _ in range(2):
        with pytest.raises(ValidationError, match="no __syncthreads"):
            run_passes(models.build("mmoe", config="tiny"), "cuda", stop="validate_threads", validate=True)
    assert len(list((tmp_path / "validated").iterdir())) == 2


# the tiny LSTM has no vector store: misalign_vector's mutants are those of a tensor-core kernel
# (tests/test_tensor_core.py::test_a_vector_store_one_element_off_its_bytes_is_caught)
@pytest.mark.parametrize("kind", [kind for kind in mutants.KINDS if kind != "misalign_vector"])
def test_injected_faults_are_rejected(lstm_o4, kind):
    """Mutants of each kind in the tiny LSTM's O4 kernel, in order until one is rejected: that one
    the concrete run finds unsafe too, and none before it was unsafe (a false accept)."""
    outcomes = []
    for what, make in mutants.sites(lstm_o4)[kind]:
        outcomes.append(mutants.judge(kind, lstm_o4, what, make())["outcome"])
        if outcomes[-1].startswith("rejected"):
            break
    assert outcomes and outcomes[-1] == "rejected unsafe", outcomes
    assert "FALSE ACCEPT" not in outcomes


def test_a_barrier_under_a_thread_condition_is_a_deadlock(lstm_o4):
    what, make = next((w, m) for w, m in mutants.sites(lstm_o4)["barrier_under_if"] if "tvm_storage_sync" in w)
    violations = _violations(lstm_o4, make())
    assert any(v.startswith("deadlock: a __syncthreads") for v in violations), violations


def test_a_launch_the_code_does_not_declare_is_refused(lstm_o4):
    def halve(s):
        if isinstance(s, tirx.AttrStmt) and s.attr_key == "thread_extent" and s.node.thread_tag == "threadIdx.y":
            return tirx.AttrStmt(s.node, s.attr_key, tirx.const(4, "int32"), s.body)
        return s

    func = lstm_o4.func.with_body(mutants.rewrite(lstm_o4.func.body, halve))
    violations = validate_kernel(func, 256, "k")
    assert violations.violations[0].startswith("launch fit: threadIdx.y is launched over 4, but the block is (32, 8, 1)")


def _launched(stmt, grid, bx, tx, ty):
    """``stmt`` run by blocks of 8 warps of 32 lanes (``ty``, ``tx``) on a grid of ``grid`` blocks (``bx``)."""
    for var, tag, extent in ((ty, "threadIdx.y", 8), (tx, "threadIdx.x", 32), (bx, "blockIdx.x", grid)):
        binding = tirx.IterVar(tvm.ir.Range(0, extent), var, tirx.IterVar.ThreadIndex, tag)
        stmt = tirx.AttrStmt(binding, "thread_extent", extent, stmt)
    return stmt


def _lane_zero_then_all_lanes(sync: bool) -> tirx.PrimFunc:
    """Lane 0 of each warp writes shared S[warp]; then every lane reads S[warp] (with or without
    a __syncthreads between): the pattern of a warp reduction's result handed to its warp."""
    grid, n = tirx.Var("grid_size", "int32"), tirx.Var("n", "int32")
    out = tirx.decl_buffer((n,), "float32", name="out")
    shared = tirx.decl_buffer((8,), "float32", name="S", scope="shared")
    bx, tx, ty = (tirx.Var(name, "int32") for name in ("blockIdx_x", "threadIdx_x", "threadIdx_y"))
    t = tirx.Var("t", "int32")
    body = [
            tirx.IfThenElse(tx == 0, tirx.BufferStore(shared, tirx.const(1.0, "float32"), [ty]), None),
            tirx.BufferStore(out, tirx.BufferLoad(shared, [ty]), [(bx + t * grid) * 256 + ty * 32 + tx])]
    if sync:
        body.insert(1, tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared")))
    # one stage of one tile: for t in range(ceildiv(1 - blockIdx.x, grid_size))
    stage = tirx.For(t, 0, tirx.floordiv(grid - bx, grid), tirx.ForKind.SERIAL, tirx.SeqStmt(body))
    stmt = tirx.SeqStmt([tirx.AllocBuffer(shared), stage])
    stmt = _launched(stmt, grid, bx, tx, ty)
    return tirx.PrimFunc([n, grid], stmt)


def test_other_lanes_reading_lane_zeros_shared_word_need_a_syncthreads():
    """Found by the mutation test: an address that names the warp but not the lane does not
    make two accesses the same thread's."""
    assert validate_kernel(_lane_zero_then_all_lanes(sync=True), 256).violations == ()
    (violation,) = validate_kernel(_lane_zero_then_all_lanes(sync=False), 256).violations
    assert violation.startswith("stage 0 (writes out): thread (") and "of tile 0 (same block, grid size 1) write " \
        "and read shared S[" in violation and "no __syncthreads" in violation


def test_the_command_line_refuses_an_unsafe_kernel(capsys, without_block_barriers):
    from souffle.cli import main

    assert main(["compile", "mmoe", "--target", "cuda", "--validate", "--no-run"]) == 2
    assert "souffle: error: the CUDA kernel is not thread-safe:\n  kernel main_kernel: stage 0" in capsys.readouterr().err


def test_c_floor_idioms_read_back_as_floor_division_and_modulo():
    """TVM lowers floordiv and floormod of an index it cannot prove non-negative (a roll's i - 3)
    to C's truncating forms with a sign correction; the validator reads them as what they compute."""
    conv = Converter()
    i = tirx.Var("i", "int32")
    conv.env[i] = Form.atom("i")
    x = i - 3
    sign = tirx.RShift(tirx.Mod(x, 7), 31)
    division = conv.form(tirx.Div(x, 7) + sign)
    modulo = conv.form(tirx.Mod(x, 7) + tirx.BitwiseAnd(tirx.IntImm("int32", 7), sign))
    assert division.render() == _floordiv(conv.form(x), 7).render()
    assert modulo.render() == _floormod(conv.form(x), 7).render()
    with pytest.raises(NonAffine, match="C division"):  # truncation alone is not floor division
        conv.form(tirx.Div(x, 7) + tirx.RShift(tirx.Mod(x, 7), 30))


def _offset_division_read(guarded: bool) -> tirx.PrimFunc:
    """Each of 256 threads reads src[(i - 3) / 7] (C division), under the condition i >= 3 or not:
    TVM emits such a plain division where a roll's branch condition proves it non-negative."""
    grid = tirx.Var("grid_size", "int32")
    out = tirx.decl_buffer((256,), "float32", name="out")
    src = tirx.decl_buffer((37,), "float32", name="src")
    bx, tx, ty = (tirx.Var(name, "int32") for name in ("blockIdx_x", "threadIdx_x", "threadIdx_y"))
    t = tirx.Var("t", "int32")
    i = (bx + t * grid) * 256 + ty * 32 + tx
    value = tirx.BufferLoad(src, [tirx.Div(i - 3, 7)])
    if guarded:
        value = tirx.if_then_else(i >= 3, value, tirx.const(0.0, "float32"))
    stage = tirx.For(t, 0, tirx.floordiv(grid - bx, grid), tirx.ForKind.SERIAL, tirx.BufferStore(out, value, [i]))
    stmt = stage
    stmt = _launched(stmt, grid, bx, tx, ty)
    return tirx.PrimFunc([grid], stmt)


def test_a_c_division_is_exact_where_its_condition_proves_the_numerator_non_negative():
    guarded, unguarded = (validate_kernel(_offset_division_read(g), 256) for g in (True, False))
    assert guarded.violations == unguarded.violations == ()
    assert not any(note.startswith("src:") for note in guarded.notes), guarded.notes
    assert any(note.startswith("src:") and "may be negative" in note for note in unguarded.notes), unguarded.notes


def _gathered_vector_read(out_offset: int) -> tirx.PrimFunc:
    """Each of 256 threads reads four elements of ``src`` at ``2 tx + 16 (lane / 2)`` with one
    vector load, the Broadcast-plus-Ramp gather dlight's copy of an implicit-GEMM operand (an
    im2col) emits, and writes four of ``out`` at ``4 i``: two views of one arena, ``out`` at
    element ``out_offset`` (``src`` reads elements 0 to 78)."""
    grid = tirx.Var("grid_size", "int32")
    arena = tirx.decl_buffer((2048,), "float32", name="arena")
    src = tirx.decl_buffer((96,), "float32", name="src")
    out = tirx.decl_buffer((1024,), "float32", name="out")
    bx, tx, ty = (tirx.Var(name, "int32") for name in ("blockIdx_x", "threadIdx_x", "threadIdx_y"))
    t = tirx.Var("t", "int32")
    i = (bx + t * grid) * 256 + ty * 32 + tx
    lanes = tirx.Div(tirx.Ramp(0, 1, 4), tirx.Broadcast(2, 4)) * tirx.Broadcast(16, 4)
    store = tirx.BufferStore(out, tirx.BufferLoad(src, [tirx.Broadcast(tx * 2, 4) + lanes]), [tirx.Ramp(i * 4, 1, 4)])
    stage = tirx.For(t, 0, tirx.floordiv(grid - bx, grid), tirx.ForKind.SERIAL, store)
    stmt = tirx.SeqStmt([tirx.DeclBuffer(src, data=tirx.address_of(tirx.BufferLoad(arena, [0]))),
                         tirx.DeclBuffer(out, data=tirx.address_of(tirx.BufferLoad(arena, [out_offset]))), stage])
    stmt = _launched(stmt, grid, bx, tx, ty)
    return tirx.PrimFunc([grid], stmt)


def test_a_vector_gathers_lanes_are_read_each_at_its_own_index():
    """Read as any element of the arena, the gather raced with every write to it (paper ResNeXt at
    fp16: its stem's im2col copy of the padded input against the ReLU written into the same
    float16 arena); read lane by lane, it is apart from ``out`` at element 96 and races with it at 64."""
    apart = validate_kernel(_gathered_vector_read(out_offset=96), 256)
    assert apart.violations == ()
    assert not any(note.startswith("src:") for note in apart.notes), apart.notes
    (violation,) = validate_kernel(_gathered_vector_read(out_offset=64), 256).violations
    # lane 2 of thread (25, 7) reads element 2 * 25 + 16 = 66, which thread (0, 0)'s lane 2 writes as out[2]
    assert violation.startswith("stage 0 (writes out): thread (25,7) of tile 0 and thread (0,0) of tile 0 (same "
                                "block, grid size 1) write and read global src[66] / out[2] with no __syncthreads"), \
        violation


def test_a_vector_store_off_its_bytes_is_a_misaligned_address():
    """Each thread's four floats of ``out`` are one 16-byte store (a Ramp, ``float4``): from
    element 97 of the arena they start 4 bytes past a multiple of 16, which a GPU refuses and a CPU
    run does not notice. The gathered read, four loads, has no such bound."""
    assert validate_kernel(_gathered_vector_read(out_offset=96), 256).violations == ()
    (violation,) = validate_kernel(_gathered_vector_read(out_offset=97), 256).violations
    found = re.match(r"stage 0 \(writes out\): thread \(\d+,\d+\) of tile 0 writes 16 bytes of global out from "
                     r"element (\d+), byte (\d+) of its allocation, not a multiple of 16 \(a misaligned address\)",
                     violation)
    assert found and int(found[2]) == 4 * (97 + int(found[1])), violation


def _vector_copy(src_offset: int, shift: int) -> tirx.PrimFunc:
    """Each of 256 threads copies four floats, ``src[4 i + shift]`` on to ``out[4 i]``: ``src`` a view
    from element ``src_offset`` of one arena, ``out`` from element 2048."""
    grid = tirx.Var("grid_size", "int32")
    arena = tirx.decl_buffer((4096,), "float32", name="arena")
    src, out = tirx.decl_buffer((1040,), "float32", name="src"), tirx.decl_buffer((1024,), "float32", name="out")
    bx, tx, ty = (tirx.Var(name, "int32") for name in ("blockIdx_x", "threadIdx_x", "threadIdx_y"))
    t = tirx.Var("t", "int32")
    i = (bx + t * grid) * 256 + ty * 32 + tx
    store = tirx.BufferStore(out, tirx.BufferLoad(src, [tirx.Ramp(i * 4 + shift, 1, 4)]), [tirx.Ramp(i * 4, 1, 4)])
    stage = tirx.For(t, 0, tirx.floordiv(grid - bx, grid), tirx.ForKind.SERIAL, store)
    stmt = tirx.SeqStmt([tirx.DeclBuffer(src, data=tirx.address_of(tirx.BufferLoad(arena, [src_offset]))),
                         tirx.DeclBuffer(out, data=tirx.address_of(tirx.BufferLoad(arena, [2048]))), stage])
    return tirx.PrimFunc([grid], _launched(stmt, grid, bx, tx, ty))


def test_a_vector_load_is_one_instruction_only_where_tvm_proves_its_start_aligned():
    """TVM's CUDA code generator loads a Ramp whose start its modular analysis cannot prove a
    multiple of its lanes lane by lane (``src[4 i + 1]``: no bound on the address); one it can,
    as one 16-byte load, which from a view 8 bytes into the arena is misaligned."""
    assert validate_kernel(_vector_copy(src_offset=0, shift=1), 256).violations == ()
    assert validate_kernel(_vector_copy(src_offset=0, shift=0), 256).violations == ()
    (violation,) = validate_kernel(_vector_copy(src_offset=2, shift=0), 256).violations
    assert re.match(r"stage 0 \(writes out\): thread \(\d+,\d+\) of tile 0 reads 16 bytes of global src from element "
                    r"\d+, byte \d+ of its allocation, not a multiple of 16 \(a misaligned address\)", violation), violation


def _table_lookup(out_offset: int) -> tirx.PrimFunc:
    """Each of 256 threads reads ``table[ids[i]]`` (an index read from memory: not affine) and
    writes ``out[i]``: ``table`` elements 0 to 95 of one arena, ``out`` from element ``out_offset``."""
    grid = tirx.Var("grid_size", "int32")
    arena = tirx.decl_buffer((2048,), "float32", name="arena")
    table = tirx.decl_buffer((96,), "float32", name="table")
    out = tirx.decl_buffer((256,), "float32", name="out")
    ids = tirx.decl_buffer((256,), "int32", name="ids")
    bx, tx, ty = (tirx.Var(name, "int32") for name in ("blockIdx_x", "threadIdx_x", "threadIdx_y"))
    t = tirx.Var("t", "int32")
    i = ty * 32 + tx
    store = tirx.BufferStore(out, tirx.BufferLoad(table, [tirx.BufferLoad(ids, [i])]), [i])
    stage = tirx.For(t, 0, tirx.floordiv(1 - bx + grid - 1, grid), tirx.ForKind.SERIAL, store)
    stmt = tirx.SeqStmt([tirx.DeclBuffer(table, data=tirx.address_of(tirx.BufferLoad(arena, [0]))),
                         tirx.DeclBuffer(out, data=tirx.address_of(tirx.BufferLoad(arena, [out_offset]))), stage])
    stmt = _launched(stmt, grid, bx, tx, ty)
    return tirx.PrimFunc([grid], stmt)


def test_a_lookup_reads_somewhere_in_its_table_and_nowhere_else():
    """Found by the fuzzer (seed 1795867909: a dense, a take of its output, a batched product):
    the take's index, read from memory, was taken to reach any byte of the arena, so its write
    into the same arena was refused as a race with it. It reaches only its table's view: apart
    from ``out`` at element 96, a race where ``out`` starts inside the table, at 64."""
    assert validate_kernel(_table_lookup(out_offset=96), 256).violations == ()
    (violation,) = validate_kernel(_table_lookup(out_offset=64), 256).violations
    assert "write and read global table[?] / out[" in violation and "no __syncthreads" in violation, violation


@pytest.mark.parametrize("terms, extent, digits", [
    ({"ty": 6272, "i": 784, "tile": 64, "tx": 1}, 31360, [6272, 784, 1]),
    ({"tile": 3136, "ty": 392, "i": 49, "tx": 1}, 31360, [3136, 392, 49, 1]),
    ({"tile": 96, "tx": 3}, 960, [96, 3, 1]),
])
def test_coverage_digits_follow_a_tensors_rows_not_a_tile_width_that_cuts_them(terms, extent, digits):
    """The coverage proof compares written elements digit by digit; digits whose strides cut
    every row at a tile edge (64-wide dlight tiles of 784-element rows: [6272, 64, 1]) took isl
    15 minutes on paper EfficientNet, the rows' own strides a hundredth of a second."""
    write = SimpleNamespace(index=sum((Form.atom(name).scale(c) for name, c in terms.items()), Form.const(32)))
    assert _mixed_radix([write], extent) == digits


@pytest.mark.parametrize("constraint", [
    "(0) <= a < (18)",
    "((3*((1*a) mod 3) + 1*floor((3*floor((1*b)/2) + 1*((8*a + 1*floor((1*b)/4)) mod 3))/2)) < (8))",
    "(not ((1*a) = (2)))",
    "(((1*a) < (4)) or ((1*b) >= (3)))",
    "((1*a) != (1*b) and (0 = 0))",
    "4 * a <= 3 * b + 1 < 4 * a + 4",
])
def test_enumeration_reads_a_constraint_as_isl_does(constraint):
    """``analysis.threads._holds`` (the enumerated coverage proof's reading of the validator's isl
    constraints) agrees with isl at every point of a box, negative values included."""
    import islpy as isl
    import numpy as np

    from analysis.threads import _holds

    a, b = (g.ravel() for g in np.meshgrid(np.arange(-6, 20), np.arange(-6, 20), indexing="ij"))
    holds = np.broadcast_to(_holds(constraint, {"a": a, "b": b}), a.shape)
    points = isl.Set(f"{{ [a, b] : {constraint} and -6 <= a < 20 and -6 <= b < 20 }}")
    expected = np.zeros(a.shape, dtype=bool)
    points.foreach_point(lambda p: expected.__setitem__(
        (p.get_coordinate_val(isl.dim_type.set, 0).to_python() + 6) * 26
        + p.get_coordinate_val(isl.dim_type.set, 1).to_python() + 6, True))
    assert (holds == expected).all() and expected.any()


@pytest.mark.parametrize("kind", ["fewer_threads", "collapse_reduction"])
def test_enumerated_coverage_finds_what_isl_finds(lstm_o4, kind, monkeypatch):
    """The tiny LSTM's coverage proofs by enumeration (every stage's writes are the same at every
    grid size) and by isl (``ENUMERATED_POINTS`` = 0) refuse the same stages of each mutant."""
    def refused_stages(func):
        found = [v.split(":")[0] for v in _violations(lstm_o4, func)
                 if "is never written" in v or "must have exactly one writer" in v]
        return sorted(set(found))

    enumerated = []
    original = threads.Checker._enumerated_coverage
    monkeypatch.setattr(threads.Checker, "_enumerated_coverage",
                        lambda self, *args: enumerated.append(args[0]) or original(self, *args))
    mutants_of_kind = [make() for _, make in mutants.sites(lstm_o4)[kind]][:6]
    by_enumeration = [refused_stages(func) for func in mutants_of_kind]
    assert enumerated and any(by_enumeration)
    monkeypatch.setattr(threads, "ENUMERATED_POINTS", 0)
    assert [refused_stages(func) for func in mutants_of_kind] == by_enumeration
