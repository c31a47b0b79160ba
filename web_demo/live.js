/* Live view: the server's `stats` frames (subscribe_stats, protocol.md) drawn as a compact panel.
 *
 * view() turns one frame (plus the batches remembered from earlier frames) into what is shown and is
 * pure; render() writes that into the panel's elements and touches nothing else. The page calls
 * both for every stats frame; the browser test also calls them with frames of its own.
 */
'use strict';

(function () {
  const FillMask = (window.FillMask = window.FillMask || {});
  const { formatMs } = FillMask.lib;

  /** Batches kept for the timeline (a frame carries at most 64, those of its window). */
  const MAX_BATCHES = 96;

  function num(x) { return typeof x === 'number' && isFinite(x) ? x : null; }

  function formatRate(x) {
    if (x === null) return '–';
    return x < 10 ? x.toFixed(1) : String(Math.round(x));
  }

  function formatCount(x) { return x === null ? '–' : String(Math.round(x)); }

  /**
   * The remembered batches plus a frame's `batches`, by batch_id, oldest first, at most `max`. A batch
   * that arrives twice counts once. (Ids restart with the server: the page forgets them on each hello.)
   */
  function mergeBatches(history, batches, max) {
    const byId = new Map(history.map((b) => [b.batch_id, b]));
    for (const b of Array.isArray(batches) ? batches : []) {
      if (b && Number.isInteger(b.batch_id)) byId.set(b.batch_id, b);
    }
    return Array.from(byId.values()).sort((a, b) => a.batch_id - b.batch_id).slice(-(max || MAX_BATCHES));
  }

  /**
   * What the panel shows for one stats frame: {tiles, bars, brief, last, window}.
   * opts: {maxBatchSize (hello's limit, the timeline's full height), ours (a Set of the batch_ids
   * that answered this page's requests)}.
   */
  function view(frame, history, opts) {
    opts = opts || {};
    const latency = frame.latency_ms || {};
    const size = frame.batch_size || {};
    const p50 = num(latency.p50);
    const p99 = num(latency.p99);
    const mean = num(size.mean);
    const max = num(size.max);
    const busy = num(frame.engine_busy);
    const rps = num(frame.requests_per_s);
    const busyText = busy === null ? '–' : Math.round(Math.max(0, Math.min(1, busy)) * 100) + '%';
    const tiles = [
      { key: 'queue', label: 'Queue', text: formatCount(num(frame.queue_depth)), value: num(frame.queue_depth) },
      { key: 'inflight', label: 'In flight', text: formatCount(num(frame.in_flight)), value: num(frame.in_flight) },
      { key: 'rps', label: 'Requests/s', text: formatRate(rps), value: rps },
      { key: 'p50', label: 'Latency p50', text: formatMs(p50), value: p50 },
      { key: 'p99', label: 'Latency p99', text: formatMs(p99), value: p99 },
      {
        key: 'batch', label: 'Batch size', value: mean, extra: { max: max }, title: 'mean / largest',
        text: mean === null ? '–' : (mean < 10 ? mean.toFixed(1) : Math.round(mean)) + ' / ' + formatCount(max),
      },
      { key: 'busy', label: 'Engine busy', text: busyText, value: busy, meter: busy },
      { key: 'connections', label: 'Connections', text: formatCount(num(frame.connections)), value: num(frame.connections) },
    ];
    const tallest = Math.max(1, num(opts.maxBatchSize) || 0, ...history.map((b) => num(b.size) || 0));
    const ours = opts.ours || new Set();
    const bars = history.map((b) => ({
      id: b.batch_id,
      size: num(b.size),
      height: Math.max(0, Math.min(1, (num(b.size) || 0) / tallest)),
      ours: ours.has(b.batch_id),
      title: describeBatch(b),
    }));
    const newest = history[history.length - 1];
    const seconds = num(frame.window_s);
    return {
      tiles,
      bars,
      // Each figure keeps its words on one line (no-break spaces); lines break only between figures.
      brief: ['queue ' + formatCount(num(frame.queue_depth)), formatRate(rps) + ' req/s', 'p99 ' + formatMs(p99),
        'busy ' + busyText].map((part) => part.replace(/ /g, '\u00a0')).join(' · '),
      last: newest ? 'Last ' + describeBatch(newest) : 'No batch has run since the view opened.',
      window: seconds === null ? '' : 'over the last ' + seconds.toFixed(seconds < 10 ? 1 : 0) + ' s',
    };
  }

  function describeBatch(b) {
    const n = num(b.size);
    return 'batch #' + b.batch_id + ': ' + (n === null ? '?' : n) + (n === 1 ? ' request' : ' requests') +
      (num(b.tokens) === null ? '' : ', ' + b.tokens + ' tokens') +
      (num(b.inference_ms) === null ? '' : ', ' + formatMs(b.inference_ms));
  }

  /** Write a view into the panel: the elements with data-testid live-brief, live-tiles, ... */
  function render(panel, v) {
    const part = (id) => panel.querySelector('[data-testid="' + id + '"]');
    part('live-brief').textContent = v.brief;
    part('live-window').textContent = v.window;
    part('live-last').textContent = v.last;
    part('live-tiles').replaceChildren(...v.tiles.map(renderTile));
    const timeline = part('live-timeline');
    timeline.replaceChildren(...v.bars.map(renderBar));
    const axis = part('live-axis');
    axis.replaceChildren();
    if (v.bars.length) {
      const first = document.createElement('span');
      first.textContent = '#' + v.bars[0].id;
      const last = document.createElement('span');
      last.textContent = '#' + v.bars[v.bars.length - 1].id;
      axis.append(first, last);
    }
  }

  function renderTile(t) {
    const tile = document.createElement('div');
    tile.className = 'stat';
    tile.dataset.testid = 'stat-' + t.key;
    tile.dataset.value = t.value === null ? '' : String(t.value);
    if (t.title) tile.title = t.title;
    for (const [k, x] of Object.entries(t.extra || {})) tile.dataset[k] = x === null ? '' : String(x);
    const label = document.createElement('dt');
    label.textContent = t.label;
    const value = document.createElement('dd');
    value.textContent = t.text;
    tile.append(label, value);
    if (t.meter !== undefined) {
      const meter = document.createElement('span');
      meter.className = 'stat-meter';
      meter.setAttribute('aria-hidden', 'true');
      const fill = document.createElement('span');
      fill.style.width = (t.meter === null ? 0 : Math.max(0, Math.min(1, t.meter)) * 100) + '%';
      meter.append(fill);
      value.append(meter);
    }
    return tile;
  }

  function renderBar(b) {
    const li = document.createElement('li');
    li.className = 'tl-bar' + (b.ours ? ' ours' : '');
    li.dataset.testid = 'timeline-batch';
    li.dataset.batchId = String(b.id);
    li.dataset.size = b.size === null ? '' : String(b.size);
    li.title = b.title + (b.ours ? ' (answered a request of this page)' : '');
    const fill = document.createElement('span');
    fill.style.height = Math.max(4, b.height * 100) + '%';
    li.append(fill);
    return li;
  }

  FillMask.live = { MAX_BATCHES, mergeBatches, view, render };
})();
