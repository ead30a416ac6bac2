"""A compiled model's kernels as files, and their launcher — numpy and cuda-python only.

A GPU machine may have neither TVM nor room for a large model's weights, so an artifact holds
the kernels (cubins per architecture and the CUDA source), how to call them (each kernel's
parameters in order, threads, tiles, and the launch order: kernels and the host loops around
them), and *recipes* for its weights (``souffle.recipe``) instead of the arrays: the launcher
rebuilds them from the model's seeded numpy initialisation. ``souffle.compile(...,
target="cuda")`` launches through the same ``Launcher``.

Loading checks every file against the manifest (its format version, its schema, each file's
SHA-256) before anything is used: a damaged or hand-edited artifact is an :class:`ArtifactError`
naming the file, never a launch of other bytes than the ones exported.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from souffle.errors import InputError, SouffleError, TargetError
from souffle.runtime.cuda import ARCH
from souffle.tensor import SUPPORTED_DTYPES, numpy_dtype

MANIFEST = "manifest.json"
SOURCE = "kernel.cu"
# Version 1 had no version, no hashes and the cubins as a list of archs; 2 is described in
# KernelArtifact.save.
FORMAT_VERSION = 2
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ArtifactError(SouffleError, ValueError):
    """A kernel artifact or check bundle with a file missing, malformed, or not the one its
    manifest describes; the message names the file and the problem."""


def cubin_file(arch: str) -> str:
    return f"kernel.{arch}.cubin"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class TensorSlot:
    """A kernel parameter that holds a model tensor."""

    name: str  # the model's tensor (input or output) name
    buffer: str  # the kernel parameter
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def describe(self) -> str:
        return f"{self.shape} {self.dtype}"


@dataclass
class KernelArtifact:
    """Everything a launch needs, without TVM."""

    model: str
    config: str | None  # the souffle.models config the weights come from; None: weights given
    seed: int
    threads: int
    kernels: dict[str, list[str]]  # kernel -> its parameters by buffer (or loop counter) name; "grid_size" is the grid
    launches: list[dict]  # {"kernel", "cooperative", "max_tiles", "dynamic_shared", "min_grid"} or
    #                       {"loop", "trips", "body": [...]}, in order
    inputs: list[TensorSlot]
    outputs: list[TensorSlot]
    weights: list[dict]  # {"buffer", "recipe" (souffle.recipe), "shape", "dtype"}
    arenas: dict[str, tuple[str, int]]  # buffer -> (dtype, elements)
    source: str
    cubins: dict[str, bytes] = field(default_factory=dict)  # arch -> cubin

    def save(self, directory) -> Path:
        """Write ``kernel.cu``, ``kernel.<arch>.cubin`` per arch and, last, ``manifest.json``: this
        artifact's fields but the source and cubins, ``format_version`` (2), ``source_sha256``
        (of kernel.cu) and ``cubins`` (arch -> the SHA-256 of its cubin file)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        source = self.source.encode()
        (directory / SOURCE).write_bytes(source)
        for arch, cubin in self.cubins.items():
            (directory / cubin_file(arch)).write_bytes(cubin)
        manifest = {"format_version": FORMAT_VERSION,
                    **{k: v for k, v in asdict(self).items() if k not in ("source", "cubins")},
                    "source_sha256": sha256(source),
                    "cubins": {arch: sha256(cubin) for arch, cubin in sorted(self.cubins.items())}}
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
        return directory

    @classmethod
    def load(cls, directory) -> KernelArtifact:
        """Read the artifact in ``directory``, checking everything a launch relies on first: the
        manifest's format version and schema (every key and its type, shapes and dtypes, each
        launched kernel's parameters bound to a slot, weight, arena, enclosing loop or the grid),
        and every file's presence and SHA-256. A failure is an :class:`ArtifactError` naming the file."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.exists():
            raise ArtifactError(f"{directory} is not a kernel artifact: no {MANIFEST}")
        manifest = _manifest(read_json(path, "kernel artifact"), path)
        source = read_verified(directory / SOURCE, manifest["source_sha256"])
        try:
            text = source.decode()
        except UnicodeDecodeError as err:
            raise ArtifactError(f"{directory / SOURCE}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        cubins = {arch: read_verified(directory / cubin_file(arch), digest) for arch, digest in manifest["cubins"].items()}
        slots = {kind: [TensorSlot(t["name"], t["buffer"], tuple(t["shape"]), t["dtype"]) for t in manifest[kind]]
                 for kind in ("inputs", "outputs")}
        return cls(model=manifest["model"], config=manifest["config"], seed=manifest["seed"],
                   threads=manifest["threads"], kernels=manifest["kernels"], launches=manifest["launches"],
                   inputs=slots["inputs"], outputs=slots["outputs"], weights=manifest["weights"],
                   arenas={name: tuple(arena) for name, arena in manifest["arenas"].items()},
                   source=text, cubins=cubins)

    def weight_arrays(self, model_weights: dict | None = None) -> dict[str, np.ndarray]:
        """Each weight parameter's array, from ``model_weights`` or the model's seeded initialisation."""
        if model_weights is None:
            if self.config is None:
                raise SouffleError(f"artifact {self.model!r} records no model config: pass its weights")
            from souffle import models  # numpy only: building the graph would need TVM

            model_weights = models.get(self.model).init_weights(models.config(self.model, self.config), self.seed)
        from souffle.recipe import evaluate

        arrays = {}
        for w in self.weights:
            try:
                value = evaluate(w["recipe"], model_weights)
            except (ValueError, IndexError) as err:  # numpy refusing to stack, concatenate or index mismatched shapes
                raise SouffleError(f"weight {w['buffer']!r}: cannot be rebuilt from the given weights: {err}") from None
            if tuple(value.shape) != tuple(w["shape"]) or value.dtype != numpy_dtype(w["dtype"]):
                raise SouffleError(f"weight {w['buffer']!r}: expected {tuple(w['shape'])} {w['dtype']}, "
                                   f"got {value.shape} {value.dtype}")
            arrays[w["buffer"]] = np.ascontiguousarray(value).reshape(-1)
        return arrays

    def checked_inputs(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """``inputs``, one array per input slot in order, as flat C-contiguous arrays. A wrong count,
        shape or dtype is refused here: on the GPU a short input would be read past its end, and
        one of the right size but another shape would be read in the wrong order."""
        if len(inputs) != len(self.inputs):
            names = ", ".join(slot.name for slot in self.inputs)
            raise InputError(f"{self.model} takes {len(self.inputs)} inputs ({names}), got {len(inputs)}")
        arrays = []
        for slot, array in zip(self.inputs, inputs):
            array = np.asarray(array)
            if array.shape != slot.shape or array.dtype != np.dtype(slot.dtype):
                raise InputError(f"{self.model}: input {slot.name!r} needs {slot.describe()}, "
                                 f"got {array.shape} {array.dtype}")
            arrays.append(np.ascontiguousarray(array).reshape(-1))
        return arrays


class Launcher:
    """The artifact loaded on a GPU: weights and scratch resident, each kernel's grid sized by
    the driver's occupancy API (every block co-resident, no more blocks than its widest stage
    has tiles), kernels launched in the artifact's order, host loops run here. The device gives
    the kernels: ``souffle.runtime.cuda.Device`` loads cubins, ``souffle.runtime.emulated``'s
    device builds the source to run on the CPU."""

    def __init__(self, artifact: KernelArtifact, model_weights: dict | None = None, device=None,
                 weight_arrays: dict | None = None):
        from souffle.runtime import cuda as rt

        self.artifact = artifact
        self.device = device or rt.Device()
        dynamic_shared = max((launch["dynamic_shared"] for launch in _kernel_launches(artifact.launches)), default=0)
        self.kernels = self.device.load_kernels(artifact.source, artifact.cubins, tuple(artifact.kernels), dynamic_shared)
        self.grids, self.per_sm = {}, {}
        for launch in _kernel_launches(artifact.launches):
            kernel = self.kernels[launch["kernel"]]
            kernel.allow_dynamic_shared(launch["dynamic_shared"])
            per_sm = kernel.max_active_blocks_per_sm(artifact.threads, launch["dynamic_shared"])
            if per_sm < 1:
                raise TargetError(f"{self.device.name}: kernel {launch['kernel']} cannot be resident (0 blocks of "
                                  f"{artifact.threads} threads and {launch['dynamic_shared']} B of dynamic shared "
                                  "memory per SM)")
            grid = min(self.device.sms * per_sm, launch["max_tiles"])
            if grid < launch["min_grid"]:
                raise TargetError(f"{self.device.name}: kernel {launch['kernel']} keeps weights on chip for a grid of "
                                  f"at least {launch['min_grid']} blocks, but only {grid} fit")
            self.grids[launch["kernel"]] = grid
            self.per_sm[launch["kernel"]] = per_sm
        if weight_arrays is None:  # ``artifact.weight_arrays(model_weights)``, when already rebuilt
            weight_arrays = artifact.weight_arrays(model_weights)
        self.resident = {name: self.device.upload(value) for name, value in weight_arrays.items()}
        for name, (dtype, elements) in artifact.arenas.items():
            self.resident[name] = self.device.alloc(max(elements, 1) * numpy_dtype(dtype).itemsize)

    @property
    def grid(self) -> int:
        """The widest grid any kernel launches with."""
        return max(self.grids.values())

    @property
    def blocks_per_sm(self) -> int:
        """Co-resident blocks per SM of the kernel with the widest grid."""
        return self.per_sm[max(self.grids, key=self.grids.get)]

    def arguments(self, inputs: list[np.ndarray], poison: bool = False):
        """The buffers by parameter name for these inputs (one array per input, in the artifact's
        order: ``KernelArtifact.checked_inputs``), and the outputs. ``poison`` fills the outputs
        and the scratch arenas with 0xFF bytes first (NaN), so an element no kernel wrote, or
        scratch read before it was written, shows in the outputs."""
        by_name = dict(self.resident)
        for slot, array in zip(self.artifact.inputs, self.artifact.checked_inputs(inputs)):
            by_name[slot.buffer] = self.device.upload(array)
        outputs = []
        for slot in self.artifact.outputs:
            by_name[slot.buffer] = self.device.alloc(slot.size * numpy_dtype(slot.dtype).itemsize)
            outputs.append((by_name[slot.buffer], slot))
        if poison:
            for name in (*self.artifact.arenas, *(slot.buffer for slot in self.artifact.outputs)):
                by_name[name].fill(0xFF)
        return by_name, outputs

    def prepare(self, buffers: dict, launches: list | None = None, counters: dict | None = None,
                stream=None) -> list:
        """One inference as a list of calls, one launch each, in order, on ``stream`` (the default
        stream if None): the kernels with warps of 32 along x and the block's warps along y
        (``codegen.schedule``), host loops unrolled with their counter passed to the kernels
        inside. Arguments are packed and checked here, once."""
        counters = counters or {}
        prepared = []
        for launch in self.artifact.launches if launches is None else launches:
            if "loop" in launch:
                for i in range(launch["trips"]):
                    prepared += self.prepare(buffers, launch["body"], {**counters, launch["loop"]: np.int64(i)},
                                             stream)
                continue
            name = launch["kernel"]
            grid = self.grids[name]
            args = [grid if p == "grid_size" else counters[p] if p in counters else buffers[p]
                    for p in self.artifact.kernels[name]]
            prepared.append(self.kernels[name].prepare(grid, (32, self.artifact.threads // 32, 1), args,
                                                       cooperative=launch["cooperative"], stream=stream,
                                                       shared_bytes=launch["dynamic_shared"]))
        return prepared

    def graph(self, buffers: dict):
        """One inference on ``buffers`` captured in a CUDA graph (``souffle.runtime.cuda.Graph``):
        replayed by one driver call however many launches it has."""
        from souffle.runtime.cuda import Device, Graph

        if not isinstance(self.device, Device):
            raise TargetError(f"a CUDA graph needs a GPU; {type(self.device).__name__} makes its launches one by one")

        def record(stream):
            for launch in self.prepare(buffers, stream=stream):
                launch()

        graph = Graph(self.device, record)
        # The graph's stream does not wait for the default one, where the buffers were uploaded
        # and poisoned: that work ends before any replay begins.
        self.device.synchronize()
        return graph

    def launch(self, buffers: dict) -> None:
        """One inference on ``buffers`` (``arguments``)."""
        for launch in self.prepare(buffers):
            launch()

    def run(self, inputs: list[np.ndarray], poison: bool = False, graph: bool = False) -> list[np.ndarray]:
        """The outputs of one inference; ``graph`` runs it as a replay of its CUDA graph."""
        buffers, outputs = self.arguments(inputs, poison)
        if graph:
            self.graph(buffers).launch()
        else:
            self.launch(buffers)
        self.device.synchronize()
        return [buffer.download(slot.dtype, slot.shape) for buffer, slot in outputs]

    def benchmark(self, inputs: list[np.ndarray], repeat: int = 50, warmup: int = 5,
                  graph: bool = False) -> list[float]:
        """Seconds per inference from CUDA events, inputs uploaded and launches prepared once;
        with ``graph``, each inference a replay of its CUDA graph, captured once."""
        from souffle.runtime.cuda import time_kernel

        buffers, _ = self.arguments(inputs)
        if graph:
            captured = self.graph(buffers)
            return time_kernel(captured.launch, self.device, warmup=warmup, repeat=repeat, stream=captured.stream)
        prepared = self.prepare(buffers)

        def inference():
            for launch in prepared:
                launch()

        return time_kernel(inference, self.device, warmup=warmup, repeat=repeat)


def _kernel_launches(launches: list):
    for launch in launches:
        if "loop" in launch:
            yield from _kernel_launches(launch["body"])
        else:
            yield launch


# ---------------------------------------------------------------------------------------------
# reading and checking the files


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path.parent} is an incomplete {what}: {path.name} is missing") from None
    except OSError as err:
        raise ArtifactError(f"{path}: cannot be read ({err.strerror})") from None


def read_json(path: Path, what: str):
    """The JSON value in ``path``, a file of a ``what`` ("kernel artifact", "check bundle")."""
    data = _read(path, what)
    if not data.strip():
        raise ArtifactError(f"{path}: empty file, expected JSON")
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: not valid JSON ({err.msg}: line {err.lineno} column {err.colno}): "
                            "truncated or not written by souffle") from None
    except UnicodeDecodeError:
        raise ArtifactError(f"{path}: not valid JSON (not UTF-8 text)") from None


def read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` archive ``path``, read in full (which checks each one's CRC)."""
    data = _read(path, what)
    if not data.startswith(b"PK"):  # np.load would read a lone .npy array, or try to unpickle
        raise ArtifactError(f"{path}: not an .npz archive (no zip header): empty, truncated or not written by souffle")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError) as err:
        raise ArtifactError(f"{path}: not a readable .npz archive ({err or type(err).__name__}): truncated or "
                            "not written by souffle") from None


