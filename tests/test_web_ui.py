"""The built-in web chat (`/`) and dashboard (`/dashboard`) in a real browser: Debian's chromium
driven by Playwright, against real `kvserve serve` and `kvserve gateway` processes.

Every page runs with the browser's network limited to the server's own origin: any other
request is blocked and recorded, and the test fails if there was one.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from gateway_utils import GatewayProcess, deployment
from playwright.sync_api import Page, sync_playwright
from server_utils import ServerProcess

from kvserve.engine.messages import EngineCoreOutputs
from kvserve.metrics.prometheus import ServerMetrics

CHROMIUM = "/usr/bin/chromium"  # Debian's package (the Makefile installs it); no browser download
KEY = "sk-web"
MODEL_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "4096", "--served-model-name", "tiny")
RECORD_ANSWER = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const body = [...document.querySelectorAll('.msg.assistant .body')].at(-1);
    const text = body ? body.textContent : '';
    if (text && text !== window.seen.at(-1)) window.seen.push(text);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def server(tiny_long_dir):
    s = ServerProcess(tiny_long_dir, *MODEL_ARGS, "--metrics-require-key", api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield b
        b.close()


class Offline:
    """A browser context whose network is the one origin: the rest is blocked and recorded."""

    def __init__(self, browser, origin: str, key: str | None, **context) -> None:
        self.origin = origin
        self.requested: list[str] = []
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.context = browser.new_context(**{"viewport": {"width": 1280, "height": 800}, **context})
        if key:  # as if entered in this tab before
            self.context.add_init_script(f"sessionStorage.setItem('kvserve.apiKey', {key!r})")
        self.context.route("**/*", self._route)

    def _route(self, route) -> None:
        url = route.request.url
        self.requested.append(url)
        if url == self.origin or url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def page(self) -> Page:
        page = self.context.new_page()
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        return page

    def close(self) -> None:
        self.context.close()
        assert not self.blocked, f"requests outside the origin: {self.blocked}"
        assert not self.errors, f"JavaScript errors: {self.errors}"


@pytest.fixture()
def offline(browser, server):
    ctx = Offline(browser, server.url, KEY)
    yield ctx
    ctx.close()


def running(server: ServerProcess) -> float:
    return server.metrics()["kvserve:num_requests_running"]


def wait_until(predicate, timeout: float = 20, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_pages_stay_on_their_origin(offline, server):
    """Both pages and every asset load with nothing but 127.0.0.1 reachable."""
    page = offline.page()
    for path, ready in (("/", "#model option"), ("/dashboard", "#v-tokps")):
        page.goto(server.url + path)
        page.wait_for_selector(ready, state="attached")
        page.wait_for_load_state("networkidle")
    assert any(u.endswith("/ui/chat.js") for u in offline.requested)
    assert any(u.endswith("/ui/dashboard.js") for u in offline.requested)
    assert any(u.endswith("/metrics") for u in offline.requested)
    csp = httpx.get(server.url + "/").headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "default-src 'self'" in csp


def test_api_key_prompt_then_chat(browser, server):
    ctx = Offline(browser, server.url, key=None)
    page = ctx.page()
    page.goto(server.url + "/")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")  # /v1/models answered 401
    page.get_by_label("Key (kept in this tab's session only)").fill(KEY)
    page.keyboard.press("Enter")
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    assert not dialog.is_visible()
    assert page.evaluate("sessionStorage.getItem('kvserve.apiKey')") == KEY
    page.get_by_label("Max tokens").fill("8")
    page.get_by_label("Message").fill("Hello")
    page.get_by_role("button", name="Send").click()
    stats = page.locator(".msg.assistant .stats")
    stats.filter(has_text="tokens").wait_for()
    assert "TTFT" in stats.inner_text()
    page.reload()  # the key lasts for the session: no second prompt
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    assert not dialog.is_visible()
    ctx.close()


def test_api_key_prompt_on_the_dashboard(browser, server):
    """With --metrics-require-key, /metrics answers 401 too: the dashboard asks for the key."""
    assert httpx.get(server.url + "/metrics").status_code == 401
    ctx = Offline(browser, server.url, key=None)
    page = ctx.page()
    page.goto(server.url + "/dashboard")
    page.locator("#key-dialog").wait_for(state="visible")
    page.get_by_label("Key (kept in this tab's session only)").fill(KEY)
    page.keyboard.press("Enter")
    page.locator("#v-requests", has_text="running").wait_for()
    ctx.close()


def test_chat_streams_and_stop_frees_the_engine(offline, server):
    page = offline.page()
    page.goto(server.url + "/")
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("3000")
    prompt = page.get_by_label("Message")
    prompt.click()
    page.keyboard.type("The quick brown fox")
    page.keyboard.press("Shift+Enter")  # a new line, not a send
    page.keyboard.type("jumps")
    assert prompt.input_value() == "The quick brown fox\njumps"
    assert page.locator(".msg").count() == 0
    page.evaluate(RECORD_ANSWER)
    page.keyboard.press("Enter")  # sends
    page.wait_for_function("() => window.seen.length >= 3")  # text arrived in several updates
    seen = page.evaluate("window.seen")
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), seen  # it grows, it is not replaced
    assert running(server) >= 1  # still answering
    page.get_by_role("button", name="Stop").click()
    wait_until(lambda: running(server) == 0, what="the engine's running count to drop to 0")
    stats = page.locator(".msg.assistant .stats")
    stats.filter(has_text="stopped").wait_for()
    assert page.get_by_role("button", name="Send").is_enabled()
    assert page.get_by_role("button", name="Stop").is_disabled()
    stopped_text = page.locator(".msg.assistant .body").inner_text()
    assert stopped_text
    page.reload()  # the conversation is kept in localStorage, with the partial answer
    page.locator(".msg.assistant .body").wait_for()
    assert page.locator(".msg.user .body").inner_text() == "The quick brown fox\njumps"
    assert page.locator(".msg.assistant .body").inner_text() == stopped_text
    assert page.locator("#conversations button.conv").first.inner_text().startswith("The quick brown fox")
    page.evaluate(RECORD_ANSWER)
    prompt.fill("again")
    prompt.press("Enter")
    page.wait_for_function("() => window.seen.length >= 2")
    page.reload()  # mid-answer: the question and the text so far are kept, marked interrupted
    wait_until(lambda: running(server) == 0, what="the reload to abort the answer")
    page.locator(".msg.assistant .error", has_text="Interrupted").wait_for()
    assert page.locator(".msg.user .body").nth(1).inner_text() == "again"
    assert page.locator(".msg.assistant").count() == 2


def test_json_schema_seed_regenerate_copy(offline, server):
    """JSON-schema mode constrains the answer; Regenerate replaces the answer by sending the same
    request again (seed included); Copy puts the answer on the clipboard."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}
    schema["additionalProperties"] = False
    offline.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page = offline.page()
    sent = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and sent.append(r.post_data_json))
    page.goto(server.url + "/")
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    page.get_by_label("Temperature").fill("1")
    page.get_by_label("Seed").fill("7")
    page.get_by_label("Max tokens").fill("64")
    page.get_by_label("JSON mode").check()
    schema_box = page.get_by_label("JSON schema (empty: any JSON object)")
    schema_box.fill('{"type": "object"')  # a typo: nothing is sent, the message stays to send again
    message = page.get_by_role("textbox", name="Message")
    message.fill("A colour, please")
    page.keyboard.press("Enter")
    page.locator("#status", has_text="JSON schema").wait_for()
    assert message.input_value() == "A colour, please"
    assert page.locator(".msg").count() == 0 and page.locator("#conversations li").count() == 0
    schema_box.fill(json.dumps(schema))
    message.press("Enter")
    stats = page.locator(".msg.assistant .stats", has_text="tokens")
    stats.wait_for()
    first = page.locator(".msg.assistant .body").inner_text()
    assert json.loads(first)["color"] in ("red", "green")
    page.get_by_role("button", name="Regenerate this answer").click()
    page.wait_for_function("() => document.querySelector('#send').disabled === false")
    stats.wait_for()
    assert page.locator(".msg.assistant").count() == 1  # replaced, not added
    assert page.locator(".msg.user").count() == 1
    again = page.locator(".msg.assistant .body").inner_text()
    assert json.loads(again)["color"] in ("red", "green")
    assert len(sent) == 2 and sent[0] == sent[1]
    assert sent[0]["seed"] == 7 and sent[0]["temperature"] == 1 and sent[0]["max_tokens"] == 64
    wanted = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    assert sent[0]["response_format"] == wanted
    page.get_by_role("button", name="Copy this answer").click()
    assert page.evaluate("() => navigator.clipboard.readText()") == again


