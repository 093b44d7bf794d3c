"""A seam for tests: the lz4 batch decoder, recording every stored block it is handed."""

from __future__ import annotations

from replay_server.engine.storage import lz4_batch
from replay_server.engine.storage.lz4_batch import DECODER


class CountingDecoder:
    """:data:`~replay_server.engine.storage.lz4_batch.DECODER`, recording the bytes of every
    block it decodes but the stand-ins that hold the places of rows a batch repeats (set
    it as ``compressed.DECODER`` before a column is made: columns take it then)."""

    def __init__(self, row_bytes: int) -> None:
        assert DECODER is not None
        self.blocks: list[bytes] = []
        self._stand_in = lz4_batch.stand_in(row_bytes)

    def fits(self, row_bytes: int, largest: int) -> bool:
        return DECODER.fits(row_bytes, largest)

    def header(self, largest: int) -> bytes:
        return DECODER.header(largest)

    def decode(self, header, blocks, out, count=None) -> None:
        self.blocks += [bytes(b) for b in blocks if bytes(b) != self._stand_in]
        DECODER.decode(header, blocks, out, count)
