// Reading Prometheus' text exposition format (what /metrics returns) into samples, and the
// few questions the dashboard asks of them.

const LINE = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
/** A number as the format writes it: "+Inf" and "-Inf" too (Number("+Inf") is NaN). */
const number = (v) => (v === "+Inf" ? Infinity : v === "-Inf" ? -Infinity : Number(v));
const LABEL = /([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g;

/** [{name, labels: {k: v}, value}] for every sample line (comments skipped). */
export function parseProm(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(LINE);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(LABEL)) labels[k] = v.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    samples.push({ name: m[1], labels, value: number(m[3]) });
  }
  return samples;
}

/** Sum of `name` over the samples whose labels include every pair in `match`. */
export function sum(samples, name, match = {}) {
  let total = 0;
  let found = false;
  for (const s of samples) {
    if (s.name !== name) continue;
    if (Object.entries(match).some(([k, v]) => s.labels[k] !== v)) continue;
    total += s.value;
    found = true;
  }
  return found ? total : null;
}

/** The distinct values of `label` on samples of `name`. */
export function labelValues(samples, name, label) {
  return [...new Set(samples.filter((s) => s.name === name && label in s.labels).map((s) => s.labels[label]))];
}

/** A histogram's buckets as [{le, count}] (per bucket, not cumulative) plus the total count. */
export function histogram(samples, name, match = {}) {
  const cumulative = samples
    .filter((s) => s.name === `${name}_bucket` && Object.entries(match).every(([k, v]) => s.labels[k] === v))
    .map((s) => ({ le: number(s.labels.le), count: s.value }))
    .sort((a, b) => a.le - b.le);
  const buckets = cumulative.map((b, i) => ({ le: b.le, count: b.count - (i ? cumulative[i - 1].count : 0) }));
  return { buckets, count: cumulative.at(-1)?.count ?? 0 };
}

/** The q-quantile's bucket bound (the smallest `le` holding q of the observations): Infinity
 * when they lie past the last finite bound. */
export function quantile(hist, q) {
  if (!hist.count) return null;
  let seen = 0;
  for (const b of hist.buckets) {
    seen += b.count;
    if (seen >= q * hist.count) return b.le;
  }
  return null;
}
