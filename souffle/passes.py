"""Pass pipelines and the one runner that applies them.

A pass is a name, the opt level from which it runs, and a pure function from one IR to the next
(Graph, TE program, staged program, TIR, CUDA source, built module); it may also say what it
did (``Outcome``). A pipeline is one declared, ordered list of passes, like Triton's stages or
TVM's ``tvm.transform.Sequential`` (``codegen.pipelines`` declares one per target).
``Pipeline.run`` applies the passes an opt level asks for, times each, collects what each says
it did, and writes (``dump_dir``) or prints (``print_after``) the IR after every pass, as
Halide's ``lower_impl`` logs it.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

from souffle.errors import SouffleError, TargetError


class Outcome(NamedTuple):
    """What a pass returns when it has more to say than its IR: one line per thing it did."""

    ir: object
    notes: list[str]


@dataclass(frozen=True)
class IRKind:
    """What a pass returns, as its dump names it: the file suffix of ``str(ir)``."""

    name: str
    suffix: str


@dataclass(frozen=True)
class CompileOptions:
    """What every pass may read besides its IR."""

    target: str
    opt_level: int | None  # None where the pipeline has no opt levels
    threads: int | None  # threads per block of the persistent kernel
    device: object  # the device model (analysis.device.DeviceModel) the passes size things for
    validate: bool = False  # run the thread-level validator on CUDA kernels (off only for debugging once it is on)
    precision: str = "fp32"  # what the model computes in (``souffle.precision``)
    # cuda: a MetaSchedule database (directory) whose records schedule the stages they match (``codegen.tuned``)
    database: str | None = None


@dataclass(frozen=True)
class Pass:
    """``run(ir, options)`` returns the next IR (of kind ``ir``), or an ``Outcome``; ``section``
    names the part of the compile report its notes go to (None: dumps only)."""

    name: str
    run: Callable[[object, CompileOptions], object]
    ir: IRKind
    from_level: int = 0
    section: str | None = None


@dataclass(frozen=True)
class PassRecord:
    """One pass as it ran."""

    name: str
    seconds: float
    notes: tuple[str, ...]
    section: str | None


@dataclass
class PipelineRun:
    """The passes that ran, in order, and the last IR of each kind (``irs``); ``ir`` is the result."""

    pipeline: Pipeline
    options: CompileOptions
    records: list[PassRecord] = field(default_factory=list)
    irs: dict[str, object] = field(default_factory=dict)
    ir: object = None

    def seconds(self) -> dict[str, float]:
        return {r.name: r.seconds for r in self.records}

    def notes(self, section: str, prefixed: bool = False) -> list[str]:
        """The notes of the passes reporting to ``section``, in order (``prefixed``: each as
        "pass: note")."""
        return [f"{r.name}: {note}" if prefixed else note
                for r in self.records if r.section == section for note in r.notes]


@dataclass(frozen=True)
class Pipeline:
    """One target's passes in order. ``device`` names the device model it compiles for by
    default (a model of the same kind may replace it); ``levels`` are the opt levels it accepts,
    each with what it adds (none: it has one); ``threads`` the thread-block size of its kernels
    by default (None: no thread blocks)."""

    target: str
    input_ir: IRKind
    passes: tuple[Pass, ...]
    device: str = "cpu"
    levels: dict[int, str] = field(default_factory=dict)
    default_level: int | None = None
    threads: int | None = None

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def check_level(self, level) -> int | None:
        """The opt level to compile at (the default for None), or a clear error."""
        if not self.levels:
            if level is not None:
                raise TargetError(f"opt levels are the persistent kernel's (targets cuda and llvm-persistent); "
                                  f"target {self.target!r} has its own CPU pipeline")
            return None
        level = self.default_level if level is None else level
        if not isinstance(level, int) or isinstance(level, bool) or level not in self.levels:
            raise SouffleError(f"opt level must be one of {', '.join(map(str, self.levels))}, got {level!r}")
        return level

    def check_threads(self, threads) -> int | None:
        """The thread-block size to compile for (the default for None), or a clear error."""
        if self.threads is None:
            if threads is not None:
                raise TargetError(f"threads per block are the persistent kernel's (targets cuda and llvm-persistent); "
                                  f"target {self.target!r} runs one function on the CPU's threads")
            return None
        threads = self.threads if threads is None else threads
        if not (isinstance(threads, int) and not isinstance(threads, bool) and 32 <= threads <= 1024
                and threads % 32 == 0):
            raise TargetError(f"threads must be a multiple of 32 from 32 to 1024, got {threads!r}")
        return threads

    def describe(self) -> str:
        """The pipeline as declared: one line per pass, with the IR it returns and the opt level
        from which it runs."""
        levels = (f"; opt levels {min(self.levels)}-{max(self.levels)}, default O{self.default_level}"
                  if self.levels else "")
        lines = [f"{self.target} (from a {self.input_ir.name}{levels}; device model {self.device})"]
        for k, p in enumerate(self.passes, 1):
            level = f"from O{p.from_level}" if p.from_level else ""
            lines.append(f"  {k:02d} {p.name:<24} -> {p.ir.name:<8} {level}".rstrip())
        return "\n".join(lines)

    def runs_at(self, p: Pass, level: int | None) -> bool:
        return level is None or p.from_level <= level

    def dump_name(self, p: Pass) -> str:
        """``NN-name.suffix``: NN the pass's place in the declared list (01 first; 00 is the input)."""
        return f"{self.passes.index(p) + 1:02d}-{p.name}.{p.ir.suffix}"

    def run(self, ir, options: CompileOptions, start: str | None = None, stop: str | None = None,
            dump_dir: str | Path | None = None, print_after: Iterable[str] = (), out: TextIO | None = None) -> PipelineRun:
        """Apply the passes from ``start`` to ``stop`` (inclusive; by default all) that run at
        ``options.opt_level`` to ``ir``; see the module docstring for dumps and prints."""
        level = options.opt_level
        chosen = self._between(start, stop)
        wanted = set(print_after)
        self._check_printed(wanted, chosen, level)
        directory = _dump_directory(dump_dir, self) if dump_dir is not None else None
        if directory is not None:
            first = self.passes.index(chosen[0])
            given = self.passes[first - 1].ir if first else self.input_ir
            (directory / f"00-input.{given.suffix}").write_text(_text(ir))
        result = PipelineRun(self, options)
        for p in chosen:
            if not self.runs_at(p, level):
                continue
            began = time.perf_counter()
            returned = p.run(ir, options)
            seconds = time.perf_counter() - began
            ir, notes = returned if isinstance(returned, Outcome) else (returned, [])
            result.records.append(PassRecord(p.name, seconds, tuple(notes), p.section))
            result.irs[p.ir.name] = ir
            if directory is not None:
                (directory / self.dump_name(p)).write_text(_text(ir))
            if p.name in wanted:
                print(f"-- IR after {p.name} ({p.ir.name}) --\n{_text(ir)}", end="", file=out or sys.stdout)
        result.ir = ir
        return result

    def _between(self, start: str | None, stop: str | None) -> list[Pass]:
        for name in (start, stop):
            if name is not None and name not in self.names:
                raise SouffleError(f"target {self.target!r} has no pass {name!r}; its passes: {', '.join(self.names)}")
        first = self.names.index(start) if start else 0
        last = self.names.index(stop) if stop else len(self.passes) - 1
        return list(self.passes[first:last + 1])

    def _check_printed(self, wanted: set[str], chosen: list[Pass], level: int | None):
        unknown = sorted(wanted - set(self.names))
        if unknown:
            raise SouffleError(f"cannot print after {', '.join(map(repr, unknown))}: target {self.target!r} has no such "
                               f"pass; its passes: {', '.join(self.names)}")
        for p in self.passes:
            if p.name in wanted and p not in chosen:
                raise SouffleError(f"cannot print after {p.name!r}: this run applies only the passes from "
                                   f"{chosen[0].name} to {chosen[-1].name}")
            if p.name in wanted and not self.runs_at(p, level):
                raise SouffleError(f"cannot print after {p.name!r}: it runs from opt level {p.from_level}, "
                                   f"and this compile is at O{level}")


def _text(ir) -> str:
    text = str(ir)
    return text if text.endswith("\n") else text + "\n"


def _dump_directory(path: str | Path, pipeline: Pipeline) -> Path:
    """``path``, created if needed, without the dumps an earlier run of this pipeline left there."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise SouffleError(f"cannot dump the IR into {directory}: it is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    names = "|".join(map(re.escape, ["input", *pipeline.names]))
    for old in directory.iterdir():
        if re.fullmatch(rf"\d\d-({names})\..+", old.name) and old.is_file():
            old.unlink()
    return directory
