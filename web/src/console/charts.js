// Time-series charts with uPlot, sized to their container and coloured from the page's theme.
import uPlot from 'uplot';

const PALETTE = ['#2f5bd3', '#d4572a', '#1f8a4c', '#8e44ad', '#b7950b', '#16a2b8', '#c0392b', '#5d6d7e'];

function themeColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || '#888';
}

export class Chart {
  /** series: [{label, bars?}]; x values are unix seconds. */
  constructor(container, {yLabel = '', bars = false} = {}) {
    this.container = container;
    this.yLabel = yLabel;
    this.bars = bars;
    this.plot = null;
    this.labels = null;
    new ResizeObserver(() => this.plot?.setSize(this.size())).observe(container);
  }

  size() {
    return {width: Math.max(280, this.container.clientWidth), height: 240};
  }

  /** data: [xs, ys1, ys2, ...] with labels for ys. Rebuilds when the series change. */
  update(labels, data) {
    const key = labels.join('\u0000');
    if (this.plot && this.labels === key) {
      this.plot.setData(data);
      return;
    }
    this.plot?.destroy();
    this.labels = key;
    const text = themeColor('--text');
    const grid = themeColor('--border');
    const axis = {stroke: text, grid: {stroke: grid, width: 1}, ticks: {stroke: grid}};
    this.plot = new uPlot({
      ...this.size(),
      series: [{}, ...labels.map((label, i) => ({
        label, stroke: PALETTE[i % PALETTE.length], width: 2,
        fill: this.bars ? `${PALETTE[i % PALETTE.length]}99` : undefined,
        paths: this.bars ? uPlot.paths.bars({size: [0.6, 48]}) : undefined,
        points: {show: data[0].length < 60},
      }))],
      axes: [axis, {...axis, label: this.yLabel, labelSize: 18, size: 60}],
      scales: {x: {time: true}},
      legend: {live: true},
    }, data, this.container);
  }
}
