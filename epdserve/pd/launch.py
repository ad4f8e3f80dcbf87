"""Start a language-model instance's engine core process before anything heavy is imported.

The core spends its first seconds importing torch and loading the model; started first, it does
so while the front end imports its own modules, so the two startups overlap instead of adding up.
"""

from __future__ import annotations

from epdserve.engine.client import MPClient
from epdserve.engine.messages import CoreStart
from epdserve.pd.config import ServerConfig


def launch_core(config: ServerConfig) -> MPClient | None:
    """The core process of ``config``, already loading (None where the core runs in a thread)."""
    if config.engine_core != "process":
        return None
    start = CoreStart(
        str(config.model), config.model_name, config.engine, config.vision, config.ec, config.role, config.kv
    )
    client = MPClient(start, config.core_ready_timeout_s)
    client.launch()
    return client
