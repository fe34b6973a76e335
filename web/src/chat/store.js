// Where conversations live: the gateway's database, per API key (`/ui/conversations`), or this
// browser's localStorage when the page is served by a bare `kvik serve`. Both stores have the same
// async interface; documents are the page's own JSON (see tree.js).
import {api} from '../lib/api.js';

export class ServerStore {
  kind = 'server';

  async list(query = '') {
    const q = query ? `?q=${encodeURIComponent(query)}` : '';
    return (await api(`/ui/conversations${q}`)).data;
  }

  async get(id) {
    return api(`/ui/conversations/${encodeURIComponent(id)}`);
  }

  async create(title, data) {
    return api('/ui/conversations', {method: 'POST', body: {title, data}});
  }

  async update(id, changes) {
    return api(`/ui/conversations/${encodeURIComponent(id)}`, {method: 'PATCH', body: changes});
  }

  async remove(id) {
    await api(`/ui/conversations/${encodeURIComponent(id)}`, {method: 'DELETE'});
  }
}

const INDEX = 'kvik.conversations.v1';
const DOC = (id) => `kvik.conversation.v1.${id}`;

export class BrowserStore {
  kind = 'browser';

  index() {
    try {
      return JSON.parse(localStorage.getItem(INDEX) || '[]');
    } catch {
      return [];
    }
  }

  saveIndex(rows) {
    localStorage.setItem(INDEX, JSON.stringify(rows));
  }

  async list(query = '') {
    const needle = query.trim().toLowerCase();
    const rows = this.index().sort((a, b) => b.updated_at - a.updated_at);
    if (!needle) return rows;
    return rows.filter((row) => row.title.toLowerCase().includes(needle) ||
      (localStorage.getItem(DOC(row.id)) || '').toLowerCase().includes(needle));
  }

  async get(id) {
    const row = this.index().find((r) => r.id === id);
    const doc = localStorage.getItem(DOC(id));
    if (!row || !doc) throw new Error('This conversation is no longer in this browser.');
    return {...row, data: JSON.parse(doc)};
  }

  async create(title, data) {
    const now = Date.now() / 1000;
    const row = {id: `local_${crypto.randomUUID()}`, title, created_at: now, updated_at: now};
    this.write(row.id, data);
    this.saveIndex([...this.index(), row]);
    return row;
  }

  async update(id, {title, data}) {
    const rows = this.index();
    const row = rows.find((r) => r.id === id);
    if (!row) throw new Error('This conversation is no longer in this browser.');
    if (title !== undefined) row.title = title;
    if (data !== undefined) this.write(id, data);
    row.updated_at = Date.now() / 1000;
    this.saveIndex(rows);
    return row;
  }

  write(id, data) {
    try {
      localStorage.setItem(DOC(id), JSON.stringify(data));
    } catch {
      throw new Error('The browser storage is full: delete some conversations.');
    }
  }

  async remove(id) {
    localStorage.removeItem(DOC(id));
    this.saveIndex(this.index().filter((r) => r.id !== id));
  }
}
