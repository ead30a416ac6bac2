"""A bundle's timeline build (``codegen.timeline``) run and read back: numpy and cuda-python only.

``timeline.json`` beside a check bundle names the kernel, the stamps it takes per inference
(one at its start and one after each grid barrier), the segments between them with the stages
each holds and the latency model's estimate, and the instrumented source and cubins by SHA-256.
``measure`` runs the instrumented kernel (its outputs still checked against PyTorch's) and
returns each segment's time: block 0's ``%globaltimer`` between consecutive stamps, the median
over the runs, with its SM's clock cycles beside it. The last segment runs from the last
barrier to the kernel's end, which nothing stamps: the CUDA-event time of the whole kernel
bounds it.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from souffle.runtime.artifact import ArtifactError, JsonFields, Launcher, read_verified, read_json
from souffle.runtime.check import Check

TIMELINE = "timeline.json"
SOURCE = "timeline.kernel.cu"
STAMPS = "souffle_timeline"  # as codegen.timeline names them in the source
COUNT = "souffle_timeline_count"


def cubin_file(arch: str) -> str:
    return f"timeline.{arch}.cubin"


@dataclass
class Timeline:
    kernel: str
    segments: list[dict]  # {"stages": [...], "estimate_us": float}
    source: str
    cubins: dict[str, bytes]
    resources: dict  # ptxas' registers, spills and stack of the kernel and of this build

    @property
    def stamps(self) -> int:
        """Stamps per inference: the kernel's start and each grid barrier."""
        return len(self.segments)

    @classmethod
    def load(cls, directory) -> Timeline | None:
        """The bundle's timeline build; None where it has none (``static.json`` says why)."""
        directory = Path(directory)
        path = directory / TIMELINE
        if not path.exists():
            return None
        fields = JsonFields(path)
        data = fields.object(read_json(path, "timeline"), "",
                             ("kernel", "segments", "source_sha256", "cubins", "resources"))
        segments = fields.list(data["segments"], "segments")
        for i, segment in enumerate(segments):
            fields.object(segment, f"segments[{i}]", ("stages", "estimate_us"))
        source = read_verified(directory / SOURCE, fields.digest(data["source_sha256"], "source_sha256")).decode()
        cubins = {arch: read_verified(directory / cubin_file(arch), fields.digest(digest, f"cubins.{arch}"))
                  for arch, digest in fields.mapping(data["cubins"], "cubins").items()}
        return cls(fields.string(data["kernel"], "kernel"), segments, source, cubins,
                   fields.mapping(data["resources"], "resources"))


def measure(check: Check, timeline: Timeline, repeat: int = 20, warmup: int = 3, device=None) -> dict:
    """Each segment's time on ``device`` (default the first GPU): median ns and cycles over
    ``repeat`` inferences after ``warmup``, and whether the instrumented kernel's outputs pass."""
    artifact = dataclasses.replace(check.artifact, source=timeline.source, cubins=timeline.cubins)
    launcher = Launcher(artifact, device=device)
    if len(artifact.kernels) != 1:
        raise ArtifactError(f"{artifact.model}: a timeline times one kernel, the artifact has {len(artifact.kernels)}")
    module = launcher.kernels[timeline.kernel].module
    buffers, outputs = launcher.arguments(check.inputs, poison=True)
    prepared = launcher.prepare(buffers)
    samples = []
    for run in range(warmup + repeat):
        module.zero_global(COUNT, 4)
        for launch in prepared:
            launch()
        launcher.device.synchronize()
        taken = int(module.read_global(COUNT, np.uint32, ())[()])
        if taken != timeline.stamps:
            raise ArtifactError(f"{artifact.model}: the kernel took {taken} stamps, its timeline has "
                                f"{timeline.stamps} segments")
        if run >= warmup:
            samples.append(module.read_global(STAMPS, np.uint64, (timeline.stamps, 2)).astype(np.int64))
    results = [buffer.download(slot.dtype, slot.shape) for buffer, slot in outputs]
    stamped = [np.diff(sample, axis=0) for sample in samples]  # segment k ends at stamp k + 1
    rows = []
    for k, segment in enumerate(timeline.segments):
        row = {"segment": k, "stages": segment["stages"], "estimate_us": segment["estimate_us"]}
        if k < timeline.stamps - 1:
            row["measured_us"] = statistics.median(float(s[k, 0]) for s in stamped) / 1e3
            row["cycles"] = statistics.median(int(s[k, 1]) for s in stamped)
        rows.append(row)
    return {"passes": check.passes(results), "runs": len(samples), "segments": rows, "resources": timeline.resources,
            "stamped_us": statistics.median(float(s[-1, 0] - s[0, 0]) for s in samples) / 1e3}