FULL_STORAGE = """() => {
  const set = Storage.prototype.setItem;
  Storage.prototype.setItem = function (k, v) {
    if (k === 'kvserve.conversations') throw new DOMException('full', 'QuotaExceededError');
    return set.call(this, k, v);
  };
}"""


def test_errors_are_readable_and_not_sent_back(offline, server):
    """An emoji in a long first message is not cut in half for the title; a failed answer
    shows the server's message with no "0 tokens" under it, and is not sent
    back as an empty assistant turn; an answer cut at max_tokens says so; a full localStorage
    is said in the status line, not thrown; a conversation past the context says what to do."""
    page = offline.page()
    sent = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and sent.append(r.post_data_json))
    page.goto(server.url + "/")
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("0")
    message = page.get_by_label("Message")
    message.fill("a" + "\U0001f600" * 50)
    message.press("Enter")
    error = page.locator(".msg.assistant .error")
    error.wait_for()
    assert "max_tokens" in error.inner_text()
    title = "a" + "\U0001f600" * 39 + "…"  # cut between code points, not inside an emoji
    assert page.locator("#conversations button.conv").inner_text() == title
    assert page.locator(".msg.assistant .stats").inner_text() == ""
    page.evaluate(FULL_STORAGE)
    page.get_by_label("Max tokens").fill("4")
    message.fill("Hello")
    message.press("Enter")
    stats = page.locator(".msg.assistant .stats", has_text="tokens")
    stats.wait_for()
    assert stats.inner_text().startswith("TTFT") and "cut off" in stats.inner_text()
    assert "storage is full" in page.locator("#status").inner_text()
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "user"]
    page.get_by_role("button", name="New chat").click()
    message.fill("x" * 50_000)  # fails on its length before it is tokenized
    message.press("Enter")
    error.wait_for()
    assert "maximum context length" in error.inner_text() and "start a new chat" in error.inner_text()


