"""How saturated each model group is, read from its kvserve backends' `kvserve:saturation`
gauge (kvserve/metrics/saturation.py) by polling their /metrics.

Polling, not a push: the backends already expose it for the autoscaler, and a reading a
second old is fresh enough to steer traffic. A group's saturation is the mean over its
deployments that answered (a down deployment is the router's business, not load); None
while none has answered, so degradation never acts on no data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.gateway.backends import BackendPool
from kvserve.gateway.config import Deployment, GatewayConfig
from kvserve.gateway.metrics import GatewayMetrics

log = logging.getLogger("kvserve.gateway")
METRIC = "kvserve:saturation"


def parse_saturation(text: str) -> float | None:
    """The replica's saturation from a /metrics page: the `engine="total"` series when the
    server has data-parallel replicas, else its one series; None if the gauge is absent, not
    a finite number, or the page is not Prometheus text. (A page that failed to parse raised
    out of the whole poll: one backend answering /metrics with an HTML page froze every
    group's saturation at its last reading, and degradation went on acting on it.)"""
    values: list[float] = []
    try:
        for family in text_string_to_metric_families(text):
            if family.name != METRIC:
                continue
            for sample in family.samples:
                if sample.labels.get("engine") == "total":
                    return sample.value if math.isfinite(sample.value) else None
                values.append(sample.value)
    except ValueError:
        return None
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else None


class SaturationMonitor:
    def __init__(
        self, cfg: GatewayConfig, pool: BackendPool, aliases: list[str], metrics: GatewayMetrics
    ) -> None:
        self.pool, self.metrics = pool, metrics
        self.interval = cfg.router_settings.saturation_poll_interval
        self.groups = {a: [d for d in cfg.model_list if d.model_name == a] for a in aliases}
        self.readings: dict[str, float] = {}  # deployment id -> last saturation read
        self._task: asyncio.Task | None = None

    def group(self, alias: str) -> float | None:
        vals = [self.readings[d.id] for d in self.groups.get(alias, []) if d.id in self.readings]
        return sum(vals) / len(vals) if vals else None

    async def read(self, dep: Deployment) -> float | None:
        root = dep.backend.base_url.removesuffix("/v1")
        try:
            client = self.pool.aux_client(dep)  # (not a request shard's turn: backends.py)
            r = await client.get(root + "/metrics", headers=self.pool.headers(dep), timeout=2.0)
        except httpx.HTTPError:
            return None
        return parse_saturation(r.text) if r.status_code == 200 else None

    async def poll_once(self) -> None:
        deps = list({d.id: d for ds in self.groups.values() for d in ds}.values())
        for d, value in zip(deps, await asyncio.gather(*(self.read(d) for d in deps))):
            if value is None:
                self.readings.pop(d.id, None)
            else:
                self.readings[d.id] = value
        for alias in self.groups:
            sat = self.group(alias)
            if sat is not None:
                self.metrics.group_saturation.labels(alias).set(sat)

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as e:  # noqa: BLE001 - a bad page must not stop the polling
                log.warning("saturation poll failed: %s", e)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self.groups and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
