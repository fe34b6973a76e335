// The chat page: sign-in, the conversation list, the message view, the composer, streaming.
import '../styles/chat.css';
import {$, h, pageConfig, download, copyText} from '../lib/dom.js';
import {api, auth, ApiError, explain} from '../lib/api.js';
import {applyTheme, cycleTheme, themeLabel} from '../lib/theme.js';
import {Transport} from '../lib/transport.js';
import {BrowserStore, ServerStore} from './store.js';
import {MessageView} from './view.js';
import {Sidebar} from './sidebar.js';
import {SettingsPanel, samplingFields, transportMode} from './settings.js';
import * as tree from './tree.js';

const config = pageConfig();
const MODEL_KEY = 'kvik.model';

// Each open or streaming document's conversation id (null until first saved) and title.
const docMeta = new WeakMap();

const state = {
  store: config.conversations === 'server' ? new ServerStore() : new BrowserStore(),
  transport: new Transport('/v1/chat/completions', transportMode()),
  models: [],
  convId: null,
  title: 'New chat',
  doc: null,
  active: new Map(), // assistant message id -> {cancel, doc, cancelled}
  saving: Promise.resolve(),
  paintWatch: new Map(), // message id -> (time) => void
};

const el = {
  app: $('#app'), signin: $('#signin'), signinForm: $('#signin-form'), keyInput: $('#api-key'),
  signinError: $('#signin-error'), messages: $('#messages'), composer: $('#composer'),
  input: $('#composer-input'), send: $('#send'), stop: $('#stop'), modelSelect: $('#model-select'),
  title: $('#chat-title'), notice: $('#notice'), announcer: $('#announcer'),
};

const view = new MessageView(el.messages, {
  regenerate: (id) => regenerate(id),
  edit: (id, text) => editAndBranch(id, text),
  switchSibling: (id, step) => switchSibling(id, step),
  submitToolResults: (id, results) => submitToolResults(id, results),
  copy: async (text) => notify((await copyText(text)) ? 'Copied.' : 'Copying was refused by the browser.', 'info'),
});
view.onPainted = (id, time) => state.paintWatch.get(id)?.(time);

const sidebar = new Sidebar($('#conversation-list'), $('#search'), {
  list: (query) => state.store.list(query),
  open: (id) => openConversation(id),
  rename: (id, title) => rename(id, title),
  remove: (id, title) => removeConversation(id, title),
  notify: (exc) => notify(explain(exc)),
});

const settings = new SettingsPanel($('#settings-panel'), $('#settings-button'), (field) => {
  if (field === 'transport') {
    state.transport.reset();
    state.transport = new Transport('/v1/chat/completions', transportMode());
  } else {
    save();
  }
});

// --- notices -------------------------------------------------------------------------------

let noticeTimer = null;
function notify(text, kind = 'error') {
  el.notice.textContent = text;
  el.notice.className = `notice ${kind}`;
  el.notice.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => {
    el.notice.hidden = true;
  }, kind === 'error' ? 10000 : 2500);
}

function announce(text) {
  el.announcer.textContent = text;
}

// --- sign-in and start ---------------------------------------------------------------------

async function boot() {
  $('#theme-toggle').textContent = themeLabel(applyTheme());
  wireControls();
  try {
    await start(await api('/v1/models'));
  } catch (exc) {
    if (exc instanceof ApiError && exc.status === 401) showSignIn();
    else notify(explain(exc));
  }
}

function showSignIn(message = '') {
  el.signin.hidden = false;
  el.app.inert = true;
  el.signinError.textContent = message;
  el.keyInput.focus();
}

el.signinForm.addEventListener('submit', async (event) => {
  event.preventDefault();
  const key = el.keyInput.value.trim();
  if (!key) return;
  try {
    const models = await api('/v1/models', {key});
    auth.key = key;
    el.keyInput.value = '';
    el.signin.hidden = true;
    el.app.inert = false;
    state.transport.reset();
    state.transport = new Transport('/v1/chat/completions', transportMode());
    await start(models);
  } catch (exc) {
    el.signinError.textContent = exc instanceof ApiError && exc.status === 401
      ? 'That key was not accepted. Check it and try again.' : explain(exc);
  }
});

async function start(models) {
  state.models = models.data.map((m) => m.id);
  el.modelSelect.replaceChildren(...state.models.map((id) => h('option', {value: id}, id)));
  $('#sign-out').hidden = !auth.key;
  if (config.console && auth.key) {
    api('/admin/models').then(() => {
      $('#console-link').hidden = false;
    }, () => {});
  }
  await sidebar.refresh();
  const fromHash = new URLSearchParams(location.hash.slice(1)).get('c');
  if (fromHash) await openConversation(fromHash);
  else newChat();
  document.body.dataset.ready = 'true';
}

