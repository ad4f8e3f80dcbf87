"""The fs EC connector: one safetensors file per put in a shared directory (for debugging, and for
hosts that share nothing but a filesystem).

Files are written under a temporary name and renamed into place, so a consumer never sees a
partial file; the wire header rides in the safetensors metadata. A consumer's release deletes the
file; the producer deletes its own files once they are older than ``ttl_s`` and, at start, the
files of dead producers on the same host (the name carries a host tag and the owner's pid)::

    epd-ec-<instance>-<pid>-<host tag>-<sequence>.safetensors
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import socket
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import msgspec
import safetensors
import safetensors.torch
import torch
import xxhash

from epdserve.transfer import header as wire
from epdserve.transfer.base import Handle, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.owners import pid_alive

FILE_RE = re.compile(
    r"epd-ec-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-(?P<seq>[0-9a-f]+)\.safetensors"
)
TMP_PREFIX = ".tmp-"
TENSOR_NAME = "embeddings"
METADATA_KEY = "epd_ec_header"


def host_tag() -> str:
    """A short tag of this host: pids are only meaningful on the host that issued them."""
    return xxhash.xxh32_hexdigest(socket.gethostname().encode())


def remove_stale_files(fs_dir: Path, host: str) -> list[Path]:
    """Delete files (finished or half-written) of dead producers on this host."""
    removed = []
    for path in fs_dir.iterdir():
        m = FILE_RE.fullmatch(path.name.removeprefix(TMP_PREFIX))
        if m is not None and m["host"] == host and not pid_alive(int(m["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class FsLocation(msgspec.Struct):
    """The fs fields of a handle."""

    path: str  # the safetensors file


class FsProducer:
    """Writes one file per put into ``cfg.fs_dir``. Thread-safe."""

    name = "fs"

    def __init__(self, cfg: ECConfig) -> None:
        self._cfg = cfg
        self._dir = Path(cfg.fs_dir)
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TransferError(f"cannot create the EC directory {self._dir}: {e}") from e
        self._host = host_tag()
        remove_stale_files(self._dir, self._host)
        self._seq = itertools.count()
        self._written: deque[tuple[float, Path]] = deque()  # (put time, file), oldest first
        self._lock = threading.Lock()

    def put(self, key: str, tensor: torch.Tensor, model_id: str) -> Handle:
        src = wire.raw_bytes(tensor)
        header = wire.make_header(key, model_id, tensor, wire.checksum(src))
        with self._lock:
            name = f"epd-ec-{self._cfg.instance}-{os.getpid()}-{self._host}-{next(self._seq):x}.safetensors"
        path = self._dir / name
        tmp = self._dir / (TMP_PREFIX + name)
        metadata = {METADATA_KEY: wire.encode(header).decode()}
        try:
            safetensors.torch.save_file({TENSOR_NAME: tensor.detach().cpu().contiguous()}, tmp, metadata=metadata)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TransferError(f"cannot write embeddings to {path}: {e}") from e
        with self._lock:
            self._written.append((time.monotonic(), path))
            self._expire()
        return wire.to_handle(header, self.name, path=str(path))

    def _expire(self) -> None:
        deadline = time.monotonic() - self._cfg.ttl_s
        while self._written and self._written[0][0] < deadline:
            _, path = self._written.popleft()
            path.unlink(missing_ok=True)  # gone already if its consumer released it

    def close(self) -> None:
        """Files still unreleased stay for their consumers; the next start of a producer on this
        host removes them once this process is gone."""
        with self._lock:
            self._expire()

    def __enter__(self) -> FsProducer:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


class FsConsumer:
    """Reads fs handles whose files live directly in ``cfg.fs_dir``."""

    def __init__(self, cfg: ECConfig) -> None:
        self._dir = os.path.realpath(cfg.fs_dir) if cfg.fs_dir else ""
        self._dtypes = cfg.dtypes

    def _path(self, handle: Handle) -> str:
        path = wire.location_of(handle, FsLocation).path
        if not self._dir:
            raise TransferError("fs EC handles are refused: this instance has no fs_dir configured")
        real = os.path.realpath(path)
        if os.path.dirname(real) != self._dir or not FILE_RE.fullmatch(os.path.basename(real)):
            raise TransferError(f"fs handle path {path!r} is not an EC file under {self._dir}")
        return real

    async def get(self, handle: Handle, rows: int, width: int, model_id: str) -> torch.Tensor:
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes)
        path = self._path(handle)
        if header.nbytes >= wire.THREAD_BYTES:
            return await asyncio.to_thread(self._read, header, path)
        return self._read(header, path)

    @staticmethod
    def _read(header: wire.WireHeader, path: str) -> torch.Tensor:
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                stored = (f.metadata() or {}).get(METADATA_KEY, "")
                wire.check_same(header, wire.decode(stored.encode()), path)
                tensor: torch.Tensor = f.get_tensor(TENSOR_NAME)
        except FileNotFoundError as e:
            raise TransferError(
                f"embeddings for key {header.key!r} are gone from {path} (already released, or older than the producer's ttl_s)"
            ) from e
        except (OSError, safetensors.SafetensorError) as e:
            raise TransferError(f"cannot read embeddings from {path}: {e}") from e
        if list(tensor.shape) != list(header.shape) or tensor.dtype != wire.TORCH_DTYPES[header.dtype]:
            raise TransferError(
                f"{path} holds a {tensor.dtype} tensor of shape {list(tensor.shape)}, not what its header says"
            )
        out = wire.new_buffer(header.nbytes)
        digest = wire.copy_and_checksum(out, tensor.contiguous().view(torch.uint8).reshape(-1).numpy())
        wire.check_checksum(header, digest)
        return wire.as_tensor(header, out)

    async def release(self, handle: Handle) -> None:
        try:
            os.unlink(self._path(handle))
        except FileNotFoundError:
            pass  # released before, or expired
        except OSError as e:
            raise TransferError(f"cannot delete the EC file {handle.get('path')!r}: {e}") from e

    async def close(self) -> None:
        return None
