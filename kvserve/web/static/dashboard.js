// The dashboard: reads /metrics every 2 s and charts what the engine (or the gateway) is
// doing. Rates are differences between two scrapes; with data-parallel replicas (the
// `engine` label) every chart has one line per replica.

import { api, errorText } from "./common.js";
import { drawHistogram, LineChart } from "./charts.js";
import { histogram, labelValues, parseProm, quantile, sum } from "./prom.js";

const INTERVAL_MS = 2000;
const $ = (id) => document.getElementById(id);
const K = "kvserve:";
const G = "kvserve_gateway_";

const ENGINE_PANELS = [
  ["tokps", "Output tokens/s", "line"],
  ["requests", "Running / waiting requests", "line"],
  ["kv", "KV-cache usage (%)", "line", 100],
  ["prefix", "Prefix-cache hit rate (%)", "line", 100],
  ["preempt", "Preemptions / s", "line"],
  ["ttft", "Time to first token (ms)", "hist"],
  ["itl", "Inter-token latency (ms)", "hist"],
];
const GATEWAY_PANELS = [
  ["rps", "Requests / s", "line"],
  ["inflight", "Requests in flight", "line"],
  ["attempts", "Upstream attempts / s by outcome", "line"],
  ["cooldowns", "Cooldowns / s by deployment", "line"],
  ["latency", "Time to response head (ms)", "hist"],
];

const charts = {};
let previous = null; // {samples, time} of the last scrape

function buildPanels(specs) {
  $("panels").replaceChildren(
    ...specs.map(([id, title, kind, max]) => {
      const panel = document.createElement("section");
      panel.className = "panel";
      panel.setAttribute("aria-labelledby", `t-${id}`);
      const head = document.createElement("div");
      head.className = "panel-head";
      const h = Object.assign(document.createElement("h2"), { id: `t-${id}`, textContent: title });
      const value = Object.assign(document.createElement("output"), { id: `v-${id}`, textContent: "—" });
      head.append(h, value);
      const canvas = Object.assign(document.createElement("canvas"), { id: `c-${id}` });
      canvas.setAttribute("role", "img");
      canvas.setAttribute("aria-label", `${title} chart`);
      panel.append(head, canvas);
      if (kind === "line") charts[id] = new LineChart(canvas, { title, max: max ?? null });
      return panel;
    }),
  );
}

const show = (id, text) => ($(`v-${id}`).textContent = text);
const fmt = (v, digits = 1) => (v === null || !Number.isFinite(v) ? "—" : v.toFixed(digits));
const ms = (s) => (s === null ? "—" : s < 1 ? `${Math.round(s * 1000)} ms` : `${s} s`);

/** Per-second rate of a counter between the last two scrapes (null: no data or a reset). A
 * labelled counter has no series until it first counts, so a missing one counts as 0. */
function rate(cur, dt, name, match = {}) {
  if (!previous) return null;
  const d = (sum(cur, name, match) ?? 0) - (sum(previous.samples, name, match) ?? 0);
  return d >= 0 ? d / dt : null;
}

function histPanel(id, samples, name, match) {
  const hist = histogram(samples, name, match);
  drawHistogram($(`c-${id}`), hist);
  show(id, hist.count ? `p50 ${upTo(hist, 0.5)} · p90 ${upTo(hist, 0.9)} · n=${hist.count}` : "no data");
}

/** "≤ bound" of the q-quantile's bucket; past the last finite bound (the +Inf bucket) "> it". */
function upTo(hist, q) {
  const le = quantile(hist, q);
  if (le !== Infinity) return `≤ ${ms(le)}`;
  const finite = hist.buckets.filter((b) => Number.isFinite(b.le));
  return finite.length ? `> ${ms(finite.at(-1).le)}` : "—";
}

