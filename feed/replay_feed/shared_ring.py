"""Same-host shared memory: a ring of fixed-size slots in ``/dev/shm``.

A learner on the server's host does not need gRPC to move its batches: the
server writes each batch into a slot of a POSIX shared-memory object, and the
gRPC stream carries only where it lies. The server creates the ring (it knows
a batch's layout), the client maps it by name and proves it mapped the right
object by reading the random ``token`` the server wrote into the header.

Lifetime: once a side holds a mapping it may unlink the name (the client
does so right after mapping, the server when the client answers), and from
then on the pages live exactly as long as the mappings: nothing is left in
``/dev/shm`` whichever process exits first, even under ``kill -9``. Before
that, the name is the only reference: if the server dies (``kill -9``)
between creating a ring and the client mapping it, the object stays in
``/dev/shm`` until the next server on the host starts, which removes every
``replay-<pid>-*`` object whose creating process is gone
(:func:`sweep_stale_rings`). A stream the client abandons before mapping is
unlinked by the server when the stream ends.

Layout: a ``header_bytes`` header (the token, then zeros), then ``slots``
slots of ``slot_bytes`` each, all page-aligned (so a slot can be registered
as pinned memory for device copies). Tensors inside a slot start at 64-byte
aligned offsets.

The object's pages are reserved when it is created (``posix_fallocate``), so
a full ``/dev/shm`` (Docker's default is 64 MB) is an error at creation, not a
SIGBUS in the middle of a write.

Not thread-safe: one owner per ring (the stream that created or mapped it).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import socket
from pathlib import Path

import torch

PAGE = mmap.PAGESIZE
ALIGN = 64
TOKEN_BYTES = 16
_NAME = re.compile(r"^replay-[0-9]+-[0-9a-f]{16}$")
_SWEPT = re.compile(r"^replay-[0-9]+-[0-9a-f]{16}(\.sock)?$")  # a ring, or a server's socket



def _free_bytes(fd: int) -> int:
    """Bytes an unprivileged writer can still allocate on ``fd``'s file system."""
    stats = os.fstatvfs(fd)
    return stats.f_bavail * stats.f_frsize

class SharedMemoryError(OSError):
    """A shared-memory ring could not be created or mapped (the message says why)."""


def shm_dir() -> Path:
    """Where POSIX shared-memory objects live (``REPLAY_SHM_DIR`` overrides ``/dev/shm``)."""
    return Path(os.environ.get("REPLAY_SHM_DIR", "/dev/shm"))


