// Live time-series charts over uPlot, following the theme and the container's width.

import uPlot from "../vendor/uplot/uPlot.esm.js";

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

export class LiveChart {
  /** series: [{label, color: "--chart-1", dash?}]; format(value) labels the y axis. */
  constructor(container, { series, format = (v) => String(v), height = 210, maxPoints = 150, yMin = 0, integer = false }) {
    this.integer = integer;
    this.windowS = 60;
    this.container = container;
    this.series = series;
    this.format = format;
    this.height = height;
    this.maxPoints = maxPoints;
    this.yMin = yMin;
    this.data = [[], ...series.map(() => [])];
    this.plot = null;
    this.build();
    this.resizer = new ResizeObserver(() => this.resize());
    this.resizer.observe(container);
    this.onTheme = () => this.build();
    window.addEventListener("omlx:theme", this.onTheme);
  }

  options() {
    const muted = cssVar("--muted");
    const grid = cssVar("--border");
    const fmt = this.format;
    return {
      width: Math.max(200, this.container.clientWidth),
      height: this.height,
      cursor: { points: { size: 6 } },
      legend: { live: true },
      scales: {
        x: { time: true },
        y: { range: (u, min, max) => [Math.min(this.yMin, min ?? 0), Math.max((max ?? 0) * 1.1, 1)] },
      },
      axes: [
        {
          stroke: muted,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid },
          space: 70,
          values: (u, vals) => vals.map((v) => new Date(v * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" })),
        },
        {
          stroke: muted,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid },
          size: 64,
          incrs: this.integer ? [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] : undefined,
          values: (u, vals) => vals.map(fmt),
        },
      ],
      series: [
        {},
        ...this.series.map((s) => ({
          label: s.label,
          stroke: cssVar(s.color),
          width: s.dash ? 1.5 : 2,
          dash: s.dash,
          fill: s.fill ? cssVar(s.color) + "22" : undefined,
          value: (u, v) => (v === null || v === undefined ? "–" : fmt(v)),
          spanGaps: true,
        })),
      ],
    };
  }

  build() {
    if (this.plot) this.plot.destroy();
    this.plot = new uPlot(this.options(), this.data, this.container);
    // Tests and debugging read the live data from the element.
    this.container.uplot = this.plot;
    this.fitX();
  }

  /** uPlot does not range a single sample's time axis; a window of a minute or more does. */
  fitX() {
    const times = this.data[0];
    if (!times.length) return;
    const last = times[times.length - 1];
    this.plot.setScale("x", { min: Math.min(times[0], last - this.windowS), max: last });
  }

  resize() {
    const width = Math.max(200, this.container.clientWidth);
    if (this.plot && Math.abs(this.plot.width - width) > 1) this.plot.setSize({ width, height: this.height });
  }

  /** Append one sample: time in seconds, one value (or null) per series. */
  push(time, values) {
    this.data[0].push(time);
    values.forEach((v, i) => this.data[i + 1].push(v ?? null));
    if (this.data[0].length > this.maxPoints) for (const column of this.data) column.shift();
    this.plot.setData(this.data);
    this.fitX();
    this.container.dataset.points = String(this.data[0].length);
  }

  destroy() {
    this.resizer.disconnect();
    window.removeEventListener("omlx:theme", this.onTheme);
    this.plot?.destroy();
  }
}