function defaultModel() {
  const remembered = localStorage.getItem(MODEL_KEY);
  return state.models.includes(remembered) ? remembered : state.models[0] || '';
}

// --- conversations -------------------------------------------------------------------------

function newChat() {
  state.convId = null;
  state.title = 'New chat';
  // A new chat starts with the settings of the one open before (system prompt, sampling, tools).
  state.doc = tree.newDocument(defaultModel(), state.doc?.settings);
  docMeta.set(state.doc, {id: null, title: state.title});
  showDocument();
  history.replaceState(null, '', location.pathname + location.search);
  sidebar.setCurrent(null);
  el.input.focus();
}

async function openConversation(id) {
  try {
    const row = await state.store.get(id);
    // An answer still streaming into this conversation writes into its live document: show that one.
    const live = [...state.active.values()].find((entry) => docMeta.get(entry.doc)?.id === id)?.doc;
    state.convId = row.id;
    state.title = row.title;
    state.doc = live || row.data;
    docMeta.set(state.doc, {id: row.id, title: row.title});
  } catch (exc) {
    notify(explain(exc));
    newChat();
    return;
  }
  if (!state.models.includes(state.doc.model) && state.models.length) {
    notify(`The model ${state.doc.model} is not available to this key; using ${state.models[0]}.`, 'info');
    state.doc.model = state.models[0];
  }
  showDocument();
  history.replaceState(null, '', `${location.pathname}${location.search}#c=${encodeURIComponent(id)}`);
  sidebar.setCurrent(id);
  closeSidebarOnPhone();
}

function showDocument() {
  el.title.textContent = state.title;
  document.title = `${state.title} · kvik`;
  el.modelSelect.value = state.doc.model;
  settings.load(state.doc);
  view.show(state.doc, streamingIds(state.doc));
  updateComposer();
}

function streamingIds(doc) {
  return new Set([...state.active].filter(([, s]) => s.doc === doc).map(([id]) => id));
}

/** Save a document (creating its conversation on first save); saves run one at a time. */
function save(doc = state.doc) {
  const job = state.saving.then(async () => {
    const meta = docMeta.get(doc);
    try {
      if (!meta.id) {
        const created = await state.store.create(meta.title, doc);
        meta.id = created.id;
        if (doc === state.doc) {
          state.convId = created.id;
          history.replaceState(null, '', `${location.pathname}${location.search}#c=${encodeURIComponent(created.id)}`);
          sidebar.setCurrent(created.id);
        }
      } else {
        await state.store.update(meta.id, {data: doc});
      }
      await sidebar.refresh();
    } catch (exc) {
      notify(`Could not save the conversation: ${explain(exc)}`);
    }
  });
  state.saving = job;
  return job;
}

async function rename(id, title) {
  try {
    await state.store.update(id, {title});
    if (id === state.convId) {
      state.title = title;
      docMeta.get(state.doc).title = title;
      el.title.textContent = title;
    }
  } catch (exc) {
    notify(explain(exc));
  }
  await sidebar.refresh();
}

async function removeConversation(id, title) {
  if (!confirm(`Delete “${title}”? This cannot be undone.`)) return;
  try {
    await state.store.remove(id);
  } catch (exc) {
    notify(explain(exc));
  }
  if (id === state.convId) newChat();
  await sidebar.refresh();
}

function exportAs(kind) {
  const slug = state.title.replace(/[^\w-]+/g, '-').replace(/^-|-$/g, '').slice(0, 50) || 'conversation';
  if (kind === 'json') {
    download(`${slug}.json`, JSON.stringify({title: state.title, exported_at: new Date().toISOString(), ...state.doc}, null, 2),
      'application/json');
  } else {
    download(`${slug}.md`, tree.toMarkdown(state.title, state.doc), 'text/markdown');
  }
}

// --- sending and streaming -----------------------------------------------------------------

async function send(text) {
  if (!text.trim() || !state.doc.model) return;
  const doc = state.doc;
  const user = tree.addMessage(doc, doc.current, {role: 'user', content: text});
  if (state.title === 'New chat') {
    state.title = tree.titleFrom(text);
    docMeta.get(doc).title = state.title;
    el.title.textContent = state.title;
  }
  view.show(doc, streamingIds(doc));
  await save(doc);
  await generate(doc, user.id);
}

