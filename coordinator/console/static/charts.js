// The Charts page: one uPlot chart per tag, each run overlaid as a min-to-max band and its last
// line, from the bounded series reads of /api/v1/jobs/{run_id}/series.
//
// - Zoom: dragging across a chart reads that step range again (from/to), so the buckets get
//   finer; "Reset zoom" reads the whole series again. The server bounds every read.
// - Smoothing (EMA over the last line, debiased as TensorBoard does) and log scale are drawn
//   here, from the buckets already read; CSV links follow the zoom.
// - Live: the page follows /api/v1/jobs/{run_id}/metrics/events (a "metrics" event when any
//   run's points grow, at most one a second, the server's bound) and reads a chart again when
//   one of its runs' tag grew, unless it is zoomed (a zoom is a range the reader chose); one
//   read at a time per chart. A tag that first appears in an event gets its checkbox in the
//   Tags fieldset (tick it and press Draw), one per tag the server listed.
// - Test hook, deliberate and documented (docs/console.md): window.tuneplaneCharts maps a
//   figure's id to {plot: the uPlot instance, buckets: {run: buckets the server returned},
//   columns: {run: index of its last line in plot.data}}; a figure's data-state is "drawn"
//   once drawn (or "failed"), and data-render-ms is how long the reads and the drawing took.
//   Once drawn, data-points is how many stored points the drawn buckets summarize (their
//   counts, every run), data-buckets how many values uPlot holds in the runs' last lines, and
//   data-drawn-at the performance.now() of the frame after uPlot drew (ms since navigation
//   start: the end-to-end figure the bench reads).
"use strict";

window.tuneplaneCharts = {};

const COLORS = ["#0b4f9c", "#c25400", "#1b7a3a", "#8a1c7c", "#6b5b00", "#a01818", "#2f6f7f", "#444"];

function seriesUrl(run, tag, range, format) {
  const q = new URLSearchParams({ tag: tag, buckets: String(range.buckets) });
  if (range.from !== null) q.set("from", String(range.from));
  if (range.to !== null) q.set("to", String(range.to));
  if (format) q.set("format", format);
  return "/api/v1/jobs/" + encodeURIComponent(run) + "/series?" + q.toString();
}

function smooth(values, weight) {
  if (weight <= 0) return values;
  let acc = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null || v === undefined) return v;
    acc = weight * acc + (1 - weight) * v;
    n += 1;
    return acc / (1 - Math.pow(weight, n));
  });
}

function positive(values, log) {
  return log ? values.map((v) => (v === null || v === undefined || v <= 0 ? null : v)) : values;
}

async function readRuns(figure, range) {
  const tag = figure.dataset.tag;
  const runs = figure.dataset.runs.split(" ").filter((r) => r);
  const answers = await Promise.all(
    runs.map(async (run) => {
      const reply = await fetch(seriesUrl(run, tag, range, ""), { credentials: "same-origin" });
      if (!reply.ok) throw new Error((await reply.json()).error || reply.statusText);
      return [run, await reply.json()];
    })
  );
  return answers;
}

function draw(figure, answers, view) {
  const old = window.tuneplaneCharts[figure.id];
  if (old) old.plot.destroy();
  const tables = [];
  const series = [{ label: "step" }];
  const bands = [];
  const columns = {};
  const buckets = {};
  answers.forEach(([run, s], i) => {
    const color = COLORS[i % COLORS.length];
    tables.push([
      s.last_step,
      positive(s.min, view.log),
      positive(s.max, view.log),
      positive(smooth(s.last, view.smoothing), view.log),
    ]);
    const base = series.length;
    series.push({ label: run + " min", stroke: color + "55", width: 1, spanGaps: true, points: { show: false } });
    series.push({ label: run + " max", stroke: color + "55", width: 1, spanGaps: true, points: { show: false } });
    series.push({ label: run, stroke: color, width: 2, spanGaps: true, points: { show: false } });
    bands.push({ series: [base + 1, base], fill: color + "22" });
    columns[run] = base + 2;
    buckets[run] = s.buckets;
  });
  const data = uPlot.join(tables);
  const holder = figure.querySelector(".plot");
  const plot = new uPlot(
    {
      width: Math.max(320, Math.min(1100, holder.clientWidth || 900)),
      height: 320,
      scales: { x: { time: false }, y: { distr: view.log ? 3 : 1 } },
      series: series,
      bands: bands,
      cursor: { drag: { x: true, y: false, setScale: false } },
      hooks: {
        setSelect: [
          (u) => {
            if (u.select.width < 2) return;
            const from = Math.floor(u.posToVal(u.select.left, "x"));
            const to = Math.ceil(u.posToVal(u.select.left + u.select.width, "x"));
            u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
            view.zoom(from, to);
          },
        ],
      },
    },
    data,
    holder
  );
  window.tuneplaneCharts[figure.id] = { plot: plot, buckets: buckets, columns: columns };
}

