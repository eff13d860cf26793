// Shared by both pages: requests to our own origin, with the API key when the server wants one.
// The key is asked for once (when the server first answers 401) and kept in sessionStorage,
// so it lasts as long as the tab and is never written to disk by the page.

const KEY_NAME = "kvserve.apiKey";
let asking = null;

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

function withKey(headers = {}) {
  const key = apiKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : { ...headers };
}

/** Show the key dialog; resolves once a key has been entered (one dialog for all callers). */
export function askForKey(note) {
  if (asking) return asking;
  asking = new Promise((resolve) => {
    const dialog = document.getElementById("key-dialog");
    const form = dialog.querySelector("form");
    const input = dialog.querySelector("input");
    dialog.querySelector(".key-note").textContent = note;
    dialog.addEventListener("cancel", (e) => e.preventDefault()); // Esc would leave callers waiting
    form.onsubmit = (e) => {
      e.preventDefault();
      sessionStorage.setItem(KEY_NAME, input.value.trim());
      dialog.close();
      asking = null;
      resolve();
    };
    input.value = "";
    dialog.showModal();
    input.focus();
  });
  return asking;
}

/** fetch() on our origin; a 401 asks for a key and tries again with it. */
export async function api(path, init = {}) {
  for (;;) {
    const res = await fetch(path, { ...init, headers: withKey(init.headers) });
    if (res.status !== 401) return res;
    await askForKey(apiKey() ? "That key was refused. Enter another." : "This server needs an API key.");
  }
}

/** The message and code of an OpenAI-shaped error body (the HTTP status when it has none). */
export async function errorInfo(res) {
  try {
    const body = await res.json();
    return { message: body.error?.message || JSON.stringify(body), code: body.error?.code ?? null };
  } catch {
    return { message: `HTTP ${res.status}`, code: null };
  }
}

/** The message of an OpenAI-shaped error body, or the HTTP status. */
export async function errorText(res) {
  return (await errorInfo(res)).message;
}
