// Light, dark or the system's choice; remembered per browser. The stylesheet follows the system
// preference by itself, so a page that never runs this script still has the right colours.
const KEY = 'kvik.theme';
const ORDER = ['system', 'light', 'dark'];

export function applyTheme(theme = localStorage.getItem(KEY) || 'system') {
  if (theme === 'system') delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  return theme;
}

export function cycleTheme() {
  const current = localStorage.getItem(KEY) || 'system';
  const next = ORDER[(ORDER.indexOf(current) + 1) % ORDER.length];
  localStorage.setItem(KEY, next);
  return applyTheme(next);
}

export function themeLabel(theme) {
  return {system: 'Theme: system', light: 'Theme: light', dark: 'Theme: dark'}[theme];
}