function chartFigure(figure, view) {
  let answers = null;
  const range = { from: null, to: null, buckets: 1000 };

  function links() {
    figure.querySelectorAll("a.csv").forEach((a) => {
      a.href = seriesUrl(a.dataset.run, figure.dataset.tag, range, "csv");
    });
  }

  let loading = false;
  let again = false;

  async function load() {
    if (loading) {
      again = true;
      return;
    }
    loading = true;
    const started = performance.now();
    figure.dataset.state = "loading";
    try {
      answers = await readRuns(figure, range);
      draw(figure, answers, view);
      await new Promise((done) => requestAnimationFrame(() => done()));
      const drawnAt = performance.now();
      const chart = window.tuneplaneCharts[figure.id];
      let held = 0;
      Object.values(chart.columns).forEach((column) => {
        held += chart.plot.data[column].filter((v) => v !== null && v !== undefined).length;
      });
      figure.dataset.points = String(
        answers.reduce((n, [, s]) => n + s.count.reduce((a, b) => a + b, 0), 0)
      );
      figure.dataset.buckets = String(held);
      figure.dataset.drawnAt = String(Math.round(drawnAt));
      figure.dataset.renderMs = String(Math.round(drawnAt - started));
      figure.dataset.state = "drawn";
    } catch (err) {
      figure.dataset.state = "failed";
      const said = document.createElement("p");
      said.className = "refusal";
      said.setAttribute("role", "alert");
      said.textContent = "This chart could not be read: " + err.message;
      figure.appendChild(said);
    }
    links();
    loading = false;
    if (again) {
      again = false;
      load();
    }
  }

  return {
    load: load,
    grew: () => {
      if (range.from === null && range.to === null) load();
    },
    redraw: () => {
      if (answers) draw(figure, answers, view);
    },
    zoom: (from, to) => {
      range.from = from;
      range.to = to;
      load();
    },
    reset: () => {
      range.from = null;
      range.to = null;
      load();
    },
  };
}

function offerTags(runs) {
  const boxes = document.getElementById("tag-boxes");
  const offered = new Set(Array.from(boxes.querySelectorAll("input[name=tag]"), (box) => box.value));
  const listed = new Set();
  Object.values(runs).forEach((tags) => Object.keys(tags).forEach((tag) => listed.add(tag)));
  Array.from(listed)
    .filter((tag) => !offered.has(tag))
    .sort()
    .forEach((tag) => {
      const none = document.getElementById("no-tags");
      if (none) none.remove();
      const box = document.createElement("input");
      box.type = "checkbox";
      box.name = "tag";
      box.value = tag;
      const label = document.createElement("label");
      label.append(box, " " + tag);
      boxes.append(label);
    });
}

function followMetrics(holder, charts) {
  const runs = holder.dataset.runs.split(" ").filter((r) => r);
  const q = new URLSearchParams();
  runs.slice(1).forEach((run) => q.append("run", run));
  const tail = runs.length > 1 ? "?" + q.toString() : "";
  const events = new EventSource("/api/v1/jobs/" + encodeURIComponent(runs[0]) + "/metrics/events" + tail);
  let seen = null;
  events.addEventListener("metrics", (message) => {
    const now = JSON.parse(message.data).runs;
    offerTags(now);
    if (seen !== null) {
      charts.forEach(([, chart, figure]) => {
        const tag = figure.dataset.tag;
        const grew = figure.dataset.runs
          .split(" ")
          .filter((r) => r)
          .some((run) => JSON.stringify((now[run] || {})[tag]) !== JSON.stringify((seen[run] || {})[tag]));
        if (grew) chart.grew();
      });
    }
    seen = now;
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("charts-live");
  if (!live) return;
  const figures = Array.from(document.querySelectorAll("figure.chart"));
  const smoothing = document.getElementById("smoothing");
  const shown = document.getElementById("smoothing-value");
  const log = document.getElementById("log-scale");
  const charts = [];
  figures.forEach((figure) => {
    const view = { smoothing: 0, log: false, zoom: null };
    const chart = chartFigure(figure, view);
    view.zoom = chart.zoom;
    charts.push([view, chart, figure]);
  });
  smoothing.addEventListener("input", () => {
    shown.textContent = smoothing.value;
    charts.forEach(([view, chart]) => {
      view.smoothing = Number(smoothing.value);
      chart.redraw();
    });
  });
  log.addEventListener("change", () => {
    charts.forEach(([view, chart]) => {
      view.log = log.checked;
      chart.redraw();
    });
  });
  document.getElementById("reset-zoom").addEventListener("click", () => {
    charts.forEach(([, chart]) => chart.reset());
  });
  charts.forEach(([, chart]) => chart.load());
  followMetrics(live, charts);
});