def read_verified(path: Path, digest: str) -> bytes:
    data = _read(path, "kernel artifact")
    if sha256(data) != digest:
        raise ArtifactError(f"{path}: its SHA-256 is not the one {MANIFEST} records ({len(data)} bytes): the file was "
                            "changed or truncated after export")
    return data


class JsonFields:
    """Checks the values of one JSON file; a failure is an ArtifactError naming the file, the
    field (``where``: "inputs[0].shape") and the problem."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str):
        raise ArtifactError(f"{self.path}: {where + ': ' if where else ''}{problem}")

    def object(self, value, where: str, keys: tuple[str, ...]) -> dict:
        """``value``, an object with exactly ``keys``."""
        if not isinstance(value, dict):
            self.fail(where, f"expected an object, got {_kind(value)}")
        if missing := [key for key in keys if key not in value]:
            self.fail(where, f"missing key{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}")
        if extra := sorted(set(value) - set(keys)):
            self.fail(where, f"unexpected key{'s' * (len(extra) > 1)} {', '.join(map(repr, extra))}")
        return value

    def mapping(self, value, where: str) -> dict:
        """``value``, an object with any keys."""
        if not isinstance(value, dict):
            self.fail(where, f"expected an object, got {_kind(value)}")
        return value

    def list(self, value, where: str) -> list:
        if not isinstance(value, list):
            self.fail(where, f"expected a list, got {_kind(value)}")
        return value

    def string(self, value, where: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(where, f"expected a non-empty string, got {_kind(value)}")
        return value

    def integer(self, value, where: str, minimum: int = 0) -> int:
        if type(value) is not int or value < minimum:
            self.fail(where, f"expected an integer of at least {minimum}, got {_kind(value)}")
        return value

    def boolean(self, value, where: str) -> bool:
        if not isinstance(value, bool):
            self.fail(where, f"expected true or false, got {_kind(value)}")
        return value

    def number(self, value, where: str) -> float:
        """A finite, non-negative number."""
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            self.fail(where, f"expected a finite non-negative number, got {_kind(value)}")
        return value

    def dtype(self, value, where: str) -> str:
        if value not in SUPPORTED_DTYPES:
            self.fail(where, f"expected one of {', '.join(SUPPORTED_DTYPES)}, got {_kind(value)}")
        return value

    def shape(self, value, where: str) -> list[int]:
        for i, extent in enumerate(self.list(value, where)):
            self.integer(extent, f"{where}[{i}]", minimum=1)
        return value

    def digest(self, value, where: str) -> str:
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            self.fail(where, f"expected a SHA-256 of 64 lowercase hex digits, got {_kind(value)}")
        return value

    def unique(self, names: list[str], where: str) -> None:
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            self.fail(where, f"{', '.join(map(repr, repeated))} named more than once")


def _kind(value) -> str:
    """How a JSON value is named in an error: its type, and the value if short."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
    shown = json.dumps(value) if isinstance(value, (str, int, float, bool)) else ""
    return f"{kind} {shown}" if shown and len(shown) <= 40 else kind