def test_markdown_is_rendered_and_escaped(offline, server):
    page = offline.page()
    page.goto(server.url + "/ui/chat.html")
    source = "\n".join(
        ["# Title", "Some **bold** and `x<y`", "", "```python", 'print("<b>")', "```", "- one", "- two"]
        + ["<script>x</script>", "", "see [the docs](https://example.com/_drafts_/x) \u00000\u0000"]
    )
    html = page.evaluate("async (s) => (await import('/ui/markdown.js')).renderMarkdown(s)", source)
    # a URL's underscores were read as emphasis: href="https://example.com/<em>drafts</em>/x"
    assert (
        '<a href="https://example.com/_drafts_/x" rel="noopener noreferrer">the docs</a> \ufffd0\ufffd'
        in html
    )
    assert "<strong>bold</strong>" in html and "<code>x&lt;y</code>" in html
    assert '<pre data-lang="python"><code>print(&quot;&lt;b&gt;&quot;)</code></pre>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_a_histograms_infinite_bucket_is_a_bound(offline, server):
    """le="+Inf" was read as NaN (Number("+Inf")): a quantile past the last finite bound showed
    as "p90 ≤ NaN s", and the bucket's place in the sort was up to chance."""
    page = offline.page()
    page.goto(server.url + "/ui/chat.html")
    text = 'h_bucket{le="0.1"} 1\nh_bucket{le="+Inf"} 10\nh_bucket{le="0.5"} 3\nh_count 10\n'
    les, p90, p20 = page.evaluate(
        """async (t) => { const p = await import('/ui/prom.js'); const h = p.histogram(p.parseProm(t), 'h');
        return [h.buckets.map((b) => b.le), p.quantile(h, 0.9), p.quantile(h, 0.2)]; }""",
        text,
    )
    assert les == [0.1, 0.5, float("inf")] and p90 == float("inf") and p20 == 0.5


