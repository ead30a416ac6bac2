"""Accepted verdicts of the thread-level validator, cached like the cubins.

A recompile whose cubin comes from nvcc's cache still paid for the validator (55-68% of a
BERT or LSTM recompile, benchmarks/results/validate_time.md). The verdict depends only on the
kernels as printed (the CUDA source is TVM's rendering of the lowered kernels the validator
reads), the block size, the host loops' trip counts, the smallest grids, and the validator
itself; the key holds all of them, the validator as the SHA-256 of its source and the versions
of islpy and TVM. Only acceptances are stored: a rejection raises and is recomputed every time.
An entry is sealed by its own SHA-256; one that does not verify is recomputed with a
``CacheWarning``, and a cache that cannot be written is skipped with one.
"""

from __future__ import annotations

import functools
import json
import warnings
from importlib import metadata
from pathlib import Path

import analysis.threads
from souffle.runtime.cuda import CacheWarning, cache_root, canonical_json, sha256_hex, write_atomic

_FORMAT = 1
_unwritable: set[Path] = set()


def cache_dir() -> Path:
    return cache_root("validated")


@functools.cache
def _validator_digest() -> str:
    source = Path(analysis.threads.__file__).read_bytes()
    versions = [metadata.version(package) for package in ("islpy", "apache-tvm")]
    return sha256_hex(source + json.dumps(versions).encode())


def key(source: str, threads: int, counters: dict, min_grids: dict) -> str:
    """The digest naming one validation: everything the verdict depends on."""
    text = json.dumps({"source": source, "threads": threads, "counters": {str(k): v for k, v in counters.items()},
                       "min_grids": min_grids, "validator": _validator_digest(), "format": _FORMAT},
                      sort_keys=True, default=str)
    return sha256_hex(text.encode())


def load(digest: str) -> dict[str, list[str]] | None:
    """The cached acceptance (each kernel's notes), or None on a miss or an entry that does not verify."""
    path = cache_dir() / f"{digest}.json"
    try:
        entry = json.loads(path.read_bytes())
        seal = entry.pop("sha256")
        if seal != sha256_hex(canonical_json(entry)) or entry.get("key") != digest:
            raise ValueError("its seal or key does not match")
        return {name: list(notes) for name, notes in entry["kernels"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        warnings.warn(f"validator cache entry {path} does not verify ({err}): validating again", CacheWarning,
                      stacklevel=2)
        return None


def store(digest: str, kernels: dict[str, list[str]]) -> None:
    """Record an acceptance; a cache that cannot be written is skipped, with one warning."""
    directory = cache_dir()
    entry = {"key": digest, "kernels": kernels}
    entry["sha256"] = sha256_hex(canonical_json(entry))
    path = directory / f"{digest}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(entry).encode())
    except OSError as err:
        if directory not in _unwritable:
            _unwritable.add(directory)
            warnings.warn(f"validator cache {directory} cannot be written ({err}): verdicts go uncached",
                          CacheWarning, stacklevel=2)