function engineView(samples, dt) {
  const ids = labelValues(samples, `${K}num_requests_running`, "engine").filter((e) => e !== "total");
  const replicas = ids.length ? ids.map((e) => [`engine ${e}`, { engine: e }]) : [["server", {}]];
  const total = ids.length ? { engine: "total" } : {};
  const each = (f) => Object.fromEntries(replicas.map(([name, match]) => [name, f(match)]));

  charts.tokps.push(each((m) => rate(samples, dt, `${K}generation_tokens_total`, m)));
  show("tokps", fmt(rate(samples, dt, `${K}generation_tokens_total`, total)));

  const reqs = {};
  for (const [name, m] of replicas) {
    const tag = ids.length ? ` ${name}` : "";
    reqs[`running${tag}`] = sum(samples, `${K}num_requests_running`, m);
    reqs[`waiting${tag}`] = sum(samples, `${K}num_requests_waiting`, m);
  }
  charts.requests.push(reqs);
  const running = sum(samples, `${K}num_requests_running`, total);
  const waiting = sum(samples, `${K}num_requests_waiting`, total);
  show("requests", `${running ?? "—"} running · ${waiting ?? "—"} waiting`);

  charts.kv.push(each((m) => 100 * sum(samples, `${K}kv_cache_usage_perc`, m)));
  show("kv", `${fmt(100 * sum(samples, `${K}kv_cache_usage_perc`, total))}%`);

  const hitRate = (m) => {
    const q = rate(samples, dt, `${K}prefix_cache_queries_total`, m);
    return q ? (100 * rate(samples, dt, `${K}prefix_cache_hits_total`, m)) / q : null;
  };
  const allQ = sum(samples, `${K}prefix_cache_queries_total`, total);
  const allTime = allQ ? (100 * sum(samples, `${K}prefix_cache_hits_total`, total)) / allQ : null;
  const now = ids.length ? each(hitRate) : { now: hitRate({}) }; // empty while no prompt arrives
  charts.prefix.push({ ...now, "all time": allTime });
  show("prefix", `${fmt(hitRate(total))}% now · ${fmt(allTime)}% all time`);

  charts.preempt.push(each((m) => rate(samples, dt, `${K}num_preemptions_total`, m)));
  show("preempt", `${fmt(rate(samples, dt, `${K}num_preemptions_total`, total), 2)}/s · ${sum(samples, `${K}num_preemptions_total`, total) ?? 0} total`);

  histPanel("ttft", samples, `${K}time_to_first_token_seconds`, total);
  histPanel("itl", samples, `${K}inter_token_latency_seconds`, total);
}

function byLabel(samples, dt, name, label) {
  return Object.fromEntries(labelValues(samples, name, label).map((v) => [v, rate(samples, dt, name, { [label]: v })]));
}

function gatewayView(samples, dt) {
  const rps = rate(samples, dt, `${G}requests_total`);
  charts.rps.push({ requests: rps });
  show("rps", fmt(rps));
  const inflight = sum(samples, `${G}in_flight`);
  charts.inflight.push({ "in flight": inflight });
  show("inflight", String(inflight ?? "—"));
  charts.attempts.push(byLabel(samples, dt, `${G}attempts_total`, "outcome"));
  show("attempts", `${sum(samples, `${G}attempts_total`) ?? 0} total`);
  charts.cooldowns.push(byLabel(samples, dt, `${G}cooldowns_total`, "deployment"));
  show("cooldowns", `${sum(samples, `${G}cooldowns_total`) ?? 0} total`);
  histPanel("latency", samples, `${G}request_seconds`, {});
}

async function deployments() {
  const res = await fetch("/health/readiness");
  const body = await res.json();
  $("deployments-panel").hidden = false;
  $("deployments").tBodies[0].replaceChildren(
    ...body.deployments.map((d) => {
      const tr = document.createElement("tr");
      for (const text of [d.id, d.model_name, d.up ? "up" : "down", d.cooling_down ? "cooling down" : "—"]) {
        tr.append(Object.assign(document.createElement("td"), { textContent: text }));
      }
      return tr;
    }),
  );
}

let mode = null; // "engine" | "gateway", from the first scrape
let updated = null; // the time of the last scrape that worked

/** The server did not answer: the numbers (and deployments' health) shown are no longer now,
 * so they go blank rather than read as current; the charts keep their history. */
function unreachable(e) {
  for (const out of document.querySelectorAll("#panels output")) out.textContent = "—";
  $("deployments-panel").hidden = true;
  $("status").textContent = `metrics: ${e.message}${updated ? ` · last update ${updated}` : ""}`;
}

async function poll() {
  try {
    const res = await api("/metrics");
    if (!res.ok) throw new Error(await errorText(res));
    const samples = parseProm(await res.text());
    const time = performance.now();
    if (!mode) {
      mode = samples.some((s) => s.name.startsWith(G)) ? "gateway" : "engine";
      buildPanels(mode === "gateway" ? GATEWAY_PANELS : ENGINE_PANELS);
    }
    const dt = previous ? (time - previous.time) / 1000 : 1;
    if (mode === "gateway") {
      gatewayView(samples, dt);
      await deployments();
    } else engineView(samples, dt);
    previous = { samples, time };
    updated = new Date().toLocaleTimeString();
    $("status").textContent = `updated ${updated} · every ${INTERVAL_MS / 1000} s`;
  } catch (e) {
    unreachable(e);
  } finally {
    setTimeout(poll, INTERVAL_MS);
  }
}

window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.draw()));
poll();
