"""The fs EC connector: one safetensors file per stored payload in a private directory (for
debugging, and for hosts that share nothing but a filesystem), and one empty file per lease.

Files are written under a temporary name and renamed into place, so a consumer never sees a
partial file; the wire header rides in the safetensors metadata::

    epd-ec-<instance>-<pid>-<host tag>-<random id>.safetensors            the payload
    epd-ec-<instance>-<pid>-<host tag>-<random id>.safetensors.<lease>.lease   one per live lease

A consumer's release deletes only its lease file, and a failed read deletes nothing. The producer
deletes a payload once none of its lease files is left, expires leases older than ``ttl_s``, and,
at start, deletes the files of dead producers on the same host (the name carries a host tag and
the owner's pid). Handles are signed, so a consumer only touches files a producer named.

The directory must be private: a directory others can write to, or that belongs to someone else,
would let them plant or swap payloads, so both sides refuse it (and a symlink in its place).
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import msgspec
import safetensors
import safetensors.torch
import torch
import xxhash

from epdserve.common.dtypes import torch_dtype
from epdserve.common.pids import pid_alive
from epdserve.transfer import header as wire
from epdserve.transfer import signing
from epdserve.transfer.base import Handle, InvalidHandle, ProducerFull, TransferError
from epdserve.transfer.config import ECConfig

_NAME = r"epd-ec-(?P<instance>[A-Za-z0-9_.-]+)-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-(?P<id>[0-9a-f]+)\.safetensors"
FILE_RE = re.compile(_NAME)
LEASE_RE = re.compile(r"[0-9a-f]{32}")
_OWNED_RE = re.compile(_NAME + r"(?:\.[0-9a-f]{32}\.lease)?")  # payloads and lease files
TMP_PREFIX = ".tmp-"
LEASE_SUFFIX = ".lease"
TENSOR_NAME = "embeddings"
METADATA_KEY = "epd_ec_header"
_GONE = "the embeddings of this EC handle were released or have expired"

CacheKey = tuple[str, str, str, tuple[int, ...]]  # key, model_id, dtype, shape


def host_tag() -> str:
    """A short tag of this host: pids are only meaningful on the host that issued them."""
    return xxhash.xxh32_hexdigest(socket.gethostname().encode())


def lease_path(payload: str | Path, lease: str) -> Path:
    return Path(f"{payload}.{lease}{LEASE_SUFFIX}")


def check_private_dir(path: str | Path) -> None:
    """Refuse a directory that is a symlink, not ours, or writable by group or others."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise TransferError(f"the EC directory {path} is not usable: {e.strerror or e}") from e
    if stat.S_ISLNK(st.st_mode):
        raise TransferError(f"the EC directory {path} is a symlink; give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise TransferError(f"the EC directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise TransferError(
            f"the EC directory {path} belongs to uid {st.st_uid}, not to this process (uid {os.getuid()})"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TransferError(f"the EC directory {path} is writable by group or others (chmod 700 it)")


def remove_stale_files(fs_dir: Path, host: str) -> list[Path]:
    """Delete files (finished, half-written or leases) of dead producers on this host."""
    removed = []
    for path in fs_dir.iterdir():
        m = _OWNED_RE.fullmatch(path.name.removeprefix(TMP_PREFIX))
        if m is not None and m["host"] == host and not pid_alive(int(m["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class FsLocation(msgspec.Struct):
    """The fs fields of a handle."""

    path: str  # the payload's safetensors file


@dataclass
class _Entry:
    path: Path
    header: wire.WireHeader
    leases: dict[str, float] = field(default_factory=dict)  # lease -> time.monotonic() deadline


class FsProducer:
    """Writes one file per distinct payload into ``cfg.fs_dir``, one lease file per put. Thread-safe."""

    name = "fs"

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key
        self._cfg = cfg
        self._dir = Path(cfg.fs_dir)
        try:
            os.makedirs(self._dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise TransferError(f"cannot create the EC directory {self._dir}: {e}") from e
        check_private_dir(self._dir)  # it may have existed already, made by someone else
        self._host = host_tag()
        remove_stale_files(self._dir, self._host)
        self._entries: dict[CacheKey, _Entry] = {}
        self._lock = threading.Lock()

    def put(self, key: str, tensor: torch.Tensor, model_id: str, levels: int = 1) -> Handle:
        src = wire.raw_bytes(tensor)
        draft = wire.make_header(key, model_id, tensor, "0" * 16, levels)
        cache_key = (key, model_id, draft.dtype, draft.shape)
        with self._lock:
            self._sweep()
            entry = self._entries.get(cache_key)
            if entry is not None:
                return self._lease(entry)
        header = wire.make_header(key, model_id, tensor, wire.checksum(src), levels)
        path = self._write(header, tensor)
        with self._lock:
            entry = self._entries.get(cache_key)
            if entry is None:
                entry = self._entries[cache_key] = _Entry(path, header)
            else:  # another put stored the same payload meanwhile
                path.unlink(missing_ok=True)
            return self._lease(entry)

    def _write(self, header: wire.WireHeader, tensor: torch.Tensor) -> Path:
        name = f"epd-ec-{self._cfg.instance}-{os.getpid()}-{self._host}-{secrets.token_hex(16)}.safetensors"
        path = self._dir / name
        tmp = self._dir / (TMP_PREFIX + name)
        metadata = {METADATA_KEY: wire.encode(header).decode()}
        try:
            safetensors.torch.save_file({TENSOR_NAME: tensor.detach().cpu().contiguous()}, tmp, metadata=metadata)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ProducerFull(f"no space left for embeddings in {self._dir}") from e
            raise TransferError(f"cannot write embeddings to {path}: {e}") from e
        return path

    def _lease(self, entry: _Entry) -> Handle:
        lease = signing.new_lease()
        try:
            os.close(os.open(lease_path(entry.path, lease), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as e:
            raise TransferError(f"cannot create a lease file beside {entry.path}: {e}") from e
        entry.leases[lease] = time.monotonic() + self._cfg.ttl_s
        handle = wire.to_handle(entry.header, self.name, path=str(entry.path))
        return signing.issue(handle, self._key, self._cfg.ttl_s, lease)

    def _sweep(self) -> None:
        """Forget released leases, expire old ones, and delete payloads no lease holds."""
        now = time.monotonic()
        for cache_key, entry in list(self._entries.items()):
            for lease, deadline in list(entry.leases.items()):
                held = lease_path(entry.path, lease)
                if deadline < now:
                    held.unlink(missing_ok=True)
                    del entry.leases[lease]
                elif not held.exists():  # its consumer released it
                    del entry.leases[lease]
            if not entry.leases:
                entry.path.unlink(missing_ok=True)
                del self._entries[cache_key]

    def release(self, handle: Handle) -> bool:
        handle = signing.verify(handle, self._key)
        if handle.get("connector") != self.name:
            return False
        path = wire.location_of(handle, FsLocation).path
        lease = handle["lease"]
        with self._lock:
            entry = next((e for e in self._entries.values() if str(e.path) == path), None)
            if entry is None or lease not in entry.leases:
                return False
            held = lease_path(entry.path, lease)
            was_live = held.exists()
            held.unlink(missing_ok=True)
            self._sweep()
            return was_live

    def _counted(self) -> list[_Entry]:
        self._sweep()
        return list(self._entries.values())

    @property
    def live_handles(self) -> int:
        with self._lock:
            return sum(len(entry.leases) for entry in self._counted())

    @property
    def live_entries(self) -> int:
        with self._lock:
            return len(self._counted())

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(entry.header.nbytes for entry in self._counted())

    @property
    def capacity_bytes(self) -> int:
        """What the filesystem has free, plus what this producer already holds."""
        return shutil.disk_usage(self._dir).free + self.held_bytes

    def close(self) -> None:
        """Files still leased stay for their consumers; the next start of a producer on this host
        removes them once this process is gone."""
        with self._lock:
            self._sweep()

    def __enter__(self) -> FsProducer:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


class FsConsumer:
    """Reads fs handles whose files live directly in ``cfg.fs_dir``."""

    def __init__(self, cfg: ECConfig) -> None:
        self._key = cfg.handle_key if cfg.has_secret else None
        self._given = cfg.fs_dir
        self._dir = os.path.realpath(cfg.fs_dir) if cfg.fs_dir else ""
        self._dtypes = cfg.dtypes

    def _paths(self, handle: Handle) -> tuple[str, Path]:
        """The payload file and this handle's lease file, once both are known to be ours to touch."""
        path = wire.location_of(handle, FsLocation).path
        lease = handle["lease"]
        if not LEASE_RE.fullmatch(lease):
            raise InvalidHandle("the EC handle has a malformed lease")
        if not self._dir:
            raise TransferError("fs EC handles are refused: this instance has no fs_dir configured")
        check_private_dir(self._given)
        real = os.path.realpath(path)
        if os.path.dirname(real) != self._dir or not FILE_RE.fullmatch(os.path.basename(real)):
            raise TransferError(f"fs handle path {path!r} is not an EC file under {self._dir}")
        return real, lease_path(real, lease)

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        handle = signing.verify_with(handle, self._key)
        header = wire.from_handle(handle)
        wire.validate(header, rows, width, model_id, self._dtypes, levels)
        path, held = self._paths(handle)
        if not held.exists():
            raise InvalidHandle(_GONE)
        if header.nbytes >= wire.THREAD_BYTES:
            return await asyncio.to_thread(self._read, header, path)
        return self._read(header, path)

    @staticmethod
    def _read(header: wire.WireHeader, path: str) -> torch.Tensor:
        """Read and check the payload; never deletes anything, whatever goes wrong."""
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                stored = (f.metadata() or {}).get(METADATA_KEY, "")
                wire.check_same(header, wire.decode(stored.encode()), path)
                tensor: torch.Tensor = f.get_tensor(TENSOR_NAME)
        except FileNotFoundError:
            raise InvalidHandle(_GONE) from None
        except (OSError, safetensors.SafetensorError) as e:
            raise TransferError(f"cannot read embeddings from {path}: {e}") from e
        if list(tensor.shape) != list(header.shape) or tensor.dtype != torch_dtype(header.dtype):
            raise TransferError(
                f"{path} holds a {tensor.dtype} tensor of shape {list(tensor.shape)}, not what its header says"
            )
        out = wire.new_buffer(header.nbytes)
        digest = wire.copy_and_checksum(out, tensor.contiguous().view(torch.uint8).reshape(-1).numpy())
        wire.check_checksum(header, digest)
        return wire.as_tensor(header, out)

    async def release(self, handle: Handle) -> None:
        """Delete this handle's lease file only; the producer deletes the payload when no lease is left."""
        handle = signing.verify_with(handle, self._key)
        _, held = self._paths(handle)
        try:
            held.unlink(missing_ok=True)
        except OSError as e:
            raise TransferError(f"cannot release the EC lease: {e.strerror or e}") from e

    async def close(self) -> None:
        return None
