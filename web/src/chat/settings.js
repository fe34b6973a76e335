// Per-chat settings (system prompt, sampling, tools) bound to the open document, and the page-wide
// transport choice.
import {$} from '../lib/dom.js';

const FIELDS = ['system', 'temperature', 'top_p', 'max_tokens', 'seed', 'tools'];
const TRANSPORT_KEY = 'kvik.transport';

export class SettingsPanel {
  constructor(panel, toggle, onChange) {
    this.panel = panel;
    this.toggle = toggle;
    this.onChange = onChange;
    this.doc = null;
    toggle.addEventListener('click', () => this.setOpen(panel.hidden));
    for (const field of FIELDS) {
      $(`#setting-${field}`, panel).addEventListener('change', (event) => {
        if (!this.doc) return;
        this.doc.settings[field] = event.target.value;
        this.onChange(field);
      });
    }
    const transport = $('#setting-transport', panel);
    transport.value = transportMode();
    transport.addEventListener('change', () => {
      localStorage.setItem(TRANSPORT_KEY, transport.value);
      this.onChange('transport');
    });
  }

  setOpen(open) {
    this.panel.hidden = !open;
    this.toggle.setAttribute('aria-expanded', String(open));
    if (open) $('#setting-system', this.panel).focus();
  }

  load(doc) {
    this.doc = doc;
    for (const field of FIELDS) $(`#setting-${field}`, this.panel).value = doc.settings[field] ?? '';
  }
}

/** 'auto' unless the URL (?transport=sse) or the settings chose otherwise. */
export function transportMode() {
  const fromUrl = new URLSearchParams(location.search).get('transport');
  const mode = fromUrl || localStorage.getItem(TRANSPORT_KEY) || 'auto';
  return ['auto', 'websocket', 'sse'].includes(mode) ? mode : 'auto';
}

/** The sampling fields of a request from the settings; throws Error with a message to show. */
export function samplingFields(settings) {
  const out = {};
  const number = (name, min, max) => {
    const raw = String(settings[name] ?? '').trim();
    if (raw === '') return;
    const value = Number(raw);
    if (!Number.isFinite(value) || value < min || value > max) {
      throw new Error(`Settings: ${name.replace('_', ' ')} must be a number from ${min} to ${max}.`);
    }
    out[name] = value;
  };
  number('temperature', 0, 2);
  number('top_p', 0, 1);
  number('max_tokens', 1, 1e6);
  number('seed', -(2 ** 53), 2 ** 53);
  if (out.max_tokens !== undefined) out.max_tokens = Math.round(out.max_tokens);
  if (out.seed !== undefined) out.seed = Math.round(out.seed);
  const tools = String(settings.tools || '').trim();
  if (tools) {
    let parsed;
    try {
      parsed = JSON.parse(tools);
    } catch {
      throw new Error('Settings: tools must be a JSON array of tool definitions.');
    }
    if (!Array.isArray(parsed)) throw new Error('Settings: tools must be a JSON array of tool definitions.');
    out.tools = parsed;
  }
  return out;
}