_KEYS = ("format_version", "model", "config", "seed", "threads", "kernels", "launches", "inputs", "outputs",
         "weights", "arenas", "source_sha256", "cubins")
_LAUNCH_KEYS = ("kernel", "cooperative", "max_tiles", "dynamic_shared", "min_grid")
_LOOP_KEYS = ("loop", "trips", "body")
_SLOT_KEYS = ("name", "buffer", "shape", "dtype")
_WEIGHT_KEYS = ("buffer", "recipe", "shape", "dtype")


def _manifest(manifest, path: Path) -> dict:
    """``manifest``, checked as :meth:`KernelArtifact.load` says."""
    check = JsonFields(path)
    check.mapping(manifest, "")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        written = "no format_version (an artifact from before versions)" if version is None else \
            f"format_version {json.dumps(version)[:40]}"
        check.fail("", f"{written}; this souffle reads version {FORMAT_VERSION}: export the artifact again")
    check.object(manifest, "", _KEYS)
    check.string(manifest["model"], "model")
    if manifest["config"] is not None:
        check.string(manifest["config"], "config")
    check.integer(manifest["seed"], "seed")
    if check.integer(manifest["threads"], "threads", minimum=32) % 32 or manifest["threads"] > 1024:
        check.fail("threads", f"expected a multiple of 32 up to 1024, got {manifest['threads']}")
    check.digest(manifest["source_sha256"], "source_sha256")
    for arch, digest in check.mapping(manifest["cubins"], "cubins").items():
        if not ARCH.fullmatch(arch):  # it names the cubin's file, so also no path
            check.fail("cubins", f"{arch!r} is not a CUDA arch like 'sm_90'")
        check.digest(digest, f"cubins.{arch}")

    buffers = []
    for kind in ("inputs", "outputs"):
        slots = check.list(manifest[kind], kind)
        for i, slot in enumerate(slots):
            check.object(slot, f"{kind}[{i}]", _SLOT_KEYS)
            check.string(slot["name"], f"{kind}[{i}].name")
            buffers.append(check.string(slot["buffer"], f"{kind}[{i}].buffer"))
            check.shape(slot["shape"], f"{kind}[{i}].shape")
            check.dtype(slot["dtype"], f"{kind}[{i}].dtype")
        check.unique([slot["name"] for slot in slots], f"{kind} names")
    for i, weight in enumerate(check.list(manifest["weights"], "weights")):
        check.object(weight, f"weights[{i}]", _WEIGHT_KEYS)
        buffers.append(check.string(weight["buffer"], f"weights[{i}].buffer"))
        _recipe(check, weight["recipe"], f"weights[{i}].recipe")
        check.shape(weight["shape"], f"weights[{i}].shape")
        check.dtype(weight["dtype"], f"weights[{i}].dtype")
    for name, arena in check.mapping(manifest["arenas"], "arenas").items():
        if not isinstance(arena, list) or len(arena) != 2:
            check.fail(f"arenas.{name}", f"expected [dtype, elements], got {_kind(arena)}")
        check.dtype(arena[0], f"arenas.{name}[0]")
        check.integer(arena[1], f"arenas.{name}[1]")
        buffers.append(name)
    check.unique(buffers, "buffers (inputs, outputs, weights and arenas)")

    kernels = check.mapping(manifest["kernels"], "kernels")
    if not kernels:
        check.fail("kernels", "no kernel")
    for name, parameters in kernels.items():
        for i, parameter in enumerate(check.list(parameters, f"kernels.{name}")):
            check.string(parameter, f"kernels.{name}[{i}]")
        check.unique(parameters, f"kernels.{name}")
    _launches(check, manifest["launches"], "launches", kernels, set(buffers) | {"grid_size"}, ())
    return manifest


