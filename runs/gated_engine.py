"""The scheduler's Engine for real runs: the proxy's gate and vLLM paused together around a weight update."""
from __future__ import annotations

import asyncio

from proxy.server import ProxyServer
from trainer.engine.sync import CONTROL_TIMEOUT_S


class WeightSyncStalled(RuntimeError):
    """The calls in flight did not finish within the drain timeout of a weight update."""


def gate_wait_s(drain_timeout_s: float | None) -> float | None:
    """How long a weight update may keep the gate closed: its drain, then the reload of the weights (None: no bound)."""
    return None if drain_timeout_s is None else drain_timeout_s + CONTROL_TIMEOUT_S


class GatedEngine:
    """The scheduler's Engine: a weight update first closes the proxy's gate and drains it, then pauses vLLM.

    The proxy stamps a call with the version served when the gate admits it. With the gate closed during the
    swap, every call admitted before it finishes on the old weights and every call after it starts on the new
    ones, so each recorded call's version is that of the weights that produced it.
    """

    def __init__(self, engine, server: ProxyServer, drain_timeout_s: float | None = None):
        """`drain_timeout_s`: how long a weight update waits for the calls in flight (None: as long as they take).

        The proxy's gate holds a new call for as long as an update may keep it closed (`gate_wait_s`), so a
        call is refused only when the update is stuck, whatever the length of its trajectory."""
        self.engine, self.server, self.drain_timeout_s = engine, server, drain_timeout_s
        server.app.gate.wait_s = gate_wait_s(drain_timeout_s)

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def busy_seconds(self) -> float:
        """Wall time with at least one model call in flight through the proxy: the run's generation time."""
        return self.server.app.busy_seconds

    async def pause(self) -> None:
        """Close the gate and wait for the calls in flight, then pause vLLM; WeightSyncStalled if they outlast
        `drain_timeout_s` (the gate is opened again: the run is failing, its harnesses must not wait on it)."""
        try:
            await asyncio.to_thread(self.server.pause, self.drain_timeout_s)
        except TimeoutError as exc:
            await asyncio.to_thread(self.server.resume)
            raise WeightSyncStalled(
                f"the weight update could not start: {exc} (LIGHTNING_WEIGHT_SYNC_DRAIN_S={self.drain_timeout_s:g}); "
                "the engine or a harness connection is stuck") from None
        await self.engine.pause()

    async def update_weights(self, model, version: int) -> None:
        await self.engine.update_weights(model, version)

    async def resume(self) -> None:
        try:
            await self.engine.resume()
        finally:
            await asyncio.to_thread(self.server.resume)
