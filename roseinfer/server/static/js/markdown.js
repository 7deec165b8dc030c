// Renders Markdown (the model's answers) to DOM nodes that cannot run anything: marked parses,
// HTML written in the text is shown as text, images become links (the page fetches nothing from
// elsewhere), and DOMPurify keeps only the tags and attributes marked itself produces.
// Fenced code blocks get a label and a Copy button.

const { marked, DOMPurify } = globalThis;

function escapeHtml(text) {
  return text
    .replaceAll("&", "&amp;")
    .replaceAll("<", "&lt;")
    .replaceAll(">", "&gt;")
    .replaceAll('"', "&quot;")
    .replaceAll("'", "&#39;");
}

const parser = new marked.Marked({
  gfm: true,
  breaks: true, // a chat answer's single line breaks are meant as line breaks
  renderer: {
    html({ text, block }) {
      return block ? `<p class="raw">${escapeHtml(text)}</p>` : escapeHtml(text);
    },
    image({ href, text }) {
      const target = String(href ?? "");
      return `<a href="${escapeHtml(target)}">${escapeHtml(text || target)}</a>`;
    },
  },
});

const PURIFY_OPTIONS = {
  ALLOWED_TAGS: [
    "a", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
    "input", "li", "ol", "p", "pre", "strong", "table", "tbody", "td", "th", "thead", "tr", "ul",
  ],
  ALLOWED_ATTR: ["href", "title", "class", "align", "start", "type", "checked", "disabled"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank"); // a link never replaces the conversation
    node.setAttribute("rel", "noopener noreferrer");
  }
});

function codeBlock(pre) {
  const code = pre.querySelector("code");
  const language = /language-(\S+)/.exec(code?.className ?? "")?.[1] ?? "";
  const block = document.createElement("div");
  block.className = "code-block";
  const head = document.createElement("div");
  head.className = "code-head";
  const label = document.createElement("span");
  label.textContent = language || "code";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  head.append(label, copy);
  pre.replaceWith(block);
  block.append(head, pre);
}

// A DocumentFragment for `text`; safe to insert whatever the text holds.
export function renderMarkdown(text) {
  const fragment = DOMPurify.sanitize(parser.parse(text), PURIFY_OPTIONS);
  for (const pre of fragment.querySelectorAll("pre")) codeBlock(pre);
  return fragment;
}

// The clipboard API exists only on https and localhost; a page opened over plain http on another
// address copies through a selection instead.
function copyBySelection(element) {
  const range = document.createRange();
  range.selectNodeContents(element);
  const selection = getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
  const copied = document.execCommand("copy");
  selection.removeAllRanges();
  return copied;
}

// Copies the code of the block whose Copy button was clicked; says so on the button.
export async function copyCode(button) {
  const code = button.closest(".code-block").querySelector("pre");
  let copied;
  try {
    await navigator.clipboard.writeText(code.textContent);
    copied = true;
  } catch {
    copied = copyBySelection(code);
  }
  button.textContent = copied ? "Copied" : "Copy failed";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}
