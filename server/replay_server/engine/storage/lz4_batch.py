"""Many lz4 blocks decoded by one call outside the GIL: the batch decoder of compressed columns.

A compressed column keeps each row as one lz4 block
(:mod:`~replay_server.engine.storage.compressed`), and a batch reads
hundreds to thousands of them (an Ape-X batch 2,048 frames, an R2D2 one
20,480). python-lz4 decodes one block per call: on 7 KB Atari frames the
call, the ``bytes`` it returns and the copy into the batch cost several
times the decoding itself. Yet the lz4 *frame* format is just blocks in a
row, each behind its 4-byte size: a column that stores each block behind its
size (:data:`PREFIX`) can hand a batch's blocks, joined behind one frame
header, to one ``LZ4F_decompress`` call, which decodes them into the batch's
memory one after the other, in C, with the GIL released (``ctypes``), so a
batch split in parts decodes on several cores.

The library is the lz4 the ``lz4`` package was built with (its extension
exports the frame API), else the system's ``liblz4``; where neither offers
it, :data:`DECODER` is ``None`` and columns decode block by block through
python-lz4 (the same bytes, slower).

Safety: ``LZ4F_decompress`` is lz4's bounds-checked decoder: it never writes
past the destination it is given, and a batch that does not decode to
exactly the bytes expected raises.

Thread-safety: :meth:`BatchDecoder.decode` may be called from any thread
(each call takes a decompression context of its own from a pool).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Sequence

import lz4.block
import lz4.frame
import numpy as np

PREFIX = 4
"""Bytes before each stored block: its size, little-endian (the frame format's block header)."""

_END = b"\0\0\0\0"
"""The frame's end mark (a block of size 0)."""

_UNCOMPRESSED = 1 << 31
"""Set in a block's size: the block is stored as is (a never-written row: zeros)."""

_BLOCK_SIZES = ((64 << 10, lz4.frame.BLOCKSIZE_MAX64KB), (256 << 10, lz4.frame.BLOCKSIZE_MAX256KB),
                (1 << 20, lz4.frame.BLOCKSIZE_MAX1MB), (4 << 20, lz4.frame.BLOCKSIZE_MAX4MB))
"""The frame format's block size limits, smallest first."""

_VERSION = 100  # LZ4F_VERSION


def prefixed(block: bytes) -> bytes:
    """``block`` behind its size, as a column stores it for :meth:`BatchDecoder.decode`."""
    return len(block).to_bytes(PREFIX, "little") + block


def zero_block(row_bytes: int) -> bytes:
    """A stored (uncompressed) block of ``row_bytes`` zeros, behind its size."""
    return (row_bytes | _UNCOMPRESSED).to_bytes(PREFIX, "little") + bytes(row_bytes)


def stand_in(row_bytes: int) -> bytes:
    """A stored (compressed) block of ``row_bytes`` zeros, behind its size: a few bytes that
    decode at memset speed, for a place in a batch that gets a copy of a row decoded
    elsewhere in it."""
    return prefixed(lz4.block.compress(bytes(row_bytes), store_size=False))


class Lz4Error(RuntimeError):
    """A batch did not decode to the bytes expected (a bug or corrupt storage: never input)."""


class BatchDecoder:
    """Decodes prefixed lz4 blocks, joined, into contiguous memory (see the module).

    Args:
        library: a loaded library exporting lz4's frame API (``LZ4F_*``).
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decompress = library.LZ4F_decompress
        self._decompress.restype = ctypes.c_size_t
        self._decompress.argtypes = (ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p,
                                     ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)
        self._create = library.LZ4F_createDecompressionContext
        self._create.restype = ctypes.c_size_t
        self._create.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
        self._reset = library.LZ4F_resetDecompressionContext
        self._reset.restype = None
        self._reset.argtypes = (ctypes.c_void_p,)
        self._is_error = library.LZ4F_isError
        self._is_error.restype = ctypes.c_uint
        self._is_error.argtypes = (ctypes.c_size_t,)
        self._contexts: list[ctypes.c_void_p] = []  # idle ones, reused (never freed)
        self._lock = threading.Lock()
        self._headers: dict[int, bytes] = {}

    @staticmethod
    def fits(row_bytes: int, largest: int) -> bool:
        """Whether rows of ``row_bytes``, stored in blocks of at most ``largest`` bytes, fit
        the frame format's largest block (4 MiB)."""
        return max(row_bytes, largest) <= _BLOCK_SIZES[-1][0]

    def header(self, largest: int) -> bytes:
        """The frame header for blocks of at most ``largest`` bytes (either way)."""
        header = self._headers.get(largest)
        if header is None:
            size = next(flag for limit, flag in _BLOCK_SIZES if limit >= largest)
            header = self._headers[largest] = lz4.frame.LZ4FrameCompressor(
                block_size=size, block_linked=False, content_checksum=False,
                block_checksum=False).begin()
        return header

    def decode(self, header: bytes, blocks: Sequence[bytes | memoryview] | np.ndarray,
               out: np.ndarray, count: int | None = None) -> None:
        """Decode ``blocks`` (each :func:`prefixed`) one after the other into ``out``.

        Args:
            header: :meth:`header` for the blocks' largest size.
            blocks: the blocks, in ``out``'s order: a sequence of them, or one uint8
                array of ``count`` of them joined.
            out: contiguous memory exactly the size the blocks decode to.
            count: the blocks in a joined array (for the error message).

        Raises:
            Lz4Error: the blocks did not decode to exactly ``out``'s bytes.

        Cost: one join of the blocks (their compressed bytes) and one decode
        call, outside the GIL.
        """
        assert out.flags.c_contiguous
        if isinstance(blocks, np.ndarray):
            source = b"".join((header, blocks, _END))
        else:
            source, count = b"".join((header, *blocks, _END)), len(blocks)
        context = self._context()
        written = ctypes.c_size_t(out.nbytes)
        read = ctypes.c_size_t(len(source))
        status = self._decompress(context, out.ctypes.data, ctypes.byref(written), source,
                                  ctypes.byref(read), None)
        if self._is_error(status) or status != 0 or written.value != out.nbytes \
                or read.value != len(source):
            self._reset(context)
            with self._lock:
                self._contexts.append(context)
            raise Lz4Error(f"{count} lz4 blocks decoded to {written.value:,} of "
                           f"{out.nbytes:,} bytes (status {status})")
        with self._lock:
            self._contexts.append(context)

    def _context(self) -> ctypes.c_void_p:
        with self._lock:
            if self._contexts:
                return self._contexts.pop()
        context = ctypes.c_void_p()
        status = self._create(ctypes.byref(context), _VERSION)
        if self._is_error(status):
            raise MemoryError("lz4 could not make a decompression context")
        return context


def _library() -> ctypes.CDLL | None:
    """lz4 with its frame API: the ``lz4`` package's own, else the system's (or ``None``)."""
    candidates = [lz4.frame._frame.__file__, ctypes.util.find_library("lz4")]
    for path in candidates:
        if not path:
            continue
        try:
            library = ctypes.CDLL(path)
            for name in ("LZ4F_decompress", "LZ4F_createDecompressionContext",
                         "LZ4F_resetDecompressionContext", "LZ4F_isError"):
                getattr(library, name)
        except (OSError, AttributeError):
            continue
        return library
    return None


def load() -> BatchDecoder | None:
    """The process's decoder, or ``None`` where no lz4 library offers the frame API."""
    library = _library()
    return None if library is None else BatchDecoder(library)


DECODER = load()
"""The decoder compressed columns use (``None``: block by block through python-lz4)."""
