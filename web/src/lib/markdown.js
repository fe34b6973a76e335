// Model output is untrusted. It is rendered in three steps, each safe on its own:
// 1. markdown-it with raw HTML off: `<img onerror=...>` in the text stays text, and its link
//    validator drops javascript:, vbscript:, file: and data: URLs; images are not rendered at all
//    (a model-chosen image URL is a classic way to leak a conversation).
// 2. DOMPurify over the result, returning DOM nodes (no second parse of a string).
// 3. The page's Content-Security-Policy: no inline script or style, no foreign images.
// Math goes through KaTeX as MathML, which browsers lay out natively: no fonts, no inline styles.
import MarkdownIt from 'markdown-it';
import katexPlugin from '@vscode/markdown-it-katex';
import DOMPurify from 'dompurify';
import hljs from 'highlight.js/lib/common';

const MAX_AUTO_HIGHLIGHT_CHARS = 20000;

const md = new MarkdownIt({html: false, linkify: true, breaks: false, typographer: false});
md.disable('image');
(katexPlugin.default || katexPlugin)(md, {output: 'mathml', throwOnError: false, trust: false, strict: 'ignore'});

md.renderer.rules.fence = (tokens, index) => {
  const token = tokens[index];
  const language = (token.info || '').trim().split(/\s+/)[0].toLowerCase();
  const code = token.content;
  let highlighted;
  let shown = language;
  if (language && hljs.getLanguage(language)) {
    highlighted = hljs.highlight(code, {language, ignoreIllegals: true}).value;
  } else if (!language && code.length < MAX_AUTO_HIGHLIGHT_CHARS) {
    const auto = hljs.highlightAuto(code);
    highlighted = auto.value;
    shown = auto.language || 'text';
  } else {
    highlighted = md.utils.escapeHtml(code);
  }
  const label = md.utils.escapeHtml(shown || 'text');
  return `<div class="code-block"><div class="code-head"><span class="code-lang">${label}</span>` +
    `<button type="button" class="copy-code" aria-label="Copy ${label} code">Copy</button></div>` +
    `<pre><code class="hljs">${highlighted}</code></pre></div>`;
};

// Column alignment as a class, not a style attribute (the CSP allows no inline style at all).
md.core.ruler.push('align_classes', (state) => {
  for (const token of state.tokens) {
    if (token.type !== 'inline' && token.attrs) {
      const style = token.attrGet('style');
      const align = style && /text-align:(left|right|center)/.exec(style);
      if (style) token.attrs = token.attrs.filter(([name]) => name !== 'style');
      if (align) token.attrJoin('class', `align-${align[1]}`);
    }
  }
});

// Tables scroll sideways on narrow screens instead of widening the page.
md.renderer.rules.table_open = () => '<div class="table-wrap"><table>';
md.renderer.rules.table_close = () => '</table></div>';

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A') {
    const href = node.getAttribute('href') || '';
    if (!/^(https?:|mailto:|#)/i.test(href)) {
      node.removeAttribute('href');
    } else {
      node.setAttribute('target', '_blank');
      node.setAttribute('rel', 'noopener noreferrer nofollow');
    }
  }
});

const PURIFY = {
  USE_PROFILES: {html: true, mathMl: true},
  FORBID_TAGS: ['style', 'img', 'svg', 'form', 'input', 'textarea', 'select', 'iframe', 'object', 'embed', 'video', 'audio', 'source'],
  FORBID_ATTR: ['style', 'srcset', 'formaction'],
  ADD_ATTR: ['target'],
  RETURN_DOM_FRAGMENT: true,
};

// LLMs often write \( \) and \[ \] for math; markdown-it-katex reads $ and $$. Convert outside code.
function normaliseMathDelimiters(text) {
  return text.split(/(```[\s\S]*?(?:```|$)|`[^`\n]*`)/g).map((part, i) => {
    if (i % 2 === 1) return part;
    return part
      .replace(/\\\[([\s\S]+?)\\\]/g, (_, tex) => `$$${tex}$$`)
      .replace(/\\\(([\s\S]+?)\\\)/g, (_, tex) => `$${tex}$`);
  }).join('');
}

/** Sanitised DOM for `text` (Markdown), ready to put in the page. */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(md.render(normaliseMathDelimiters(text || '')), PURIFY);
}

/** Plain text of some Markdown (for titles and search). */
export function plainText(text) {
  return (text || '').replace(/[`*_#>~[\]()]/g, '').replace(/\s+/g, ' ').trim();
}
