"""A core board: the small shared-memory table through which a host's roles lend idle cores.

Each role that computes on cores of its own has a slot: its pid, how many cores are its own,
whether it is computing now (and whether urgently: running decodes wait on it) and when it last
stopped. ``up`` makes the board (readable and writable by its user only) and removes it;
``kernels.lending`` reads and writes it. Nothing here needs torch, so ``up`` can make a board
without loading it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from epdserve.common.pids import pid_alive

SLOTS = 64  # roles one board holds
_SLOT = struct.Struct("<iiid")  # pid (0: free), own cores, computing (0, 1, URGENT), when it last stopped computing
URGENT = 2  # computing, and running decodes wait on it
_COMPUTING = 8  # the offset of a slot's computing flag (an int32)
SIZE = SLOTS * _SLOT.size
MAX_OWN = 4096  # a slot claiming more cores than this is not read
PREFIX = "epd-cores-"  # a board's name: PREFIX, its maker's pid, "-", a random part


def make_board(directory: str | Path = "/dev/shm") -> Path:
    """A new empty board, readable and writable by this user only; the caller removes it. Boards
    of this user that an ``up`` killed outright left behind (its pid, in the name, gone) are
    removed first."""
    base = Path(directory) if Path(directory).is_dir() else Path("/tmp")
    remove_stale_boards(base)
    path = base / f"{PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, SIZE)
    finally:
        os.close(fd)
    return path


def remove_stale_boards(directory: Path) -> list[Path]:
    """Remove the boards in ``directory`` that this user made and whose maker is no longer alive;
    the paths removed. Another user's file, or one not named as a board, is never touched."""
    removed = []
    for path in directory.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            st = path.lstat()
            if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
                path.unlink()
                removed.append(path)
    return removed


@dataclass(frozen=True)
class Seat:
    """One role's slot as read."""

    own: int  # cores that are its own
    computing: bool
    last: float  # time.monotonic() when it last stopped computing (while computing: when it started)
    flag: int = 0  # the address of its computing flag (an int32) in this process's map of the board
    urgent: bool = False  # computing, and running decodes wait on it


class Board:
    """An open board: ``claim`` a slot, ``mark`` it, read the ``others``."""

    def __init__(self, path: str | Path) -> None:
        """Opens the board at ``path``; ValueError unless this user made it (``make_board``)."""
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != SIZE:
            raise ValueError(f"{path}: not a core board of this user (its owner, mode or size differ)")
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, SIZE)
        self._base = ctypes.addressof((ctypes.c_char * SIZE).from_buffer(self._map))
        self.slot = -1

    def claim(self, own: int) -> int:
        """Take a free slot (or one whose process has died) for ``own`` cores."""
        if not 0 < own <= MAX_OWN:
            raise ValueError(f"a role lends between 1 and {MAX_OWN} cores, got {own}")
        with self._locked():
            for i in range(SLOTS):
                pid = _SLOT.unpack_from(self._map, i * _SLOT.size)[0]
                if pid <= 0 or not pid_alive(pid):
                    self.slot = i
                    _SLOT.pack_into(self._map, i * _SLOT.size, os.getpid(), own, 0, 0.0)
                    return i
        raise ValueError(f"the core board is full ({SLOTS} roles)")

    def mark(self, own: int, computing: bool, last: float, urgent: bool = False) -> None:
        """This role's slot: ``own`` cores, computing or not (``urgent``: running decodes wait on
        it), ``last``: when it stopped computing, or started."""
        state = URGENT if computing and urgent else int(computing)
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, os.getpid(), own, state, last)

    def others(self) -> Iterator[Seat]:
        """The other roles' slots (a slot with values out of range is skipped); a role killed
        before it gave its slot back is idle until a restarted one takes the slot."""
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, own, computing, last = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid > 0 and 0 < own <= MAX_OWN:
                flag = self._base + i * _SLOT.size + _COMPUTING
                if pid_alive(pid):
                    yield Seat(own, bool(computing), last, flag, computing == URGENT)
                else:
                    yield Seat(own, False, 0.0, flag)

    def close(self) -> None:
        """Give the slot back."""
        if self._map.closed:
            return
        if self.slot >= 0:
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0, 0.0)
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
