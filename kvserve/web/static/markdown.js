// A small Markdown renderer for model answers: fenced code blocks, inline code, headings,
// lists, block quotes, bold, italics, links and paragraphs. Everything is HTML-escaped first,
// so model output can never inject markup. Unclosed fences (mid-stream) render as code.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

const emphasis = (s) =>
  s
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])[*_]([^*_\n]+)[*_](?![*\w])/g, "$1<em>$2</em>");

// Code spans and links are set aside (as \u0000n\u0000 and \u0001n\u0001) before emphasis, so
// a URL's underscores or asterisks (https://x.org/a_b_c) are not read as emphasis inside its
// href; the model's own \u0000 / \u0001 are shown as U+FFFD, never taken for a placeholder.
function inline(text) {
  const codes = [];
  const links = [];
  let s = escapeHtml(text.replace(/[\u0000\u0001]/g, "\ufffd"))
    .replace(/`([^`\n]+)`/g, (_, code) => {
      codes.push(code);
      return `\u0000${codes.length - 1}\u0000`;
    })
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, label, url) => {
      links.push(`<a href="${url}" rel="noopener noreferrer">${emphasis(label)}</a>`);
      return `\u0001${links.length - 1}\u0001`;
    });
  s = emphasis(s).replace(/\u0001(\d+)\u0001/g, (_, i) => links[Number(i)]);
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
