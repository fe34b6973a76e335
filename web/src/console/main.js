// The admin console: sign in with an admin key, then keys, usage and cost, replicas, live traffic
// and the audit log, all from the gateway's admin API.
import '../styles/console.css';
import {$, $$} from '../lib/dom.js';
import {api, auth, ApiError, explain} from '../lib/api.js';
import {applyTheme, cycleTheme, themeLabel} from '../lib/theme.js';
import {KeysPanel} from './keys.js';
import {UsagePanel} from './usage.js';
import {ReplicasPanel, LivePanel} from './live.js';
import {AuditPanel} from './audit.js';

let noticeTimer = null;
export function notify(text, kind = 'error') {
  const el = $('#notice');
  el.textContent = text;
  el.className = `notice ${kind}`;
  el.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => {
    el.hidden = true;
  }, kind === 'error' ? 10000 : 3000);
}

const context = {models: [], keys: [], notify};
const panels = {};

async function boot() {
  $('#theme-toggle').textContent = themeLabel(applyTheme());
  $('#theme-toggle').addEventListener('click', (event) => {
    event.currentTarget.textContent = themeLabel(cycleTheme());
  });
  $('#sign-out').addEventListener('click', () => {
    auth.key = null;
    location.reload();
  });
  $('#signin-form').addEventListener('submit', signIn);
  wireTabs();
  if (!auth.key) return showSignIn();
  try {
    await start();
  } catch (exc) {
    showSignIn(exc instanceof ApiError && (exc.status === 401 || exc.status === 403)
      ? 'This key is not an admin key of this gateway.' : explain(exc));
  }
}

function showSignIn(message = '') {
  $('#signin').hidden = false;
  $('#app').inert = true;
  $('#signin-error').textContent = message;
  $('#api-key').focus();
}

async function signIn(event) {
  event.preventDefault();
  const key = $('#api-key').value.trim();
  try {
    await api('/admin/models', {key});
  } catch (exc) {
    $('#signin-error').textContent = exc instanceof ApiError && (exc.status === 401 || exc.status === 403)
      ? 'That key is not an admin key of this gateway.' : explain(exc);
    return;
  }
  auth.key = key;
  $('#api-key').value = '';
  $('#signin').hidden = true;
  $('#app').inert = false;
  await start();
}

async function start() {
  context.models = (await api('/admin/models')).data;
  await refreshKeys();
  panels.keys = new KeysPanel(context, refreshKeys);
  panels.usage = new UsagePanel(context);
  panels.replicas = new ReplicasPanel(context);
  panels.live = new LivePanel(context);
  panels.audit = new AuditPanel(context);
  panels.keys.render();
  selectTab(location.hash.slice(1) || 'keys');
}

export async function refreshKeys() {
  context.keys = (await api('/admin/keys?include_revoked=true')).data;
  for (const id of ['#usage-key', '#audit-key']) {
    const select = $(id);
    const value = select.value;
    select.replaceChildren(select.options[0], ...context.keys.map((k) => new Option(`${k.name} (${k.id})`, k.id)));
    select.value = value;
  }
  for (const id of ['#usage-model', '#audit-model']) {
    const select = $(id);
    if (select.options.length === 1) select.append(...context.models.map((m) => new Option(m.id, m.id)));
  }
  panels.keys?.render();
}

function wireTabs() {
  const tabs = $$('[role="tab"]');
  for (const tab of tabs) {
    tab.addEventListener('click', () => selectTab(tab.id.slice(4)));
    tab.addEventListener('keydown', (event) => {
      const index = tabs.indexOf(tab);
      const step = {ArrowRight: 1, ArrowLeft: -1}[event.key];
      if (!step) return;
      const next = tabs[(index + step + tabs.length) % tabs.length];
      next.focus();
      selectTab(next.id.slice(4));
    });
  }
}

function selectTab(name) {
  if (!$(`#tab-${name}`)) name = 'keys';
  for (const tab of $$('[role="tab"]')) {
    const selected = tab.id === `tab-${name}`;
    tab.setAttribute('aria-selected', String(selected));
    tab.tabIndex = selected ? 0 : -1;
    $(`#${tab.getAttribute('aria-controls')}`).hidden = !selected;
  }
  history.replaceState(null, '', `#${name}`);
  for (const [key, panel] of Object.entries(panels)) {
    if (key === name) panel.show?.();
    else panel.hide?.();
  }
}

boot();
