// Keys: create (the secret is shown once), edit limits and allow-lists, revoke.
import {$, h, copyText, formatNumber, formatTime} from '../lib/dom.js';
import {api, explain} from '../lib/api.js';

const LIMITS = [['rpm', 'Requests / minute'], ['tpm', 'Tokens / minute'], ['token_budget', 'Token budget']];

function numberOrNull(value) {
  const text = String(value ?? '').trim();
  if (!text) return null;
  const number = Number(text);
  if (!Number.isInteger(number) || number < 1) throw new Error('Limits must be whole numbers of at least 1 (or empty for unlimited).');
  return number;
}

export class KeysPanel {
  constructor(context, refreshKeys) {
    this.context = context;
    this.refreshKeys = refreshKeys;
    this.editing = null;
    $('#key-models').replaceChildren(...context.models.map((m) => h('label', {},
      h('input', {type: 'checkbox', value: m.id, name: 'key-model'}), m.id)));
    $('#key-form').addEventListener('submit', (event) => this.create(event));
    $('#show-revoked').addEventListener('change', () => this.render());
  }

  async create(event) {
    event.preventDefault();
    let body;
    try {
      const models = [...document.querySelectorAll('input[name="key-model"]:checked')].map((c) => c.value);
      body = {name: $('#key-name').value.trim(), role: $('#key-role').value, models: models.length ? models : null,
        rpm: numberOrNull($('#key-rpm').value), tpm: numberOrNull($('#key-tpm').value),
        token_budget: numberOrNull($('#key-budget').value)};
    } catch (exc) {
      this.context.notify(exc.message);
      return;
    }
    try {
      const created = await api('/admin/keys', {method: 'POST', body});
      const secret = $('#new-secret');
      secret.replaceChildren(h('span', {}, `Key “${created.name}” created. Copy it now: it is not shown again.`),
        h('code', {id: 'new-secret-value'}, created.key),
        h('button', {type: 'button', class: 'btn small', onclick: async () => {
          this.context.notify((await copyText(created.key)) ? 'Copied.' : 'Copying was refused.', 'info');
        }}, 'Copy'));
      secret.hidden = false;
      $('#key-form').reset();
      await this.refreshKeys();
    } catch (exc) {
      this.context.notify(explain(exc));
    }
  }

  render() {
    const showRevoked = $('#show-revoked').checked;
    const keys = this.context.keys.filter((k) => showRevoked || !k.revoked_at);
    const head = h('thead', {}, h('tr', {}, ['Name', 'Id', 'Prefix', 'Role', 'Models', 'RPM', 'TPM', 'Budget',
      'Used', 'Created', 'Status', ''].map((t) => h('th', {scope: 'col'}, t))));
    const rows = keys.map((key) => (this.editing === key.id ? this.editRow(key) : this.row(key)));
    $('#keys-table').replaceChildren(head, h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', {colspan: 12, class: 'muted'}, 'No keys yet.'))));
  }

  row(key) {
    const revoked = Boolean(key.revoked_at);
    return h('tr', {dataset: {keyId: key.id}},
      h('td', {}, key.name), h('td', {}, h('code', {}, key.id)), h('td', {}, h('code', {}, `${key.key_prefix}…`)),
      h('td', {}, key.role), h('td', {}, key.models ? key.models.join(', ') : 'all'),
      h('td', {}, formatNumber(key.rpm)), h('td', {}, formatNumber(key.tpm)), h('td', {}, formatNumber(key.token_budget)),
      h('td', {}, formatNumber(key.tokens_used)), h('td', {}, formatTime(key.created_at)),
      h('td', {}, h('span', {class: `badge ${revoked ? 'bad' : 'ok'}`}, revoked ? 'revoked' : 'active')),
      h('td', {}, revoked ? '' : h('span', {class: 'row-actions'},
        h('button', {type: 'button', class: 'btn small', 'aria-label': `Edit ${key.name}`, onclick: () => {
          this.editing = key.id;
          this.render();
          $(`#edit-name-${key.id}`)?.focus();
        }}, 'Edit'),
        h('button', {type: 'button', class: 'btn small danger', 'aria-label': `Revoke ${key.name}`,
          onclick: () => this.revoke(key)}, 'Revoke'))));
  }

  editRow(key) {
    const input = (field, value, label) => h('input', {id: `edit-${field}-${key.id}`, value: value ?? '',
      'aria-label': `${label} of ${key.name}`, size: 8});
    const models = h('fieldset', {class: 'checks'}, h('legend', {class: 'visually-hidden'}, `Models of ${key.name}`),
      ...this.context.models.map((m) => h('label', {}, h('input', {type: 'checkbox', value: m.id,
        name: `edit-models-${key.id}`, checked: Boolean(key.models?.includes(m.id))}), m.id)));
    const cells = LIMITS.map(([field, label]) => h('td', {}, input(field, key[field], label)));
    return h('tr', {dataset: {keyId: key.id}},
      h('td', {}, input('name', key.name, 'Name')), h('td', {}, h('code', {}, key.id)),
      h('td', {}, h('code', {}, `${key.key_prefix}…`)), h('td', {}, key.role), h('td', {}, models), ...cells,
      h('td', {}, formatNumber(key.tokens_used)), h('td', {}, formatTime(key.created_at)), h('td', {}, ''),
      h('td', {}, h('span', {class: 'row-actions'},
        h('button', {type: 'button', class: 'btn small primary', onclick: () => this.save(key)}, 'Save'),
        h('button', {type: 'button', class: 'btn small', onclick: () => {
          this.editing = null;
          this.render();
        }}, 'Cancel'))));
  }

  async save(key) {
    let changes;
    try {
      const models = [...document.querySelectorAll(`input[name="edit-models-${key.id}"]:checked`)].map((c) => c.value);
      changes = {name: $(`#edit-name-${key.id}`).value.trim(), models: models.length ? models : null};
      for (const [field] of LIMITS) changes[field] = numberOrNull($(`#edit-${field}-${key.id}`).value);
    } catch (exc) {
      this.context.notify(exc.message);
      return;
    }
    try {
      await api(`/admin/keys/${encodeURIComponent(key.id)}`, {method: 'PATCH', body: changes});
      this.editing = null;
      await this.refreshKeys();
      this.context.notify(`Saved ${changes.name}.`, 'info');
    } catch (exc) {
      this.context.notify(explain(exc));
    }
  }

  async revoke(key) {
    if (!confirm(`Revoke the key “${key.name}”? Clients using it stop working at once.`)) return;
    try {
      await api(`/admin/keys/${encodeURIComponent(key.id)}`, {method: 'DELETE'});
      await this.refreshKeys();
    } catch (exc) {
      this.context.notify(explain(exc));
    }
  }
}
