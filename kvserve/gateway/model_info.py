"""LiteLLM's GET /model/info (and /v1/model/info): the deployments a key may call, in LiteLLM's
shape (model_name, litellm_params, model_info). LiteLLM's UI, its SDK's proxy helpers and users'
scripts read context sizes and prices there; the gateway answered a route 404.

Each deployment is one row, as LiteLLM lists them; only the aliases the key may use (its and its
team's `models`). Backend URLs and API keys are not shown: they are the operator's."""

from __future__ import annotations

from fastapi import FastAPI, Request

from kvserve.gateway.config import Deployment
from kvserve.gateway.errors import GatewayError


def _row(d: Deployment) -> dict:
    b = d.backend
    return {
        "model_name": d.model_name,
        "litellm_params": {"model": b.model},
        "model_info": {
            "id": d.id,
            "max_input_tokens": b.max_context,
            "max_tokens": b.max_context,
            "input_cost_per_token": b.input_cost_per_token,
            "output_cost_per_token": b.output_cost_per_token,
            "input_cost_per_token_batches": b.input_cost_per_token_batches,
            "output_cost_per_token_batches": b.output_cost_per_token_batches,
            "rpm": b.rpm,
            "tpm": b.tpm,
            "db_model": False,
        },
    }


def add_model_info_routes(app: FastAPI, state) -> None:
    """state: the app's GatewayState. `?litellm_model_id=` narrows to one deployment (LiteLLM's)."""

    async def model_info(request: Request, litellm_model_id: str | None = None) -> dict:
        allowed = set(state.gateway.allowed_models(await state.authenticate(request)))
        rows = [_row(d) for d in state.cfg.model_list if d.model_name in allowed]
        if litellm_model_id is not None:
            rows = [r for r in rows if r["model_info"]["id"] == litellm_model_id]
            if not rows:
                raise GatewayError(404, f"litellm_model_id: no deployment {litellm_model_id!r}",
                                   code="model_not_found", param="litellm_model_id")  # fmt: skip
        return {"data": rows}

    for path in ("/model/info", "/v1/model/info"):
        app.add_api_route(path, model_info, methods=["GET"], include_in_schema=False)
