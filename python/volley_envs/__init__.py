"""Serve Gymnasium environments to Volley actors over NATS (docs/ENV_PROTOCOL.md).

Start reading at :class:`volley_envs.server.EnvServer`; :mod:`volley_envs.protocol` holds the
message layout and :mod:`volley_envs.client` a small client (discovery and sessions).
"""

__version__ = "0.1.0"

from .protocol import PROTOCOL_VERSION, ProtocolError  # noqa: E402
from .server import EnvServer, make_factory  # noqa: E402

__all__ = ["EnvServer", "PROTOCOL_VERSION", "ProtocolError", "make_factory", "__version__"]
