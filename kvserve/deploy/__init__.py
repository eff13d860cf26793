"""Deploying kvserve on a cluster manager: `kvserve deploy ray` (ray_serve.py). Nothing here
imports Ray at module level, so the package imports without it; Ray is the `ray` extra."""
