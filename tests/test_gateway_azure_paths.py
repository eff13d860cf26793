"""Azure OpenAI's paths at the gateway, as LiteLLM's proxy serves them: the AzureOpenAI SDK
(azure_endpoint at the gateway, the key in `api-key`) names the model as the deployment in the
path (/openai/deployments/{model}/chat/completions?api-version=...): each request was a 404."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from gateway_utils import FaultBackend

from kvserve.gateway.app import build_app
from kvserve.gateway.config import parse_config


@pytest.fixture(scope="module")
def fault():
    fb = FaultBackend()
    yield fb
    fb.stop()


def test_the_azure_sdk_reaches_the_alias_its_deployment_names(fault, tmp_path):
    backend = {"base_url": fault.url + "/v1", "model": "ok"}
    cfg = {"model_list": [{"model_name": m, "backend": backend} for m in ("small", "big")],
           "keys": [{"key": "sk-small", "models": ["small"]}],
           "general_settings": {"database": str(tmp_path / "gw.db")}}  # fmt: skip
    app = build_app(parse_config(cfg), web_ui=False)

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncAzureOpenAI(
            azure_endpoint="http://gw",
            api_key="sk-small",
            api_version="2024-06-01",
            http_client=http,
            max_retries=0,
        )
        async with http:
            chat = await client.chat.completions.with_raw_response.create(
                model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            text = await client.completions.create(model="small", prompt="a b", max_tokens=1)
            with pytest.raises(openai.PermissionDeniedError):  # the key's models hold on this path too
                await client.chat.completions.create(
                    model="big", messages=[{"role": "user", "content": "hi"}]
                )
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="none", messages=[{"role": "user", "content": "hi"}]
                )
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            legacy = await http.post(
                "http://gw/engines/small/chat/completions", headers={"api-key": "sk-small"}, json=body
            )
        return chat, text, legacy

    chat, text, legacy = asyncio.run(run())
    assert chat.http_response.headers["x-kvserve-model-group"] == "small"
    assert chat.parse().choices[0].message.content == " tok tok"
    assert text.choices[0].text == " tok"
    assert legacy.status_code == 200 and legacy.headers["x-kvserve-model-group"] == "small", legacy.text
