// Small DOM helpers. Text always goes in through textContent; the only HTML the pages ever insert
// is the sanitised Markdown of lib/markdown.js.

/** Create an element: h('button', {class: 'btn', onclick: f, 'aria-label': 'x'}, 'text', child). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') el.addEventListener(name.slice(2), value);
    else if (name === 'class') el.className = value;
    else if (name === 'dataset') Object.assign(el.dataset, value);
    else if (value === true) el.setAttribute(name, '');
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export const $ = (selector, root = document) => root.querySelector(selector);
export const $$ = (selector, root = document) => [...root.querySelectorAll(selector)];

/** The page config the server puts in <meta name="kvik-config"> (never inline script). */
export function pageConfig() {
  const meta = document.querySelector('meta[name="kvik-config"]');
  try {
    return JSON.parse(meta?.content || '{}');
  } catch {
    return {};
  }
}

export function formatNumber(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return '–';
  return Number(value).toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits});
}

export function formatTime(unixSeconds) {
  if (!unixSeconds) return '–';
  return new Date(unixSeconds * 1000).toLocaleString();
}

/** Save `text` as a file through a blob URL (no server round trip, allowed by the CSP). */
export function download(filename, text, type) {
  const url = URL.createObjectURL(new Blob([text], {type}));
  const link = h('a', {href: url, download: filename});
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false;
  }
}

export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}