async function generate(doc, parentId) {
  let sampling;
  try {
    sampling = samplingFields(doc.settings);
  } catch (exc) {
    notify(exc.message);
    return;
  }
  const body = {model: doc.model, messages: tree.requestMessages(doc, parentId),
    stream_options: {include_usage: true}, ...sampling};
  const message = tree.addMessage(doc, parentId, {role: 'assistant', reasoning: '', tool_calls: [],
    stats: {model: doc.model}});
  const stats = message.stats;
  const entry = {cancel: null, doc, cancelled: false};
  state.active.set(message.id, entry);
  if (doc === state.doc) view.show(doc, streamingIds(doc));
  updateComposer();

  const sentAt = performance.now();
  let firstAt = null;
  let lastAt = null;
  let pieces = 0;
  state.paintWatch.set(message.id, (time) => {
    if (firstAt !== null && stats.paint_ms === undefined) {
      stats.paint_ms = Math.round(time - sentAt);
      state.paintWatch.delete(message.id);
    }
  });
  const handlers = {
    onStart: ({requestId}) => {
      stats.request_id = requestId;
    },
    onChunk: (chunk) => {
      const now = performance.now();
      if (chunk.usage) {
        stats.prompt_tokens = chunk.usage.prompt_tokens;
        stats.completion_tokens = chunk.usage.completion_tokens;
      }
      for (const choice of chunk.choices || []) {
        if ((choice.index || 0) !== 0) continue;
        const delta = choice.delta || {};
        let got = false;
        if (typeof delta.content === 'string' && delta.content) {
          message.content += delta.content;
          got = true;
        }
        const reasoning = delta.reasoning_content ?? delta.reasoning;
        if (typeof reasoning === 'string' && reasoning) {
          message.reasoning += reasoning;
          got = true;
        }
        if (Array.isArray(delta.tool_calls)) {
          mergeToolCalls(message, delta.tool_calls);
          got = true;
        }
        if (choice.finish_reason) stats.finish_reason = choice.finish_reason;
        if (got) {
          pieces += 1;
          lastAt = now;
          if (firstAt === null) {
            firstAt = now;
            stats.ttft_ms = Math.round(firstAt - sentAt);
          }
        }
      }
      if (doc === state.doc) view.update(message.id);
    },
    onError: (error) => {
      message.error = explain(error);
      if (doc === state.doc) {
        notify(message.error, error.status === 429 ? 'warning' : 'error');
        view.update(message.id);
      }
    },
    onDone: (status) => {
      stats.status = status;
      const tokens = stats.completion_tokens ?? pieces;
      if (firstAt !== null && lastAt > firstAt && tokens > 1) {
        stats.tokens_per_s = Math.round(((tokens - 1) / ((lastAt - firstAt) / 1000)) * 10) / 10;
      }
      state.active.delete(message.id);
      state.paintWatch.delete(message.id);
      if (doc === state.doc) {
        // A whole short answer can arrive within one animation frame: then the repaint below is
        // its first paint (the frame's flush would run after the watch is gone).
        if (firstAt !== null && stats.paint_ms === undefined) stats.paint_ms = Math.round(performance.now() - sentAt);
        view.setStreaming(message.id, false);
        announce(status === 'completed' ? 'Answer complete.' : status === 'cancelled' ? 'Answer stopped.' : 'Answer failed.');
      }
      updateComposer();
      save(doc);
    },
  };
  try {
    const stream = await state.transport.stream(body, handlers);
    stats.transport = state.transport.lastUsed;
    entry.cancel = stream.cancel;
    if (entry.cancelled) stream.cancel();
  } catch (exc) {
    handlers.onError(exc instanceof ApiError ? exc : new ApiError(0, {message: String(exc.message || exc)}));
    handlers.onDone('failed');
  }
}

function mergeToolCalls(message, deltas) {
  for (const part of deltas) {
    const index = part.index ?? message.tool_calls.length;
    const call = message.tool_calls[index] || (message.tool_calls[index] = {id: '', type: 'function', function: {name: '', arguments: ''}});
    if (part.id) call.id = part.id;
    if (part.type) call.type = part.type;
    if (part.function?.name) call.function.name += part.function.name;
    if (part.function?.arguments) call.function.arguments += part.function.arguments;
  }
}

function stop() {
  for (const [, entry] of state.active) {
    if (entry.doc !== state.doc) continue;
    entry.cancelled = true;
    entry.cancel?.();
  }
}

function regenerate(messageId) {
  const message = state.doc.messages[messageId];
  if (message) generate(state.doc, message.parent);
}

