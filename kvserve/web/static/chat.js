// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions
// (server-sent events read with fetch, so Stop can abort the request: the server then aborts
// it in the engine, which frees its KV blocks) and rendered as Markdown as they arrive.

import { api, errorInfo, errorText } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "kvserve.conversations";
const SETTINGS = "kvserve.chatSettings";
const TOO_LONG = "The conversation no longer fits the model: start a new chat, or lower Max tokens.";
const FIELDS = ["model", "system", "temperature", "top_p", "max_tokens", "seed", "json_mode", "json_schema"];

const load = (key, fallback) => {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
};
let conversations = load(STORE, []);
let current = null; // the conversation on screen
let controller = null; // the AbortController of the answer being streamed
let leaving = false; // the page is being closed or reloaded: its fetch fails with "network error"

const INTERRUPTED = "Interrupted: the page was closed or reloaded while this answer streamed.";

/** Kept in localStorage; a full storage (about 5 MB a site) is said, not thrown away silently. */
function saveConversations() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch (e) {
    setStatus(`Not saved (${e.name}): the browser's storage is full; delete old conversations.`);
  }
}

/** An answer saved while it streamed (the page went away before it ended) says so. */
for (const c of conversations) {
  for (const m of c.messages) {
    if (!m.pending) continue;
    delete m.pending;
    m.error ??= INTERRUPTED;
  }
}

// ---- settings -------------------------------------------------------------------------------
function readSetting(name) {
  const el = $(name);
  return el.type === "checkbox" ? el.checked : el.value;
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify(Object.fromEntries(FIELDS.map((f) => [f, readSetting(f)]))));
}

function restoreSettings() {
  const saved = load(SETTINGS, {});
  for (const f of FIELDS) {
    if (!(f in saved) || f === "model") continue; // the model list is not loaded yet
    if ($(f).type === "checkbox") $(f).checked = saved[f];
    else $(f).value = saved[f];
  }
  for (const f of FIELDS) $(f).addEventListener("change", saveSettings);
}

async function loadModels() {
  const res = await api("/v1/models");
  if (!res.ok) return setStatus(`models: ${await errorText(res)}`);
  const ids = (await res.json()).data.map((m) => m.id);
  const select = $("model");
  select.replaceChildren(...ids.map((id) => new Option(id, id)));
  const saved = load(SETTINGS, {}).model;
  if (ids.includes(saved)) select.value = saved;
}

/** The request body's sampling part; throws on a JSON schema that does not parse. */
function samplingBody() {
  const body = { model: $("model").value };
  const num = (f) => (readSetting(f) === "" ? null : Number(readSetting(f)));
  for (const f of ["temperature", "top_p", "max_tokens", "seed"]) if (num(f) !== null) body[f] = num(f);
  if (readSetting("json_mode")) {
    const text = readSetting("json_schema").trim();
    body.response_format = text
      ? { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(text) } }
      : { type: "json_object" };
  }
  return body;
}

// ---- conversations --------------------------------------------------------------------------
function newConversation() {
  current = { id: crypto.randomUUID?.() ?? String(Date.now()), title: "New chat", messages: [] };
  renderAll();
  $("prompt").focus();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren(
    ...conversations.map((c) => {
      const li = document.createElement("li");
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conv" + (c === current ? " active" : "");
      open.textContent = c.title;
      open.onclick = () => {
        if (controller) return;
        current = c;
        renderAll();
        closeMenu();
      };
      const del = document.createElement("button");
      del.type = "button";
      del.className = "icon";
      del.textContent = "×";
      del.setAttribute("aria-label", `Delete conversation “${c.title}”`);
      del.onclick = () => {
        conversations = conversations.filter((x) => x !== c);
        saveConversations();
        if (c === current) newConversation();
        else renderList();
      };
      li.append(open, del);
      return li;
    }),
  );
}

function renderAll() {
  $("title").textContent = current.title;
  $("messages").replaceChildren(...current.messages.map((m, i) => messageElement(m, i)));
  renderList();
  scrollDown();
}

