// The list of conversations: open, search, rename in place, delete.
import {h, debounce} from '../lib/dom.js';

export class Sidebar {
  /** actions: {open(id), rename(id, title), remove(id)}; list(query) -> rows */
  constructor(listElement, searchInput, actions) {
    this.list = listElement;
    this.search = searchInput;
    this.actions = actions;
    this.rows = [];
    this.currentId = null;
    this.search.addEventListener('input', debounce(() => this.refresh(), 200));
  }

  async refresh() {
    try {
      this.rows = await this.actions.list(this.search.value.trim());
    } catch (exc) {
      this.actions.notify(exc);
      return;
    }
    this.render();
  }

  setCurrent(id) {
    this.currentId = id;
    this.render();
  }

  render() {
    if (!this.rows.length) {
      this.list.replaceChildren(h('li', {class: 'conversation-empty'},
        this.search.value ? 'No conversation matches.' : 'No conversations yet.'));
      return;
    }
    this.list.replaceChildren(...this.rows.map((row) => this.item(row)));
  }

  item(row) {
    const current = row.id === this.currentId;
    const open = h('button', {type: 'button', class: 'conversation-open', 'aria-current': current ? 'page' : false,
      title: row.title, onclick: () => this.actions.open(row.id)}, row.title);
    const rename = h('button', {type: 'button', class: 'btn icon', 'aria-label': `Rename “${row.title}”`,
      title: 'Rename', onclick: () => this.startRename(li, row)}, '✎');
    const remove = h('button', {type: 'button', class: 'btn icon', 'aria-label': `Delete “${row.title}”`,
      title: 'Delete', onclick: () => this.actions.remove(row.id, row.title)}, '✕');
    const li = h('li', {class: `conversation${current ? ' current' : ''}`, dataset: {id: row.id}},
      open, h('span', {class: 'conversation-tools'}, rename, remove));
    return li;
  }

  startRename(li, row) {
    const id = `rename-${row.id}`;
    const input = h('input', {id, type: 'text', value: row.title, maxlength: 200, class: 'rename-input'});
    let finished = false;
    const finish = async (save) => {
      if (finished) return;
      finished = true;
      if (save && input.value.trim() && input.value.trim() !== row.title) {
        await this.actions.rename(row.id, input.value.trim());
      } else {
        this.render();
      }
    };
    input.addEventListener('keydown', (event) => {
      if (event.key === 'Enter') finish(true);
      if (event.key === 'Escape') finish(false);
    });
    input.addEventListener('blur', () => finish(true), {once: true});
    li.replaceChildren(h('label', {for: id, class: 'visually-hidden'}, 'New title'), input);
    input.focus();
    input.select();
  }
}