def _launches(check: JsonFields, launches, where: str, kernels: dict, bound: set[str], counters: tuple) -> None:
    """Each launch names a kernel of the artifact, every parameter of which is a buffer, the grid
    or the counter of a loop around the launch (the launcher looks each one up by name)."""
    for i, launch in enumerate(check.list(launches, where)):
        at = f"{where}[{i}]"
        if isinstance(launch, dict) and "loop" in launch:
            check.object(launch, at, _LOOP_KEYS)
            counter = check.string(launch["loop"], f"{at}.loop")
            if counter in bound or counter in counters:
                check.fail(f"{at}.loop", f"counter {counter!r} is also a buffer, the grid or an outer loop's counter")
            check.integer(launch["trips"], f"{at}.trips")
            _launches(check, launch["body"], f"{at}.body", kernels, bound, counters + (counter,))
            continue
        check.object(launch, at, _LAUNCH_KEYS)
        kernel = check.string(launch["kernel"], f"{at}.kernel")
        if kernel not in kernels:
            check.fail(f"{at}.kernel", f"{kernel!r} is not one of the kernels ({', '.join(kernels)})")
        check.boolean(launch["cooperative"], f"{at}.cooperative")
        check.integer(launch["dynamic_shared"], f"{at}.dynamic_shared")
        max_tiles = check.integer(launch["max_tiles"], f"{at}.max_tiles", minimum=1)
        if check.integer(launch["min_grid"], f"{at}.min_grid", minimum=1) > max_tiles:
            check.fail(f"{at}.min_grid", f"{launch['min_grid']} is more than max_tiles {max_tiles}")
        if unbound := [p for p in kernels[kernel] if p not in bound and p not in counters]:
            check.fail(at, f"kernel {kernel!r} takes {', '.join(map(repr, unbound))}, which no input, output, weight, "
                           "arena or enclosing loop provides")


