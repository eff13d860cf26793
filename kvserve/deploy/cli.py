"""`kvserve deploy ray --config FILE`: run kvserve replicas as a Ray Serve application
(kvserve/deploy/ray_serve.py; docs/DEPLOYMENT.md)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.deploy.ray_config import RayDeployConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("deploy", help="run kvserve on a cluster manager (Ray Serve)")
    targets = p.add_subparsers(dest="target", required=True)
    ray = targets.add_parser("ray", help="kvserve replicas as an autoscaled Ray Serve application")
    ray.add_argument("--config", required=True, help="deployment YAML (deploy/ray/deploy.yaml)")
    ray.add_argument("--address", default=None,
                     help="Ray cluster: auto (default: RAY_ADDRESS or a `ray start` cluster, else a "
                          "new local one), local, or HOST:PORT / ray://HOST:PORT")  # fmt: skip
    ray.add_argument("--detach", action="store_true",
                     help="return once the application is RUNNING (it stays on the cluster)")  # fmt: skip
    # the replicas' own parser (registered before this one): their flags are checked here
    ray.set_defaults(func=run_ray, serve_parser=subparsers.choices.get("serve"))


def check_server_flags(cfg: RayDeployConfig, serve_parser: argparse.ArgumentParser | None) -> str | None:
    """What `kvserve serve` would say of a replica's flags, or None when it would start: a
    misspelled or bad flag in server_args passed the config's validation and then stopped
    every replica at start, after the cluster had come up."""
    if serve_parser is None:
        return None
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            _, unknown = serve_parser.parse_known_args(cfg.server_argv(8000)[1:])
    except SystemExit:
        lines = said.getvalue().strip().splitlines() or ["not valid"]
        return "server_args: " + lines[-1].split(" error: ", 1)[-1]
    return f"server_args: unrecognized arguments: {' '.join(unknown)}" if unknown else None


def run_ray(args: argparse.Namespace) -> int:
    """0 when deployed (--detach) or stopped by Ctrl-C; 1 when Serve failed to deploy; 2 on a
    bad config or a missing Ray."""
    from kvserve.deploy.ray_config import DeployConfigError, load_config

    try:
        cfg = load_config(args.config)
    except DeployConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = check_server_flags(cfg, getattr(args, "serve_parser", None))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        print(f"error: Ray Serve is not installed ({e}): pip install 'kvserve[ray]'", file=sys.stderr)
        return 2
    from kvserve.deploy import ray_serve

    try:
        url = ray_serve.deploy(cfg, args.address)
        ray_serve.wait_running(cfg.app_name, cfg.replica.startup_timeout_s + 60)
    except (RuntimeError, TimeoutError, ConnectionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"kvserve on Ray Serve: {url}/v1 (app {cfg.app_name})", flush=True)
    if args.detach:
        return 0
    from ray import serve

    try:
        ray_serve.wait_forever(cfg.app_name)
    except KeyboardInterrupt:
        serve.delete(cfg.app_name)
    return 0
