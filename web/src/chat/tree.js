// A conversation is a tree of messages, so that editing a past message or regenerating an answer
// branches instead of overwriting. The document:
//   {version: 1, model, settings: {system, temperature, top_p, max_tokens, seed, tools},
//    messages: {id: {id, parent, role, content, reasoning, tool_calls, tool_call_id, stats, error,
//                    created_at}},
//    current: id of the leaf shown}
// What the page shows and sends is the path from the root to `current`.

export const DEFAULT_SETTINGS = {system: '', temperature: '', top_p: '', max_tokens: '', seed: '', tools: ''};

export function newDocument(model, settings = DEFAULT_SETTINGS) {
  return {version: 1, model, settings: {...DEFAULT_SETTINGS, ...settings}, messages: {}, current: null};
}

let counter = 0;
export function newId() {
  counter += 1;
  return `m${Date.now().toString(36)}${counter.toString(36)}${Math.random().toString(36).slice(2, 6)}`;
}

export function addMessage(doc, parent, fields) {
  const message = {id: newId(), parent, created_at: Date.now() / 1000, content: '', ...fields};
  doc.messages[message.id] = message;
  doc.current = message.id;
  return message;
}

/** Messages from the root to `current`. */
export function path(doc) {
  const out = [];
  let id = doc.current;
  const seen = new Set();
  while (id && doc.messages[id] && !seen.has(id)) {
    seen.add(id);
    out.push(doc.messages[id]);
    id = doc.messages[id].parent;
  }
  return out.reverse();
}

export function children(doc, parentId) {
  return Object.values(doc.messages)
    .filter((m) => (m.parent || null) === (parentId || null))
    .sort((a, b) => a.created_at - b.created_at || a.id.localeCompare(b.id));
}

/** The message's siblings (itself included) and its position among them. */
export function siblings(doc, message) {
  const all = children(doc, message.parent);
  return {all, index: all.findIndex((m) => m.id === message.id)};
}

/** Show the branch through `messageId`, down to its newest leaf. */
export function selectBranch(doc, messageId) {
  let id = messageId;
  for (;;) {
    const kids = children(doc, id);
    if (!kids.length) break;
    id = kids.reduce((a, b) => (b.created_at >= a.created_at ? b : a)).id;
  }
  doc.current = id;
}

/** The request's messages (OpenAI shape) for the path ending at `leaf` (system prompt first). */
export function requestMessages(doc, leafId = doc.current) {
  const saved = doc.current;
  doc.current = leafId;
  const messages = path(doc);
  doc.current = saved;
  const out = [];
  if (doc.settings.system?.trim()) out.push({role: 'system', content: doc.settings.system});
  for (const m of messages) {
    if (m.role === 'assistant') {
      if (!m.content && !m.tool_calls?.length) continue;
      const entry = {role: 'assistant', content: m.content || ''};
      if (m.tool_calls?.length) entry.tool_calls = m.tool_calls;
      out.push(entry);
    } else if (m.role === 'tool') {
      out.push({role: 'tool', content: m.content, tool_call_id: m.tool_call_id});
    } else {
      out.push({role: m.role, content: m.content});
    }
  }
  return out;
}

export function titleFrom(text) {
  const line = (text || '').replace(/\s+/g, ' ').trim();
  return line.length > 60 ? `${line.slice(0, 57)}…` : line || 'New chat';
}

/** The conversation as Markdown (the branch shown). */
export function toMarkdown(title, doc) {
  const parts = [`# ${title}`, ''];
  if (doc.settings.system?.trim()) parts.push('## System', '', doc.settings.system, '');
  for (const m of path(doc)) {
    const who = m.role === 'user' ? 'You' : m.role === 'tool' ? `Tool result (${m.tool_call_id})` : `Assistant (${m.stats?.model || doc.model})`;
    parts.push(`## ${who}`, '');
    if (m.reasoning) parts.push('<details><summary>Reasoning</summary>', '', m.reasoning, '', '</details>', '');
    if (m.content) parts.push(m.content, '');
    for (const call of m.tool_calls || []) {
      parts.push(`Tool call \`${call.function?.name}\`:`, '', '```json', call.function?.arguments || '', '```', '');
    }
  }
  return parts.join('\n');
}
