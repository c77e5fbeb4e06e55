"""The scheduler's Engine for real runs: the proxy's gate and vLLM paused together around a weight update."""
from __future__ import annotations

import asyncio

from proxy.server import ProxyServer


class GatedEngine:
    """The scheduler's Engine: a weight update first closes the proxy's gate and drains it, then pauses vLLM.

    The proxy stamps a call with the version served when the gate admits it. With the gate closed during the
    swap, every call admitted before it finishes on the old weights and every call after it starts on the new
    ones, so each recorded call's version is that of the weights that produced it.
    """

    def __init__(self, engine, server: ProxyServer):
        self.engine, self.server = engine, server

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def busy_seconds(self) -> float:
        """Wall time with at least one model call in flight through the proxy: the run's generation time."""
        return self.server.app.busy_seconds

    async def pause(self) -> None:
        await asyncio.to_thread(self.server.pause)
        await self.engine.pause()

    async def update_weights(self, model, version: int) -> None:
        await self.engine.update_weights(model, version)

    async def resume(self) -> None:
        try:
            await self.engine.resume()
        finally:
            await asyncio.to_thread(self.server.resume)