function messageElement(msg, index) {
  const el = document.createElement("article");
  el.className = `msg ${msg.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = msg.role === "user" ? "You" : msg.model || "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  body.dir = "auto"; // Arabic or Hebrew text reads right to left
  el.append(role, body);
  if (msg.role === "assistant") {
    const meta = document.createElement("footer");
    meta.className = "meta";
    const stats = document.createElement("span");
    stats.className = "stats";
    const copy = button("Copy", "Copy this answer", () => copyText(msg.content, copy));
    meta.append(stats, copy);
    if (index === current.messages.length - 1) {
      meta.append(button("Regenerate", "Regenerate this answer", regenerate));
    }
    el.append(meta);
  }
  fillMessage(el, msg);
  return el;
}

function fillMessage(el, msg) {
  const body = el.querySelector(".body");
  if (msg.role === "user") body.textContent = msg.content;
  else {
    body.innerHTML = renderMarkdown(msg.content);
    for (const pre of body.querySelectorAll("pre")) {
      pre.append(button("Copy", "Copy this code", (e) => copyText(pre.querySelector("code").textContent, e.target)));
    }
  }
  if (msg.error) {
    const err = document.createElement("p");
    err.className = "error";
    err.textContent = msg.error;
    body.append(err);
  }
  const stats = el.querySelector(".stats");
  if (stats) stats.textContent = statsText(msg.stats);
}

function statsText(s) {
  if (!s) return "";
  const parts = [];
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  parts.push(`${s.tokens} tokens`);
  if (s.tok_per_s != null) parts.push(`${s.tok_per_s.toFixed(1)} tok/s`);
  if (s.stopped) parts.push("stopped");
  else if (s.finish === "length") parts.push("cut off: max tokens or context length reached");
  return parts.join(" · ");
}

function button(label, aria, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "small";
  b.textContent = label;
  b.setAttribute("aria-label", aria);
  b.onclick = onclick;
  return b;
}

async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const was = btn.textContent;
  btn.textContent = "Copied";
  setTimeout(() => (btn.textContent = was), 1200);
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function setStatus(text) {
  $("status").textContent = text;
}

// ---- sending and streaming ------------------------------------------------------------------
/** The sampling body, or null (and why, in the status line) before anything is changed, so a
 * schema that does not parse leaves the message in the box and the conversation as it was. */
function checkedBody() {
  try {
    return samplingBody();
  } catch (e) {
    setStatus(`JSON schema: ${e.message}`);
    return null;
  }
}

function send() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  const body = checkedBody();
  if (!body) return;
  $("prompt").value = "";
  if (!current.messages.length) {
    const chars = Array.from(text); // by code point: a cut emoji would show as "�"
    current.title = chars.length > 40 ? chars.slice(0, 40).join("") + "…" : text;
    conversations.unshift(current);
  }
  current.messages.push({ role: "user", content: text });
  answer(body);
}

function regenerate() {
  if (controller) return;
  const body = checkedBody();
  if (!body) return;
  if (current.messages.at(-1)?.role === "assistant") current.messages.pop();
  answer(body);
}

async function answer(body) {
  // a failed answer with no text is shown, not sent back: it never was the model's turn
  const said = current.messages.filter((m) => !(m.role === "assistant" && m.error && !m.content));
  const history = said.map(({ role, content }) => ({ role, content }));
  const system = readSetting("system").trim();
  body.messages = system ? [{ role: "system", content: system }, ...history] : history;
  body.stream = true;
  body.stream_options = { include_usage: true };

  const msg = { role: "assistant", content: "", model: body.model, pending: true };
  const convo = current;
  convo.messages.push(msg);
  renderAll();
  const el = $("messages").lastElementChild;
  el.setAttribute("aria-busy", "true");
  controller = new AbortController();
  setBusy(true);
  saveConversations(); // the question is kept even if the page goes away mid-answer
  const t0 = performance.now();
  let tFirst = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      fillMessage(el, msg);
      scrollDown();
    });
  };
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) {
      const { message, code } = await errorInfo(res);
      throw new Error(code === "context_length_exceeded" ? `${message.replace(/\.?$/, ".")} ${TOO_LONG}` : message);
    }
    for await (const event of sseEvents(res.body)) {
      if (event.error) throw new Error(event.error.message || "stream error");
      if (event.usage) usage = event.usage;
      finish = event.choices?.[0]?.finish_reason ?? finish;
      const text = event.choices?.[0]?.delta?.content;
      if (text) {
        tFirst ??= performance.now();
        chunks++;
        msg.content += text;
        redraw();
      }
    }
  } catch (e) {
    if (leaving) msg.error = INTERRUPTED;
    else if (e.name === "AbortError") msg.stopped = true;
    else msg.error = e.message;
  } finally {
    const tEnd = performance.now();
    const tokens = usage?.completion_tokens ?? chunks;
    const failed = msg.error && tFirst === null; // no "0 tokens" under an error
    msg.stats = failed ? null : {
      ttft_ms: tFirst === null ? null : tFirst - t0,
      tokens,
      tok_per_s: tFirst !== null && tokens > 1 && tEnd > tFirst ? (tokens - 1) / ((tEnd - tFirst) / 1000) : null,
      stopped: Boolean(msg.stopped),
      finish,
    };
    delete msg.pending;
    controller = null;
    setBusy(false);
    el.removeAttribute("aria-busy");
    saveConversations();
    if (convo === current) renderAll();
  }
}

/** The JSON payloads of a server-sent event stream, until [DONE]. */
async function* sseEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim())
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  setStatus(busy ? "answering…" : "");
}

// ---- wiring ---------------------------------------------------------------------------------
function closeMenu() {
  document.body.classList.remove("menu-open");
  $("menu").setAttribute("aria-expanded", "false");
}

function init() {
  restoreSettings();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  window.addEventListener("pagehide", () => {
    leaving = true;
    if (controller) saveConversations(); // the partial answer, should the page go before the fetch fails
  });
  $("new-chat").addEventListener("click", () => {
    if (!controller) newConversation();
    closeMenu();
  });
  $("menu-close").addEventListener("click", closeMenu);
  document.addEventListener("keydown", (e) => e.key === "Escape" && closeMenu());
  $("menu").addEventListener("click", () => {
    const open = document.body.classList.toggle("menu-open");
    $("menu").setAttribute("aria-expanded", String(open));
  });
  current = conversations[0] ?? null;
  if (current) renderAll();
  else newConversation();
  loadModels();
}

init();
