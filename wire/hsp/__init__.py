"""HSP (specs/hsp.txt), sans-IO: codec for the seven commands and the connection state machine.

The package offers the codec's public names (listed once, in
``wire.hsp.codec.__all__``) and :class:`HSPConnection`.
"""

from wire.hsp import codec
from wire.hsp.codec import *  # noqa: F403 - the codec's __all__, re-exported as is
from wire.hsp.connection import HSPConnection

__all__ = ["HSPConnection"]
__all__ += codec.__all__
