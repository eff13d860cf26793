"""Regenerate the web UI screenshots in docs/ (not a test): the chat and the dashboard at
desktop (1280x800) and phone (390x844) widths, against a real server on the default model.

    python tests/web_screenshots.py
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time

import httpx
from PIL import Image
from playwright.sync_api import sync_playwright

sys.path.insert(0, os.path.dirname(__file__))
from server_utils import ServerProcess  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
SIZES = {"desktop": (1280, 800), "phone": (390, 844)}
QUESTION = "Write a Python function that reverses a string, and explain it in one sentence."
LOAD_PROMPTS = ["Tell me about the sea.", "List three fruits.", "What is a paged KV cache?", "Say hello."]


def save(png: bytes, name: str) -> None:
    """A 64-colour palette PNG: a few tens of KiB instead of a few hundred."""
    img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    path = os.path.join(DOCS, f"web-{name}.png")
    img.save(path, optimize=True)
    print(path, os.path.getsize(path), "bytes")


def load(url: str, stop: threading.Event, i: int) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
            messages = [{"role": "user", "content": prompt}]
            body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 96}
            c.post("/v1/chat/completions", json=body)
            i += 1


def main() -> None:
    args = ("--kv-cache-memory", "128MiB", "--max-model-len", "2048")
    server = ServerProcess("smollm2-135m", *args, api_key=None)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            desk = browser.new_context(viewport=dict(zip(("width", "height"), SIZES["desktop"])))
            page = desk.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("#model option", state="attached")
            page.get_by_label("System prompt").fill("You are a concise assistant.")
            page.get_by_label("Temperature").fill("0")
            page.get_by_label("Max tokens").fill("160")
            page.get_by_role("textbox", name="Message").fill(QUESTION)
            page.keyboard.press("Enter")
            page.locator(".msg.assistant .stats", has_text="tokens").wait_for(timeout=180_000)
            save(page.screenshot(), "chat-desktop")
            state = desk.storage_state()

            stop = threading.Event()
            workers = [threading.Thread(target=load, args=(server.url, stop, i)) for i in range(3)]
            for w in workers:
                w.start()
            try:
                page.goto(server.url + "/dashboard")
                time.sleep(30)
                save(page.screenshot(), "dashboard-desktop")
                phone = browser.new_context(
                    viewport=dict(zip(("width", "height"), SIZES["phone"])), storage_state=state
                )
                mobile = phone.new_page()
                mobile.goto(server.url + "/dashboard")
                time.sleep(12)
                save(mobile.screenshot(), "dashboard-phone")
            finally:
                stop.set()
                for w in workers:
                    w.join()
            mobile.goto(server.url + "/")
            mobile.locator(".msg.assistant .stats").wait_for()
            save(mobile.screenshot(), "chat-phone")
            browser.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
