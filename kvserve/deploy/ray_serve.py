"""`kvserve.deploy.ray_serve`: kvserve replicas as a Ray Serve application.

    HTTP -> Serve proxy -> Front (FastAPI ingress, front.py; no engine)
         -> DeploymentHandle -> KVServeRequestRouter (ray_router.py: kvserve's routing policy)
         -> KVServeReplica x N (replica.py: one `kvserve serve` each), autoscaled by Serve

Autoscaling is Serve's (target ongoing requests per replica, min/max, upscale/downscale
delays, from the config's `autoscaling`); scale-down drains (replica.py). Ray is imported
only when an application is built, so kvserve imports without it.
"""

from __future__ import annotations

import logging
import time

from kvserve.deploy.ray_config import RayDeployConfig

logger = logging.getLogger("kvserve.deploy")

REPLICAS = "KVServeReplica"
FRONT = "KVServeFront"
FRONT_MAX_ONGOING = 10_000  # the front only relays; the replicas' own cap is what bounds work


def autoscaling_config(cfg: RayDeployConfig) -> dict:
    """Serve's autoscaling_config from ours (same key names; unset initial_replicas left out)."""
    return cfg.autoscaling.model_dump(exclude_none=True)


def build_app(cfg: RayDeployConfig):
    """The Serve Application (not yet running): Front bound to the autoscaled replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvserve.deploy.front import Front
    from kvserve.deploy.replica import KVServeReplica

    r = cfg.replica
    replicas = serve.deployment(
        KVServeReplica,
        name=REPLICAS,
        autoscaling_config=autoscaling_config(cfg),
        max_ongoing_requests=r.max_ongoing_requests,
        graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=r.graceful_shutdown_wait_loop_s,
        health_check_period_s=10,
        health_check_timeout_s=30,
        ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class="kvserve.deploy.ray_router.KVServeRequestRouter",
            request_router_kwargs={"policy": cfg.routing.policy, **cfg.routing.cache_aware},
        ),
    )
    front = serve.deployment(
        Front,
        name=FRONT,
        num_replicas=1,
        max_ongoing_requests=FRONT_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    return front.bind(replicas.bind(cfg.model_dump()), cfg.max_request_bytes)  # (the replicas' too)


def connect(address: str | None) -> None:
    """`auto` / None: the cluster RAY_ADDRESS or `ray start` points at, else a new local one;
    `local`: always a new local one; anything else: that address."""
    import ray

    if address in (None, "auto"):
        ray.init(ignore_reinit_error=True, logging_level=logging.WARNING)
    else:
        ray.init(address=address, ignore_reinit_error=True, logging_level=logging.WARNING)


def deploy(cfg: RayDeployConfig, address: str | None = None) -> str:
    """Start Serve (HTTP on cfg.http) on the cluster and run the application; returns its URL
    once Serve reports it RUNNING (each replica ready = model loaded and warmed up)."""
    from ray import serve

    connect(address or cfg.address)
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
    url = f"http://{cfg.http.host}:{cfg.http.port}{cfg.route_prefix.rstrip('/')}"
    logger.info("kvserve on Ray Serve: %s (app %s)", url, cfg.app_name)
    return url


def replica_states(app_name: str) -> dict[str, int]:
    """Replica counts by state (RUNNING, STARTING, STOPPING, ...) of the kvserve replicas."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or REPLICAS not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): v for k, v in app.deployments[REPLICAS].replica_states.items()}


def wait_forever(app_name: str, period_s: float = 30.0) -> None:
    """Log the replica counts now and then until interrupted (`kvserve deploy ray` without
    --detach), as `serve run` stays in the foreground."""
    last = None
    while True:
        states = replica_states(app_name)
        if states != last:
            logger.info("replicas: %s", states)
            last = states
        time.sleep(period_s)


def wait_running(app_name: str, timeout_s: float) -> None:
    """Until Serve reports the application RUNNING; RuntimeError with Serve's message when its
    deployment fails (a replica constructor raised: the server's last log lines), TimeoutError
    when it is still deploying at the deadline."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        status = str(getattr(app.status, "value", app.status)) if app is not None else "NOT_STARTED"
        if status == "RUNNING":
            return
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {app_name} {status}: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app_name} still {status} after {timeout_s:g} s")
        time.sleep(1.0)
