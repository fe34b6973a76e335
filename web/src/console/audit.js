// The audit log: every request (key, model, status, tokens, latency) and every admin action.
import {$, h, formatNumber, formatTime} from '../lib/dom.js';
import {api, explain} from '../lib/api.js';

export class AuditPanel {
  constructor(context) {
    this.context = context;
    $('#requests-filter').addEventListener('submit', (event) => {
      event.preventDefault();
      this.loadRequests();
    });
    $('#actions-filter').addEventListener('submit', (event) => {
      event.preventDefault();
      this.loadActions();
    });
  }

  show() {
    this.loadRequests();
    this.loadActions();
  }

  async loadRequests() {
    const params = new URLSearchParams({limit: '200'});
    for (const [id, name] of [['#audit-key', 'key_id'], ['#audit-model', 'model'], ['#audit-status', 'status']]) {
      if ($(id).value) params.set(name, $(id).value);
    }
    if ($('#audit-since').value) params.set('since', String(new Date($('#audit-since').value).getTime() / 1000));
    let rows;
    try {
      rows = (await api(`/admin/requests?${params}`)).data;
    } catch (exc) {
      this.context.notify(explain(exc));
      return;
    }
    const names = new Map(this.context.keys.map((k) => [k.id, k.name]));
    const head = h('thead', {}, h('tr', {}, ['Time', 'Key', 'Model', 'Endpoint', 'Status', 'Prompt', 'Completion',
      'Latency', 'Replica', 'Request id'].map((t) => h('th', {scope: 'col'}, t))));
    const body = rows.map((r) => h('tr', {dataset: {status: r.status}},
      h('td', {}, formatTime(r.created_at)), h('td', {}, r.key_id ? names.get(r.key_id) || r.key_id : 'anonymous'),
      h('td', {}, r.model), h('td', {}, `${r.endpoint}${r.stream ? ' (stream)' : ''}${r.cached ? ' (cache)' : ''}`),
      h('td', {}, h('span', {class: `badge ${r.status < 400 ? 'ok' : r.status < 500 ? 'warn' : 'bad'}`}, r.status)),
      h('td', {}, formatNumber(r.prompt_tokens)), h('td', {}, formatNumber(r.completion_tokens)),
      h('td', {}, `${formatNumber(r.latency_ms)} ms`), h('td', {}, r.replica || '–'), h('td', {}, h('code', {}, r.request_id))));
    $('#requests-table').replaceChildren(head, h('tbody', {}, body.length ? body
      : h('tr', {}, h('td', {colspan: 10, class: 'muted'}, 'No requests match.'))));
  }

  async loadActions() {
    const params = new URLSearchParams({limit: '200'});
    if ($('#action-kind').value) params.set('action', $('#action-kind').value);
    if ($('#action-target').value.trim()) params.set('target', $('#action-target').value.trim());
    let rows;
    try {
      rows = (await api(`/admin/audit?${params}`)).data;
    } catch (exc) {
      this.context.notify(explain(exc));
      return;
    }
    const head = h('thead', {}, h('tr', {}, ['Time', 'Action', 'Key', 'By', 'Details']
      .map((t) => h('th', {scope: 'col'}, t))));
    const body = rows.map((r) => h('tr', {},
      h('td', {}, formatTime(r.created_at)), h('td', {}, r.action), h('td', {}, h('code', {}, r.target)),
      h('td', {}, h('code', {}, r.actor_key_id)), h('td', {}, h('code', {}, JSON.stringify(r.detail)))));
    $('#actions-table').replaceChildren(head, h('tbody', {}, body.length ? body
      : h('tr', {}, h('td', {colspan: 5, class: 'muted'}, 'No admin actions match.'))));
  }
}