def _load(server: ServerProcess, stop: threading.Event) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "fox"}], "max_tokens": 200}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        while not stop.is_set():
            client.post("/v1/chat/completions", json=body)


def test_dashboard_under_load(offline, server):
    stop = threading.Event()
    workers = [threading.Thread(target=_load, args=(server, stop)) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        page = offline.page()
        page.goto(server.url + "/dashboard")
        values: list[str] = []

        def changed() -> bool:
            text = page.locator("#v-tokps").inner_text()
            if text != "—" and text not in values:
                values.append(text)
            return len(values) >= 2 and any(float(v) > 0 for v in values)

        wait_until(changed, timeout=30, what="the throughput value to change")
        page.locator("#v-requests", has_text="running").wait_for()
        assert page.locator("canvas#c-tokps").is_visible()
    finally:
        stop.set()
        for w in workers:
            w.join()


def test_dashboard_per_replica(offline, server):
    """With data-parallel replicas (the `engine` label) the charts draw one line per replica:
    /metrics here is what ServerMetrics renders for two engines after one step each. When
    /metrics stops answering, the numbers go blank and the status says when they were last read."""
    metrics = ServerMetrics("tiny", num_engines=2)
    metrics.on_step(EngineCoreOutputs([], num_running=3, num_waiting=1, kv_cache_usage=0.5), [], engine=0)
    metrics.on_step(EngineCoreOutputs([], num_running=1, kv_cache_usage=0.25), [], engine=1)
    page = offline.page()
    down = []  # then the server goes away: its last numbers must not read as current
    page.route(
        server.url + "/metrics",
        lambda r: r.abort() if down else r.fulfill(body=metrics.render(), content_type="text/plain"),
    )
    page.goto(server.url + "/dashboard")
    requests = page.locator("#c-requests")
    requests.and_(page.locator("[aria-label*='running engine 1']")).wait_for()
    label = requests.get_attribute("aria-label")
    assert "running engine 0 3.00" in label and "waiting engine 0 1.00" in label
    assert "running engine 1 1.00" in label and "waiting engine 1 0.00" in label
    kv = page.locator("#c-kv").get_attribute("aria-label")
    assert "engine 0 50.0" in kv and "engine 1 25.0" in kv
    assert page.locator("#v-requests").inner_text() == "4 running · 1 waiting"  # the "total" series
    assert page.locator("#v-kv").inner_text() == "37.5%"
    down.append(True)
    page.locator("#status", has_text="last update").wait_for()
    assert page.locator("#v-requests").inner_text() == "—" and page.locator("#v-kv").inner_text() == "—"


def test_phone_layout(browser, server):
    """On a phone: the sidebar folds away, a pasted token with no spaces wraps instead of
    widening the conversation, and right-to-left text reads right to left."""
    ctx = Offline(browser, server.url, KEY, viewport={"width": 390, "height": 844})
    pasted = "https://example.com/" + "x" * 3000
    rtl = "שלום, מה שלומך?"
    messages = [{"role": "user", "content": pasted}, {"role": "assistant", "content": rtl}]
    convo = [{"id": "c1", "title": "pasted", "messages": messages}]
    stored = json.dumps(json.dumps(convo))
    ctx.context.add_init_script(f"localStorage.setItem('kvserve.conversations', {stored})")
    page = ctx.page()
    page.goto(server.url + "/")
    page.locator(".msg.assistant .body").wait_for()
    box = page.locator("#messages").evaluate("(e) => [e.scrollWidth, e.clientWidth]")
    assert box[0] <= box[1], f"the conversation scrolls sideways: {box}"
    direction = "(e) => getComputedStyle(e).direction"
    assert page.locator(".msg.assistant .body").evaluate(direction) == "rtl"
    assert page.locator(".msg.user .body").evaluate(direction) == "ltr"
    sidebar = page.locator("#sidebar")
    assert not sidebar.is_visible()  # settings behind the menu button on a phone
    page.get_by_role("button", name="Menu").click()
    assert sidebar.is_visible() and page.get_by_label("Model").is_visible()
    page.get_by_role("button", name="Close the menu").click()
    assert not sidebar.is_visible()
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390  # nothing wider than the window
    ctx.close()


def test_disable_web_ui(tmp_path, monkeypatch):
    """--disable-web-ui reaches both servers' settings, and an app built without the pages
    answers 404 where they would be (the gateway's app, which needs no engine, in-process)."""
    from fastapi.testclient import TestClient

    from kvserve.entrypoints import cli
    from kvserve.entrypoints.openai import api_server
    from kvserve.gateway import app as gateway_app
    from kvserve.gateway.config import parse_config

    data = {
        "model_list": [deployment("a", "http://127.0.0.1:9/v1", "tiny")],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }
    for web_ui in (False, True):
        client = TestClient(gateway_app.build_app(parse_config(data), web_ui=web_ui))
        for path in ("/", "/dashboard", "/ui/chat.js"):
            assert client.get(path).status_code == (200 if web_ui else 404), path
        assert client.get("/health").status_code == 200

    seen = []
    monkeypatch.setattr(api_server, "serve", lambda cfg, host, port, srv, core: seen.append(srv.web_ui) or 0)
    monkeypatch.setattr(gateway_app, "serve", lambda cfg, host, port, web_ui: seen.append(web_ui) or 0)
    (tmp_path / "gw.yaml").write_text(json.dumps(data))  # JSON is YAML
    gateway = ["gateway", "--config", str(tmp_path / "gw.yaml")]
    for argv in (["serve", "--disable-web-ui"], ["serve"], [*gateway, "--disable-web-ui"], gateway):
        assert cli.main(argv) == 0
    assert seen == [False, True, False, True]


def test_gateway_chat_over_aliases(browser, server, tmp_path):
    cfg = {
        "model_list": [
            {**deployment("web-alias", server.url + "/v1", "tiny", api_key=KEY), "id": "replica-0"}
        ],
        "keys": [{"key": "sk-gw"}],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }
    gw = GatewayProcess(cfg, str(tmp_path))
    try:
        ctx = Offline(browser, gw.url, "sk-gw")
        page = ctx.page()
        page.goto(gw.url + "/")
        page.wait_for_selector("#model option[value=web-alias]", state="attached")
        page.get_by_label("Max tokens").fill("8")
        page.get_by_label("Message").fill("Hello")
        page.keyboard.press("Enter")
        page.locator(".msg.assistant .stats", has_text="tokens").wait_for()
        page.goto(gw.url + "/dashboard")
        page.locator("#deployments td", has_text="replica-0").wait_for()
        assert page.locator("#deployments tbody td").nth(2).inner_text() == "up"
        page.locator("#v-rps").wait_for()
        ctx.close()
    finally:
        gw.stop()
