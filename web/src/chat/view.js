// Rendering the conversation: one <article> per message on the branch shown. The streaming answer
// is updated in place once per animation frame, however many tokens arrived in between.
import {h, $, formatNumber} from '../lib/dom.js';
import {renderMarkdown} from '../lib/markdown.js';
import {path, siblings} from './tree.js';

const ROLE_NAMES = {user: 'You', assistant: 'Assistant', tool: 'Tool result'};

export class MessageView {
  /** actions: {regenerate(id), edit(id, text), switchSibling(id, step), submitToolResults(id, results), copy(text)} */
  constructor(container, actions) {
    this.container = container;
    this.actions = actions;
    this.articles = new Map();
    this.pending = new Set();
    this.frame = null;
    this.doc = null;
    this.onPainted = null; // (messageId, time) after a frame that changed a message
  }

  /** Rebuild everything (a conversation opened, a branch switched, a message added). */
  show(doc, streamingIds = new Set()) {
    this.doc = doc;
    this.articles.clear();
    const messages = doc ? path(doc) : [];
    const nodes = messages.map((m) => {
      const article = this.article(m, streamingIds.has(m.id));
      this.articles.set(m.id, article);
      return article;
    });
    this.container.replaceChildren(...nodes);
    if (!nodes.length) this.container.append(this.emptyState());
    this.scrollToEnd(true);
  }

  emptyState() {
    return h('div', {class: 'empty-state'}, h('h2', {}, 'How can I help?'),
      h('p', {}, 'Ask anything. Press Enter to send, Shift+Enter for a new line, Ctrl+/ for shortcuts.'));
  }

  /** Schedule a repaint of one message (coalesced per animation frame). */
  update(messageId) {
    this.pending.add(messageId);
    if (this.frame === null) this.frame = requestAnimationFrame(() => this.flush());
  }

  flush() {
    this.frame = null;
    const ids = [...this.pending];
    this.pending.clear();
    const stick = this.nearBottom();
    for (const id of ids) {
      const old = this.articles.get(id);
      const message = this.doc?.messages[id];
      if (!old || !message) continue;
      this.fill(old, message, old.getAttribute('aria-busy') === 'true');
    }
    if (stick) this.scrollToEnd(true);
    const now = performance.now();
    if (this.onPainted) for (const id of ids) this.onPainted(id, now);
  }

  setStreaming(messageId, streaming) {
    const article = this.articles.get(messageId);
    if (!article) return;
    article.setAttribute('aria-busy', streaming ? 'true' : 'false');
    const message = this.doc?.messages[messageId];
    if (message) this.fill(article, message, streaming);
  }

  article(message, streaming) {
    const article = h('article', {class: `msg ${message.role}`, 'aria-busy': streaming ? 'true' : 'false',
      dataset: {id: message.id}, 'aria-label': ROLE_NAMES[message.role] || message.role});
    this.fill(article, message, streaming);
    return article;
  }

  fill(article, message, streaming) {
    const doc = this.doc;
    const parts = [];
    const roleName = message.role === 'assistant' ? (message.stats?.model || doc.model || 'Assistant') : ROLE_NAMES[message.role];
    parts.push(h('div', {class: 'msg-role'}, roleName));
    if (message.reasoning) {
      const details = h('details', {class: 'reasoning'},
        h('summary', {}, streaming && !message.content ? 'Thinking…' : 'Reasoning'),
        h('div', {class: 'md'}, renderMarkdown(message.reasoning)));
      const previous = article.querySelector('details.reasoning');
      if (previous?.open) details.open = true;
      parts.push(details);
    }
    if (message.role === 'user' && article.dataset.editing === 'true') {
      parts.push(this.editor(article, message));
    } else if (message.role === 'user') {
      parts.push(h('div', {class: 'md user-text'}, message.content));
    } else if (message.role === 'tool') {
      parts.push(h('div', {class: 'tool-result'}, h('div', {class: 'tool-label'}, `Result for ${message.tool_call_id}`),
        h('pre', {}, h('code', {}, message.content))));
    } else {
      const body = h('div', {class: 'md content'}, renderMarkdown(message.content));
      if (streaming && !message.content && !message.reasoning && !message.tool_calls?.length) {
        body.append(h('span', {class: 'typing', 'aria-label': 'Waiting for the first token'}, '…'));
      }
      parts.push(body);
      if (message.tool_calls?.length) parts.push(this.toolCalls(message, streaming));
    }
    if (message.error) parts.push(h('div', {class: 'msg-error', role: 'alert'}, message.error));
    const meta = this.meta(message);
    if (meta) parts.push(meta);
    if (!streaming) parts.push(this.actionsBar(message));
    article.replaceChildren(...parts);
    const stats = message.stats || {};
    for (const key of ['ttft_ms', 'paint_ms', 'completion_tokens', 'tokens_per_s']) {
      if (stats[key] !== undefined && stats[key] !== null) article.dataset[key.replace(/_(\w)/g, (_, c) => c.toUpperCase())] = stats[key];
    }
    if (stats.status) article.dataset.status = stats.status;
  }

