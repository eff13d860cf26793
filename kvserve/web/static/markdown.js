// A small Markdown renderer for model answers: fenced code blocks, inline code, headings,
// lists, block quotes, bold, italics, links and paragraphs. Everything is HTML-escaped first,
// so model output can never inject markup. Unclosed fences (mid-stream) render as code.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

function inline(text) {
  const codes = [];
  let s = escapeHtml(text).replace(/`([^`\n]+)`/g, (_, code) => {
    codes.push(code);
    return `\u0000${codes.length - 1}\u0000`;
  });
  s = s
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])[*_]([^*_\n]+)[*_](?![*\w])/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer">$1</a>');
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;

export function renderMarkdown(src) {
  const lines = src.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = [];
  const flush = () => {
    if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    para = [];
  };
  for (let i = 0; i < lines.length; ) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      flush();
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) body.push(lines[i]);
      i++; // the closing fence
      const lang = m[2] ? ` data-lang="${escapeHtml(m[2])}"` : "";
      out.push(`<pre${lang}><code>${escapeHtml(body.join("\n"))}</code></pre>`);
    } else if ((m = line.match(HEADING))) {
      flush();
      const level = Math.min(m[1].length + 2, 6); // inside an answer: below the page's own headings
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if ((m = line.match(ITEM))) {
      flush();
      const ordered = /\d/.test(m[1]);
      const items = [];
      for (; i < lines.length && (m = lines[i].match(ITEM)); i++) items.push(`<li>${inline(m[2])}</li>`);
      out.push(ordered ? `<ol>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
    } else if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      for (; i < lines.length && (m = lines[i].match(QUOTE)); i++) quoted.push(m[1]);
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
    } else if (!line.trim()) {
      flush();
      i++;
    } else {
      para.push(line);
      i++;
    }
  }
  flush();
  return out.join("");
}