def host_id() -> str:
    """An identifier of this host's running kernel: equal on both sides only on one host.

    The Linux boot id (containers of one host share it); elsewhere the hostname.
    """
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def align(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


class SharedRing:
    """A mapped ring of ``slots`` slots of ``slot_bytes`` (see the module docstring).

    Use :meth:`create` (server side) or :meth:`open` (client side).
    """

    def __init__(self, name: str, token: bytes, slots: int, slot_bytes: int,
                 header_bytes: int, buffer: mmap.mmap) -> None:
        self.name = name
        self.token = token
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.header_bytes = header_bytes
        self._buffer: mmap.mmap | None = buffer
        self._base = torch.frombuffer(buffer, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.header_bytes + self.slots * self.slot_bytes

    @property
    def path(self) -> Path:
        return shm_dir() / self.name

    @staticmethod
    def size_for(slots: int, slot_bytes: int) -> int:
        """Bytes a ring of ``slots`` slots of ``slot_bytes`` takes in /dev/shm (header included)."""
        return PAGE + slots * align(slot_bytes, PAGE)

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> SharedRing:
        """Create, reserve and map a new ring (server side).

        Raises:
            SharedMemoryError: the directory is missing or not writable, or it
                has too little space (the message gives the size asked for).
        """
        if slots < 1 or slot_bytes < 1:
            raise SharedMemoryError(f"a ring needs slots >= 1 and slot_bytes >= 1, got "
                                    f"{slots} and {slot_bytes}")
        size = cls.size_for(slots, slot_bytes)
        slot_bytes = align(slot_bytes, PAGE)
        name = f"replay-{os.getpid()}-{secrets.token_hex(8)}"
        path = shm_dir() / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise SharedMemoryError(f"cannot create {path}: {exc.strerror}") from None
        try:
            try:
                # Asked before reserving: a disk file system (REPLAY_SHM_DIR on ext4, say)
                # allocates a reservation that does not fit until it is full, and every
                # other writer on that disk sees ENOSPC until this one gives up.
                if size > _free_bytes(fd):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise SharedMemoryError(
                    f"cannot reserve {size >> 20} MiB in {shm_dir()} ({exc.strerror}); in "
                    f"Docker raise --shm-size (default 64 MB) or use ipc: host"
                ) from None
            buffer = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        token = secrets.token_bytes(TOKEN_BYTES)
        buffer[:TOKEN_BYTES] = token
        return cls(name, token, slots, slot_bytes, PAGE, buffer)

    @classmethod
    def open(cls, name: str, token: bytes, slots: int, slot_bytes: int,
             header_bytes: int) -> SharedRing:
        """Map a ring another process created (client side), checking it is that ring.

        Raises:
            SharedMemoryError: the name is malformed, no such object exists
                here (another host, another container's /dev/shm), it has
                another size, or its token differs.
        """
        if not _NAME.match(name):
            raise SharedMemoryError(f"{name!r} is not a replay shared-memory ring name")
        size = header_bytes + slots * slot_bytes
        path = shm_dir() / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise SharedMemoryError(f"cannot open {path}: {exc.strerror}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size or slots < 1 or header_bytes < TOKEN_BYTES:
                raise SharedMemoryError(f"{path} has {actual} bytes, the offer says {size}")
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if buffer[:TOKEN_BYTES] != token:
            buffer.close()
            raise SharedMemoryError(f"{path} is not the ring the server offered (token differs)")
        return cls(name, token, slots, slot_bytes, header_bytes, buffer)

    def whole(self) -> torch.Tensor:
        """The whole mapping as a uint8 tensor (e.g. to register it as pinned memory)."""
        return self._base

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index % slots`` as a uint8 tensor view of ``slot_bytes``."""
        start = self.header_bytes + (index % self.slots) * self.slot_bytes
        return self._base[start : start + self.slot_bytes]

    def view(self, index: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``dtype``/``shape`` at byte ``offset`` of slot ``index % slots``.

        Raises:
            SharedMemoryError: the tensor would not fit the slot or is misaligned.
        """
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset % ALIGN or offset + nbytes > self.slot_bytes:
            raise SharedMemoryError(f"{nbytes} bytes at offset {offset} do not fit a slot of "
                                    f"{self.slot_bytes} bytes at {ALIGN}-byte alignment")
        raw = self.slot(index)[offset : offset + nbytes]
        return raw.view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the name from the directory (mappings stay valid). Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this side's reference to the mapping.

        The pages stay mapped while any tensor view of them is alive (each
        view holds a reference to the mapping; ``torch.frombuffer`` does not
        keep the buffer export, so closing the mmap explicitly would leave
        views dangling); the last one unmaps them.
        """
        self._buffer = None
        self._base = torch.empty(0, dtype=torch.uint8)

    def __repr__(self) -> str:
        return (f"SharedRing({self.name!r}, slots={self.slots}, "
                f"slot_bytes={self.slot_bytes})")


def sweep_stale_rings() -> list[str]:
    """Remove rings in :func:`shm_dir` whose creating process no longer exists (and a dead
    server's socket for same-host updates, ``replay-<pid>-<hex>.sock``).

    A ring's name holds its creator's pid (``replay-<pid>-<hex>``); a ring
    whose creator is gone and that no one unlinked was left by a server
    killed between creating it and the learner mapping it. Processes of this
    host's pid namespace only: a ring whose pid is alive (or not ours to
    signal) is kept. Returns the names removed.
    """
    removed: list[str] = []
    try:
        entries = list(shm_dir().iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not _SWEPT.match(entry.name):
            continue
        pid = int(entry.name.split("-")[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or reused): keep it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # someone else's live process
        try:
            entry.unlink()
            removed.append(entry.name)
        except OSError:
            pass
    return removed
