"""The codec's compiled and pure twins implement one interface, ``codec.BodyCodec`` (mypy checks).

The reference codec (fastavro: ``codec._FastavroBodyCodec`` over :mod:`._reference`) and the
compiled ``_fastcodec`` module (typed by ``_fastcodec.pyi``, which ``make lint`` checks against
the built module with mypy's stubtest) write and read the same bytes; ``codec`` picks one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import _fastcodec
    from .codec import BodyCodec, _FastavroBodyCodec

    def _both_are_body_codecs(schema: Any) -> list[BodyCodec]:
        return [_FastavroBodyCodec(schema), _fastcodec]
