// Usage and cost per day, key and model.
import {$, h, formatNumber} from '../lib/dom.js';
import {api, explain} from '../lib/api.js';
import {Chart} from './charts.js';

const DAY = 86400;

export class UsagePanel {
  constructor(context) {
    this.context = context;
    this.tokens = new Chart($('#usage-chart'), {yLabel: 'tokens'});
    this.cost = new Chart($('#cost-chart'), {yLabel: 'USD', bars: true});
    for (const id of ['#usage-days', '#usage-key', '#usage-model']) $(id).addEventListener('change', () => this.load());
  }

  show() {
    this.load();
  }

  async load() {
    const days = Number($('#usage-days').value);
    const since = Math.floor(Date.now() / 1000 / DAY) * DAY - (days - 1) * DAY;
    const params = new URLSearchParams({since: String(since)});
    if ($('#usage-key').value) params.set('key_id', $('#usage-key').value);
    if ($('#usage-model').value) params.set('model', $('#usage-model').value);
    let rows;
    try {
      rows = (await api(`/admin/usage/daily?${params}`)).data;
    } catch (exc) {
      this.context.notify(explain(exc));
      return;
    }
    const dayStarts = Array.from({length: days}, (_, i) => since + i * DAY);
    const index = new Map(dayStarts.map((t, i) => [new Date(t * 1000).toISOString().slice(0, 10), i]));
    const models = [...new Set(rows.map((r) => r.model))].sort();
    const tokens = models.map(() => dayStarts.map(() => 0));
    const cost = dayStarts.map(() => 0);
    for (const row of rows) {
      const i = index.get(row.day);
      if (i === undefined) continue;
      tokens[models.indexOf(row.model)][i] += row.total_tokens;
      cost[i] += row.cost_usd;
    }
    this.tokens.update(models.length ? models : ['tokens'], [dayStarts, ...(models.length ? tokens : [dayStarts.map(() => 0)])]);
    this.cost.update(['cost (USD)'], [dayStarts, cost]);
    this.table(rows);
  }

  table(rows) {
    const totals = new Map();
    for (const row of rows) {
      const key = `${row.key_id}\u0000${row.model}`;
      const t = totals.get(key) || {key_id: row.key_id, model: row.model, requests: 0, errors: 0, prompt_tokens: 0,
        completion_tokens: 0, cost_usd: 0};
      for (const field of ['requests', 'errors', 'prompt_tokens', 'completion_tokens', 'cost_usd']) t[field] += row[field];
      totals.set(key, t);
    }
    const names = new Map(this.context.keys.map((k) => [k.id, k.name]));
    const head = h('thead', {}, h('tr', {}, ['Key', 'Model', 'Requests', 'Errors', 'Prompt tokens',
      'Completion tokens', 'Cost (USD)'].map((t) => h('th', {scope: 'col'}, t))));
    const body = [...totals.values()].map((t) => h('tr', {},
      h('td', {}, t.key_id ? `${names.get(t.key_id) || ''} (${t.key_id})` : 'anonymous'), h('td', {}, t.model),
      h('td', {}, formatNumber(t.requests)), h('td', {}, formatNumber(t.errors)),
      h('td', {}, formatNumber(t.prompt_tokens)), h('td', {}, formatNumber(t.completion_tokens)),
      h('td', {}, formatNumber(t.cost_usd, 4))));
    $('#usage-table').replaceChildren(head, h('tbody', {}, body.length ? body
      : h('tr', {}, h('td', {colspan: 7, class: 'muted'}, 'No requests in this period.'))));
  }
}