  meta(message) {
    const s = message.stats;
    if (message.role !== 'assistant' || !s) return null;
    const bits = [];
    if (s.completion_tokens !== undefined) bits.push(`${formatNumber(s.completion_tokens)} tokens`);
    if (s.prompt_tokens !== undefined) bits.push(`${formatNumber(s.prompt_tokens)} prompt`);
    if (s.ttft_ms !== undefined && s.ttft_ms !== null) bits.push(`TTFT ${formatNumber(s.ttft_ms)} ms`);
    if (s.tokens_per_s) bits.push(`${formatNumber(s.tokens_per_s, 1)} tok/s`);
    if (s.transport) bits.push(s.transport === 'websocket' ? 'WebSocket' : 'SSE');
    if (s.status === 'cancelled') bits.push('stopped');
    return bits.length ? h('div', {class: 'msg-meta'}, bits.join(' · ')) : null;
  }

  toolCalls(message, streaming) {
    const doc = this.doc;
    const answered = new Set(Object.values(doc.messages).filter((m) => m.role === 'tool').map((m) => m.tool_call_id));
    const box = h('div', {class: 'tool-calls'});
    const inputs = [];
    for (const call of message.tool_calls) {
      const name = call.function?.name || 'tool';
      let args = call.function?.arguments || '';
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch {
        // partial or invalid JSON while streaming: show as is
      }
      const item = h('details', {class: 'tool-call', open: true},
        h('summary', {}, `Tool call: ${name}`), h('pre', {}, h('code', {}, args)));
      if (!streaming && !answered.has(call.id)) {
        const id = `tool-result-${message.id}-${call.id}`;
        const input = h('textarea', {id, rows: 2, class: 'tool-result-input', placeholder: 'Paste what the tool returned'});
        inputs.push({call, input});
        item.append(h('label', {for: id}, `Result of ${name}`), input);
      }
      box.append(item);
    }
    if (inputs.length) {
      box.append(h('button', {type: 'button', class: 'btn', onclick: () => this.actions.submitToolResults(message.id,
        inputs.map(({call, input}) => ({tool_call_id: call.id, content: input.value})))}, 'Send tool results'));
    }
    return box;
  }

  actionsBar(message) {
    const bar = h('div', {class: 'msg-actions'});
    const {all, index} = siblings(this.doc, message);
    if (all.length > 1) {
      bar.append(h('span', {class: 'branch-nav'},
        h('button', {type: 'button', class: 'btn icon', 'aria-label': 'Previous version', disabled: index === 0,
          onclick: () => this.actions.switchSibling(message.id, -1)}, '‹'),
        h('span', {class: 'branch-pos'}, `${index + 1} / ${all.length}`),
        h('button', {type: 'button', class: 'btn icon', 'aria-label': 'Next version', disabled: index === all.length - 1,
          onclick: () => this.actions.switchSibling(message.id, 1)}, '›')));
    }
    bar.append(h('button', {type: 'button', class: 'btn small', onclick: () => this.actions.copy(message.content)}, 'Copy'));
    if (message.role === 'user') {
      bar.append(h('button', {type: 'button', class: 'btn small edit', onclick: () => this.startEdit(message.id)}, 'Edit'));
    }
    if (message.role === 'assistant') {
      bar.append(h('button', {type: 'button', class: 'btn small regenerate',
        onclick: () => this.actions.regenerate(message.id)}, 'Regenerate'));
    }
    return bar;
  }

  startEdit(messageId) {
    const article = this.articles.get(messageId);
    if (!article) return;
    article.dataset.editing = 'true';
    this.fill(article, this.doc.messages[messageId], false);
    $('textarea', article)?.focus();
  }

  editor(article, message) {
    const id = `edit-${message.id}`;
    const area = h('textarea', {id, class: 'edit-input', rows: 3}, message.content);
    const stop = () => {
      delete article.dataset.editing;
      this.fill(article, message, false);
    };
    area.addEventListener('keydown', (event) => {
      if (event.key === 'Escape') stop();
      if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        delete article.dataset.editing;
        this.actions.edit(message.id, area.value);
      }
    });
    return h('div', {class: 'editor'}, h('label', {for: id, class: 'visually-hidden'}, 'Edit your message'), area,
      h('div', {class: 'editor-actions'},
        h('button', {type: 'button', class: 'btn primary save-edit', onclick: () => {
          delete article.dataset.editing;
          this.actions.edit(message.id, area.value);
        }}, 'Save and submit'),
        h('button', {type: 'button', class: 'btn', onclick: stop}, 'Cancel')));
  }

  nearBottom() {
    const c = this.container;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  }

  scrollToEnd(force = false) {
    if (force || this.nearBottom()) this.container.scrollTop = this.container.scrollHeight;
  }
}