def _numeric_dtype(check: JsonFields, name, where: str) -> None:
    try:
        dtype = numpy_dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or (dtype.kind not in "biuf" and name != "bfloat16"):
        check.fail(where, f"expected a numeric dtype, got {_kind(name)}")


def _recipe(check: JsonFields, recipe, where: str) -> None:
    """A weight recipe, in the grammar of ``souffle.recipe``."""
    arity = {"model": 2, "stack": 2, "concat": 3, "pad": 3, "take": 4, "add": 2, "const": 4, "cast": 3}
    if not isinstance(recipe, list) or not recipe or recipe[0] not in arity or len(recipe) != arity[recipe[0]]:
        check.fail(where, f"not a weight recipe (one of {', '.join(arity)}, with its arguments)")
    kind = recipe[0]
    if kind == "model":
        check.string(recipe[1], f"{where}[1]")
    elif kind in ("stack", "add", "concat"):
        if kind == "concat":
            check.integer(recipe[1], f"{where}[1]", minimum=-64)
        parts = check.list(recipe[-1], f"{where}[{len(recipe) - 1}]")
        if not parts:
            check.fail(f"{where}[{len(recipe) - 1}]", f"{kind} of nothing")
        for i, part in enumerate(parts):
            _recipe(check, part, f"{where}[{len(recipe) - 1}][{i}]")
    elif kind == "pad":
        for i, widths in enumerate(check.list(recipe[1], f"{where}[1]")):
            if not isinstance(widths, list) or len(widths) != 2:
                check.fail(f"{where}[1][{i}]", f"expected [before, after], got {_kind(widths)}")
            check.integer(widths[0], f"{where}[1][{i}][0]")
            check.integer(widths[1], f"{where}[1][{i}][1]")
        _recipe(check, recipe[2], f"{where}[2]")
    elif kind == "take":
        check.integer(recipe[1], f"{where}[1]", minimum=-64)
        for i, index in enumerate(check.list(recipe[2], f"{where}[2]")):
            check.integer(index, f"{where}[2][{i}]")
        _recipe(check, recipe[3], f"{where}[3]")
    else:
        _numeric_dtype(check, recipe[1], f"{where}[1]")
        if kind == "cast":
            _recipe(check, recipe[2], f"{where}[2]")
            return
        shape = check.list(recipe[2], f"{where}[2]")
        for i, extent in enumerate(shape):
            check.integer(extent, f"{where}[2][{i}]")
        values = check.list(recipe[3], f"{where}[3]")
        if not all(type(v) in (int, float, bool) for v in values) or len(values) != math.prod(shape):
            check.fail(f"{where}[3]", f"expected {math.prod(shape)} numbers for shape {shape}")
