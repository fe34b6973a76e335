// Replica state and live traffic, polled every 2 s while their tab is open.
import {$, h, formatNumber} from '../lib/dom.js';
import {api, explain} from '../lib/api.js';
import {Chart} from './charts.js';

const POLL_MS = 2000;
const MAX_POINTS = 150;

class Poller {
  constructor(context) {
    this.context = context;
    this.timer = null;
  }

  show() {
    this.tick();
    clearInterval(this.timer);
    this.timer = setInterval(() => this.tick(), POLL_MS);
  }

  hide() {
    clearInterval(this.timer);
    this.timer = null;
  }

  async tick() {
    try {
      await this.poll();
    } catch (exc) {
      this.context.notify(explain(exc));
      this.hide();
    }
  }
}

export class ReplicasPanel extends Poller {
  async poll() {
    const replicas = (await api('/admin/replicas')).data;
    const head = h('thead', {}, h('tr', {}, ['Model', 'Replica', 'Health', 'Breaker', 'In flight', 'Weight']
      .map((t) => h('th', {scope: 'col'}, t))));
    const rows = replicas.map((r) => h('tr', {},
      h('td', {}, r.model), h('td', {}, h('code', {}, r.url)),
      h('td', {}, h('span', {class: `badge ${r.healthy ? 'ok' : 'bad'}`}, r.healthy ? 'healthy' : 'down')),
      h('td', {}, h('span', {class: `badge ${{closed: 'ok', open: 'bad'}[r.breaker] || 'warn'}`}, r.breaker)),
      h('td', {}, formatNumber(r.outstanding)), h('td', {}, formatNumber(r.weight, 1))));
    $('#replicas-table').replaceChildren(head, h('tbody', {}, rows));
  }
}

export class LivePanel extends Poller {
  constructor(context) {
    super(context);
    this.rate = new Chart($('#rate-chart'), {yLabel: 'req/s'});
    this.latency = new Chart($('#latency-chart'), {yLabel: 'ms'});
    this.points = {t: [], rps: [], errors: [], p50: [], p90: [], p99: []};
  }

  async poll() {
    const live = await api('/admin/metrics/live');
    const recent = live.windows['10'];
    const minute = live.windows['60'];
    const p = this.points;
    p.t.push(Date.now() / 1000);
    p.rps.push(recent.requests_per_s ?? 0);
    p.errors.push(recent.seconds ? (recent.errors + recent.rejected) / recent.seconds : 0);
    p.p50.push(recent.latency_ms.p50);
    p.p90.push(recent.latency_ms.p90);
    p.p99.push(recent.latency_ms.p99);
    for (const series of Object.values(p)) if (series.length > MAX_POINTS) series.shift();
    this.rate.update(['requests/s', 'refused or failed/s'], [p.t, p.rps, p.errors]);
    this.latency.update(['p50', 'p90', 'p99'], [p.t, p.p50, p.p90, p.p99]);
    const tile = (label, value) => h('div', {class: 'tile'}, h('div', {class: 'label'}, label), h('div', {class: 'value'}, value));
    const ms = (value) => (value === null || value === undefined ? '–' : `${formatNumber(value, value < 10 ? 1 : 0)} ms`);
    $('#live-tiles').replaceChildren(
      tile('Requests/s (1 min)', formatNumber(minute.requests_per_s, 2)),
      tile('Server errors (1 min)', formatNumber(minute.errors)),
      tile('Refused 4xx (1 min)', formatNumber(minute.rejected)),
      tile('Latency p50 (1 min)', ms(minute.latency_ms.p50)),
      tile('Latency p99 (1 min)', ms(minute.latency_ms.p99)),
      tile('TTFT p50 (1 min)', ms(minute.ttft_ms.p50)),
      tile('TTFT p99 (1 min)', ms(minute.ttft_ms.p99)),
      tile('Requests since start', formatNumber(live.totals.requests)));
  }
}