async function editAndBranch(messageId, text) {
  const doc = state.doc;
  const original = doc.messages[messageId];
  if (!original || !text.trim()) return view.show(doc, streamingIds(doc));
  const user = tree.addMessage(doc, original.parent, {role: 'user', content: text});
  view.show(doc, streamingIds(doc));
  await save(doc);
  await generate(doc, user.id);
}

function switchSibling(messageId, step) {
  const doc = state.doc;
  const {all, index} = tree.siblings(doc, doc.messages[messageId]);
  const target = all[index + step];
  if (!target) return;
  tree.selectBranch(doc, target.id);
  view.show(doc, streamingIds(doc));
  save(doc);
}

async function submitToolResults(assistantId, results) {
  const doc = state.doc;
  let parent = assistantId;
  for (const result of results) parent = tree.addMessage(doc, parent, {role: 'tool', ...result}).id;
  view.show(doc, streamingIds(doc));
  await save(doc);
  await generate(doc, parent);
}

function updateComposer() {
  const busy = streamingIds(state.doc).size > 0;
  el.stop.hidden = !busy;
  el.send.hidden = busy;
}

// --- controls and shortcuts ----------------------------------------------------------------

function closeSidebarOnPhone() {
  el.app.classList.remove('sidebar-open');
  $('#open-sidebar').setAttribute('aria-expanded', 'false');
}

function wireControls() {
  el.composer.addEventListener('submit', (event) => {
    event.preventDefault();
    const text = el.input.value;
    // Until start() has opened a conversation there is nothing to send into: keep the text.
    if (!state.doc || streamingIds(state.doc).size || !text.trim()) return;
    el.input.value = '';
    resizeInput();
    send(text);
  });
  el.input.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      el.composer.requestSubmit();
    }
  });
  el.input.addEventListener('input', resizeInput);
  el.stop.addEventListener('click', stop);
  el.modelSelect.addEventListener('change', () => {
    localStorage.setItem(MODEL_KEY, el.modelSelect.value);
    if (!state.doc) return; // still starting: newChat() picks the remembered model
    state.doc.model = el.modelSelect.value;
    if (state.convId) save();
  });
  $('#new-chat').addEventListener('click', newChat);
  $('#export-json').addEventListener('click', () => exportAs('json'));
  $('#export-md').addEventListener('click', () => exportAs('md'));
  $('#theme-toggle').addEventListener('click', (event) => {
    event.currentTarget.textContent = themeLabel(cycleTheme());
  });
  $('#sign-out').addEventListener('click', () => {
    auth.key = null;
    location.reload();
  });
  $('#open-sidebar').addEventListener('click', () => {
    el.app.classList.add('sidebar-open');
    $('#open-sidebar').setAttribute('aria-expanded', 'true');
    $('#search').focus();
  });
  $('#close-sidebar').addEventListener('click', closeSidebarOnPhone);
  $('#shortcuts-button').addEventListener('click', () => $('#shortcuts-dialog').showModal());
  $('#shortcuts-close').addEventListener('click', () => $('#shortcuts-dialog').close());
  el.messages.addEventListener('click', async (event) => {
    const button = event.target.closest('.copy-code');
    if (!button) return;
    const code = button.closest('.code-block')?.querySelector('code')?.textContent || '';
    button.textContent = (await copyText(code)) ? 'Copied' : 'Copy failed';
    setTimeout(() => {
      button.textContent = 'Copy';
    }, 1500);
  });
  document.addEventListener('keydown', onShortcut);
}

function onShortcut(event) {
  const mod = event.ctrlKey || event.metaKey;
  const key = event.key.toLowerCase();
  if (event.key === 'Escape' && streamingIds(state.doc).size) {
    event.preventDefault();
    stop();
  } else if (mod && event.shiftKey && key === 'o') {
    event.preventDefault();
    newChat();
  } else if (mod && !event.shiftKey && key === 'k') {
    event.preventDefault();
    el.app.classList.add('sidebar-open');
    $('#search').focus();
  } else if (mod && key === '/') {
    event.preventDefault();
    $('#shortcuts-dialog').showModal();
  } else if (mod && event.shiftKey && key === 'backspace' && state.convId) {
    event.preventDefault();
    removeConversation(state.convId, state.title);
  } else if (mod && event.shiftKey && key === ';') {
    event.preventDefault();
    const blocks = el.messages.querySelectorAll('.code-block code');
    if (blocks.length) copyText(blocks[blocks.length - 1].textContent).then(() => notify('Last code block copied.', 'info'));
  } else if (event.shiftKey && key === 'escape') {
    el.input.focus();
  }
}

function resizeInput() {
  el.input.style.height = 'auto';
  el.input.style.height = `${Math.min(el.input.scrollHeight, 240)}px`;
}

boot();
