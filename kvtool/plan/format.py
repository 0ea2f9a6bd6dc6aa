"""The on-disk format of a plan: plan.json (with a digest over its own content), a streamed
safetensors writer that hashes while it writes, chunked file checksums, and the record of a
verified checksum that spares loads from re-hashing multi-GB weights."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
CHECKSUM_ALGORITHM = "sha256"  # hardware-accelerated on x86 and ARM: ~1.5 GB/s, faster than blake2b here
_CHUNK_BYTES = 16 << 20
VERIFIED_SUFFIX = ".verified.json"  # weights.safetensors -> weights.verified.json

_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # torch dtype names


def file_checksum(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks so multi-GB weights need no extra memory."""
    digest = hashlib.new(CHECKSUM_ALGORITHM)
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            count = f.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
    return digest.hexdigest()


def verified_record_path(path: Path) -> Path:
    """Where the record of ``path``'s verified checksum lives (beside it)."""
    return path.with_suffix(VERIFIED_SUFFIX)


def _file_identity(stat: os.stat_result) -> dict[str, int]:
    # Rewriting a file changes its mtime and ctime (which, unlike mtime, cannot be set back);
    # replacing or copying it gives it another inode.
    return {"size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns,
            "inode": stat.st_ino, "device": stat.st_dev}


def record_verified_checksum(path: Path, checksum: str) -> None:
    """Record that ``path``, as it is on disk now, has ``checksum`` (just hashed or written), so
    has_verified_checksum can vouch for it until it changes. Best effort: in a read-only directory
    nothing is recorded and later checks hash the file again."""
    path = Path(path)
    record = {"file": path.name, "checksum_algorithm": CHECKSUM_ALGORITHM, "checksum": checksum,
              **_file_identity(path.stat())}
    target = verified_record_path(path)
    try:
        # Written aside and renamed: a concurrent load never reads half a record.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp, target)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def has_verified_checksum(path: Path, checksum: str) -> bool:
    """True when record_verified_checksum recorded ``checksum`` for ``path`` and the file has not
    changed since (same size, mtime, ctime, inode and device); False means: hash it."""
    path = Path(path)
    record_path = verified_record_path(path)
    try:
        record = json.loads(record_path.read_text())
        recorded_at = record_path.stat().st_mtime_ns
        stat = path.stat()
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict):
        return False
    expected = {"file": path.name, "checksum_algorithm": CHECKSUM_ALGORITHM, "checksum": checksum,
                **_file_identity(stat)}
    # File times have a coarse granularity: a file rewritten in the same tick as the record was
    # taken keeps the recorded times, so only a file older than the record is vouched for (git's
    # "racily clean" rule). Such a file is hashed, and then recorded again.
    return all(record.get(key) == value for key, value in expected.items()) and \
        max(stat.st_mtime_ns, stat.st_ctime_ns) < recorded_at


def manifest_digest(manifest: dict[str, Any]) -> str:
    """Digest of plan.json's content minus the digest itself: detects hand edits."""
    content = {key: value for key, value in manifest.items() if key != "plan_digest"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_manifest(plan_dir: Path, manifest: dict[str, Any]) -> None:
    """Write plan.json atomically with a fresh digest. Work that adds to a plan (e.g. compiled
    kernel artifacts) edits the dict and calls this, so the plan stays loadable."""
    manifest = {**manifest, "plan_digest": manifest_digest(manifest)}
    tmp = plan_dir / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, plan_dir / PLAN_FILE)


class _HashingWriter:
    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.digest = hashlib.new(CHECKSUM_ALGORITHM)
        self.num_bytes = 0

    def write(self, data) -> None:
        self._f.write(data)
        self.digest.update(data)
        self.num_bytes += len(data)


def write_safetensors_streaming(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                                tensors: Iterable[tuple[str, torch.Tensor]],
                                metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write a safetensors file one tensor at a time (memory: the largest tensor, not the model).

    ``specs`` gives every tensor's shape and dtype in file order, so the header is written first;
    ``tensors`` must then yield exactly those tensors in that order. Returns (size in bytes, checksum).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, (shape, dtype) in specs.items():
        num_bytes = _element_size(dtype)
        for dim in shape:
            num_bytes *= dim
        header[name] = {"dtype": _SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                        "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-(8 + len(header_bytes)) % 8)  # data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        writer.write(struct.pack("<Q", len(header_bytes)))
        writer.write(header_bytes)
        expected = iter(specs.items())
        for name, tensor in tensors:
            spec_name, (shape, dtype) = next(expected, (None, (None, None)))
            if name != spec_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the shape "
                                 f"the model config gives it ({spec_name} {shape} {dtype})")
            for chunk in _tensor_chunks(tensor):
                writer.write(chunk)
        if next(expected, None) is not None:
            raise RuntimeError("fewer tensors were streamed than the safetensors header announced")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return writer.num_bytes, writer.digest.hexdigest()


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _tensor_chunks(tensor: torch.Tensor) -> Iterator[memoryview]:
    # Little-endian raw bytes, as safetensors stores them (every supported host is little-endian).
    import torch  # here: reading a plan's files (kvtool plans) needs no torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(flat)
    for start in range(0, len(view), _CHUNK_BYTES):
        yield view[start:start + _CHUNK_BYTES]
