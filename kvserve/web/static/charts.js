// Two small canvas charts, no library: a rolling line chart with one line per series, and a
// bar chart of a latency histogram. Colours come from the page's CSS variables.

const PALETTE = ["--c0", "--c1", "--c2", "--c3", "--c4", "--c5"];

function prepare(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const { width, height } = canvas.getBoundingClientRect();
  canvas.width = Math.max(1, Math.round(width * ratio));
  canvas.height = Math.max(1, Math.round(height * ratio));
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const css = getComputedStyle(canvas);
  ctx.font = `11px ${css.fontFamily}`;
  return { ctx, width, height, css };
}

const color = (css, i) => css.getPropertyValue(PALETTE[i % PALETTE.length]).trim() || "#3b82f6";

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map((m) => m * p).find((m) => m >= v);
}

const fmt = (v) => (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2));

export class LineChart {
  constructor(canvas, { title = "", points = 90, max = null } = {}) {
    this.canvas = canvas;
    this.title = title;
    this.points = points; // 90 samples x 2 s: the last three minutes
    this.fixedMax = max;
    this.series = new Map(); // name -> values (null: no value for that sample)
  }

  push(values) {
    for (const name of Object.keys(values)) if (!this.series.has(name)) this.series.set(name, []);
    for (const [name, list] of this.series) {
      list.push(values[name] ?? null);
      if (list.length > this.points) list.shift();
    }
    // The latest value of each line, for screen readers (and tests) that cannot see the canvas.
    const latest = [...this.series].map(([name, list]) => `${name} ${list.at(-1) === null ? "—" : fmt(list.at(-1))}`);
    this.canvas.setAttribute("aria-label", `${this.title}: ${latest.join(", ")}`);
    this.draw();
  }

  draw() {
    const { ctx, width, height, css } = prepare(this.canvas);
    const left = 34;
    const top = 16;
    const bottom = height - 6;
    const all = [...this.series.values()].flat().filter((v) => v !== null);
    const max = this.fixedMax ?? niceMax(Math.max(0, ...all));
    ctx.strokeStyle = css.getPropertyValue("--grid").trim();
    ctx.fillStyle = css.getPropertyValue("--muted").trim();
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const y = bottom - f * (bottom - top);
      ctx.beginPath();
      ctx.moveTo(left, y);
      ctx.lineTo(width, y);
      ctx.stroke();
      ctx.fillText(fmt(max * f), 2, y + 4);
    }
    const step = (width - left) / Math.max(1, this.points - 1);
    let i = 0;
    let legendX = left;
    for (const [name, list] of this.series) {
      ctx.strokeStyle = ctx.fillStyle = color(css, i++);
      ctx.lineWidth = 1.8;
      ctx.beginPath();
      let drawing = false;
      const offset = this.points - list.length;
      list.forEach((v, j) => {
        if (v === null) return (drawing = false);
        const x = left + (offset + j) * step;
        const y = bottom - (Math.min(v, max) / max) * (bottom - top);
        drawing ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
        drawing = true;
      });
      ctx.stroke();
      if (this.series.size > 1) {
        ctx.fillText(name, legendX, 11);
        legendX += ctx.measureText(name).width + 12;
      }
    }
  }
}

/** Bars of a histogram's per-bucket counts, labelled by upper bound in milliseconds. */
export function drawHistogram(canvas, hist) {
  const { ctx, width, height, css } = prepare(canvas);
  const buckets = hist.buckets.filter((b) => Number.isFinite(b.le));
  const last = buckets.findLastIndex((b) => b.count > 0);
  const shown = buckets.slice(0, Math.max(last + 2, 6));
  const max = Math.max(1, ...shown.map((b) => b.count));
  const bottom = height - 16;
  const w = width / Math.max(1, shown.length);
  ctx.fillStyle = color(css, 0);
  shown.forEach((b, i) => {
    const h = (b.count / max) * (bottom - 4);
    ctx.fillRect(i * w + 2, bottom - h, Math.max(1, w - 4), h);
  });
  ctx.fillStyle = css.getPropertyValue("--muted").trim();
  shown.forEach((b, i) => {
    if (i % Math.ceil(shown.length / 8)) return;
    const ms = b.le * 1000;
    ctx.fillText(ms >= 1000 ? `${ms / 1000}s` : `${ms}`, i * w + 2, height - 3);
  });
}
