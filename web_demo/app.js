/* Fill-mask demo page: one WebSocket, many requests in flight, every reply shown on its own card.
 *
 * Wire format: protocol.md at the repository root (section numbers below refer to it).
 * Plain script, no build step and no modules, so the page also works opened from disk.
 *
 * Invariants the code keeps:
 * - Every server string reaches the page through textContent, never as HTML.
 * - A request id is never reused on this page (ids only grow), so a late frame about an old request
 *   can never land on a newer card.
 * - A card leaves `inflight` exactly when its terminal frame arrives (§8) or its connection closes
 *   (the server drops the requests of a closed connection, so nothing more will come for them).
 */
'use strict';

(function () {
  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  const MAX_CARDS = 200;
  const DEFAULT_WS_FROM_DISK = 'ws://127.0.0.1:8765/';

  // Sentences for the burst control; MASK is replaced by the server's mask token. They are of similar
  // length (10 to 13 tokens) so that the server, which batches texts of similar length, runs a burst together.
  const BURST_SENTENCES = [
    'I forgot my MASK at home this morning.',
    'The MASK is the largest planet in our solar system.',
    'He plays the MASK in a small jazz band.',
    'Water boils at one hundred degrees MASK.',
    'Please turn off the MASK when you leave.',
    'The train to the MASK leaves at noon.',
    'Our team won the MASK last night.',
    'A good MASK makes every journey shorter.',
    'They built a house next to the MASK.',
    'My favourite season of the year is MASK.',
    'The doctor told him to get more MASK.',
    'We read an old MASK about dragons and kings.',
    'The museum opens at nine in the MASK.',
    'She speaks three languages, including MASK.',
    'The MASK barked at the postman all afternoon.',
    'Bread is made from flour, water and MASK.',
    'The children played in the MASK after school.',
    'He looked up at the MASK and counted the stars.',
    'This MASK tastes better with a little salt.',
    'The MASK of the story is a young engineer.',
  ];

  const $ = (id) => document.getElementById(id);
  const el = {
    conn: $('conn'), connText: $('conn-text'), connDetail: $('conn-detail'), reconnectNow: $('reconnect-now'),
    modelName: $('model-name'), askForm: $('ask-form'), text: $('text'), textCount: $('text-count'),
    insertMask: $('insert-mask'), topK: $('top-k'), submit: $('submit'),
    burstForm: $('burst-form'), burstSize: $('burst-size'), burstSend: $('burst-send'),
    burstSummary: $('burst-summary'), limits: $('limits'), serverInfo: $('server-info'), serverForm: $('server-form'), wsUrl: $('ws-url'),
    inflight: $('inflight'), clear: $('clear'), notice: $('notice'), empty: $('empty'), cards: $('cards'),
    announcer: $('announcer'), cardTemplate: $('card-template'),
  };

  const state = {
    url: '',
    ws: null,
    hello: null,
    maskToken: '[MASK]',
    attempt: 0,           // reconnections since the last connection that lasted
    connectedAt: 0,       // when the current connection's hello arrived (0: none)
    everConnected: false,
    retryTimer: 0,
    countdownTimer: 0,
    retryAt: 0,
    nextId: 1,
    inflight: new Map(),  // id -> request record
    nextBurst: 1,
  };

  // ---------------------------------------------------------------- formatting

  /** Score as a percentage with three significant digits: 41.2%, 4.12%, 0.0412%. */
  function formatScore(score) {
    const pct = score * 100;
    if (pct === 0) return '0%';
    if (pct >= 99.95) return pct.toFixed(1) + '%';
    return pct.toPrecision(3) + '%';
  }

  function formatMs(ms) {
    if (typeof ms !== 'number' || !isFinite(ms)) return '–';
    if (ms < 10) return ms.toFixed(1) + ' ms';
    if (ms < 10000) return Math.round(ms) + ' ms';
    return (ms / 1000).toFixed(1) + ' s';
  }

  function plural(n, one, many) { return n + ' ' + (n === 1 ? one : many); }

  function countMasks(text) {
    const token = state.maskToken;
    if (!token) return 0;
    let n = 0;
    for (let i = text.indexOf(token); i !== -1; i = text.indexOf(token, i + token.length)) n++;
    return n;
  }

  /** Append `text` to `parent`, wrapping each mask token in <mark class="mask">. */
  function appendWithMasks(parent, text) {
    const token = state.maskToken;
    const parts = token ? text.split(token) : [text];
    parts.forEach((part, i) => {
      if (i > 0) {
        const m = document.createElement('mark');
        m.className = 'mask';
        m.textContent = token;
        parent.appendChild(m);
      }
      if (part) parent.appendChild(document.createTextNode(part));
    });
  }

  function announce(message) {
    // Replacing the text (not appending) keeps the live region short; the delay lets a screen
    // reader notice the change when two messages come in the same frame.
    window.setTimeout(() => { el.announcer.textContent = message; }, 30);
  }

  function showNotice(message) {
    el.notice.textContent = message;
    el.notice.hidden = !message;
  }

  // ---------------------------------------------------------------- connection

  function resolveUrl() {
    const param = new URLSearchParams(window.location.search).get('ws');
    if (param) return normaliseUrl(param);
    if (window.location.protocol === 'http:' || window.location.protocol === 'https:') {
      return (window.location.protocol === 'https:' ? 'wss://' : 'ws://') + window.location.host + '/';
    }
    return DEFAULT_WS_FROM_DISK;
  }

  /** Accept ws://h:p, wss://..., http(s)://... (mapped to ws(s)) or a bare host:port. */
  function normaliseUrl(raw) {
    let url = raw.trim();
    if (/^https?:\/\//i.test(url)) url = url.replace(/^http/i, 'ws');
    else if (!/^wss?:\/\//i.test(url)) url = 'ws://' + url;
    return url;
  }

  /** `text` is announced (it changes only with the state); `detail` (the countdown) is not. */
  function setConn(kind, text, detail) {
    el.conn.dataset.state = kind;
    if (el.connText.textContent !== text) el.connText.textContent = text;
    el.connDetail.textContent = detail || '';
    el.conn.title = kind === 'connected' ? 'Connected to ' + state.url : state.url;
    el.reconnectNow.hidden = kind !== 'reconnecting';
    const usable = kind === 'connected';
    el.submit.disabled = !usable;
    el.burstSend.disabled = !usable;
  }

  function connect() {
    window.clearTimeout(state.retryTimer);
    window.clearInterval(state.countdownTimer);
    if (state.ws) {
      const old = state.ws;
      state.ws = null;
      old.close(1000);
      dropInflight('The connection was closed before an answer came.');
    }
    el.wsUrl.value = state.url;
    let ws;
    try {
      ws = new WebSocket(state.url);
    } catch (err) {
      setConn('offline', 'Cannot connect');
      showNotice('"' + state.url + '" is not a WebSocket URL. Enter one like ws://127.0.0.1:8765 under "Server and limits".');
      return;
    }
    state.ws = ws;
    if (state.everConnected || state.attempt > 0) setConn('reconnecting', 'Reconnecting', 'now');
    else setConn('connecting', 'Connecting…');
    ws.onmessage = (event) => { if (ws === state.ws) onFrame(event.data); };
    ws.onclose = (event) => { if (ws === state.ws) onClose(event); };
    ws.onerror = () => { /* a close event always follows; it is handled there */ };
  }

  function onClose(event) {
    state.ws = null;
    state.hello = null;
    // Back off from scratch only after a connection that lasted: a server that accepts and then
    // drops every connection must not be hammered twice a second.
    if (state.connectedAt && Date.now() - state.connectedAt > 5000) state.attempt = 0;
    state.connectedAt = 0;
    let why = 'The connection closed before an answer came; the server drops requests of closed connections.';
    if (event.code === 1009) why = 'The server closed the connection: a message was too big (1009).';
    else if (event.code === 1001) why = 'The server went away (1001) before answering.';
    dropInflight(why);
    scheduleReconnect(event.code);
  }

  function scheduleReconnect(code) {
    const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** state.attempt) * (0.8 + 0.4 * Math.random());
    state.attempt += 1;
    state.retryAt = Date.now() + delay;
    const closed = code && code !== 1006 ? ' (closed with ' + code + ')' : '';
    const tick = () => {
      const left = Math.max(0, state.retryAt - Date.now());
      setConn('reconnecting', 'Reconnecting', 'in ' + Math.ceil(left / 1000) + ' s' + closed);
    };
    if (!state.everConnected) {
      showNotice('Cannot reach the server at ' + state.url + '. Is it running? The page keeps trying; ' +
        'another address can be set under "Server and limits".');
      el.serverInfo.open = true;
    }
    tick();
    state.countdownTimer = window.setInterval(tick, 250);
    state.retryTimer = window.setTimeout(connect, delay);
  }

  function onFrame(data) {
    let msg;
    try {
      msg = JSON.parse(data);
    } catch (err) {
      showNotice('The server sent a frame that is not JSON; it was ignored.');
      return;
    }
    if (!msg || typeof msg !== 'object') return;
    if (msg.type === 'hello') { onHello(msg); return; }
    const rec = msg.id === null || msg.id === undefined ? undefined : state.inflight.get(msg.id);
    if (!rec) {
      // An error about no request of ours (id null), or a frame for a request already settled.
      if (msg.type === 'error') showNotice('Server error (' + msg.code + '): ' + msg.message);
      return;
    }
    switch (msg.type) {
      case 'result': onResult(rec, msg); break;
      case 'error': onError(rec, msg); break;
      case 'overloaded': onOverloaded(rec, msg); break;
      case 'cancelled': settle(rec, 'cancelled', 'Cancelled', 'Cancelled while it waited in the queue; the model never saw it.'); break;
      default: break; // §1: unknown frame types are ignored
    }
  }

  function onHello(hello) {
    state.hello = hello;
    state.connectedAt = Date.now();
    state.everConnected = true;
    window.clearInterval(state.countdownTimer);
    if (typeof hello.mask_token === 'string' && hello.mask_token) setMaskToken(hello.mask_token);
    el.modelName.textContent = hello.model || 'unknown model';
    document.title = 'Fill-mask · ' + (hello.model || 'demo');
    const limits = hello.limits || {};
    const topK = limits.top_k || {};
    if (Number.isInteger(topK.min)) el.topK.min = topK.min;
    if (Number.isInteger(topK.max)) el.topK.max = topK.max;
    if (Number.isInteger(topK.default) && !el.topK.dataset.touched) el.topK.value = topK.default;
    renderLimits(hello);
    updateCounter();
    showNotice(hello.protocol === 1 ? '' : 'This server speaks protocol ' + hello.protocol + '; the page was written for 1.');
    setConn('connected', 'Connected');
  }

  function setMaskToken(token) {
    const old = state.maskToken;
    state.maskToken = token;
    document.querySelectorAll('.mask-token').forEach((node) => { node.textContent = token; });
    if (old !== token && el.text.value.includes(old)) el.text.value = el.text.value.split(old).join(token);
  }

  function renderLimits(hello) {
    const l = hello.limits || {};
    const topK = l.top_k || {};
    const rows = [
      ['Server', hello.server],
      ['Protocol', hello.protocol],
      ['Mask token', hello.mask_token],
      ['Batch size', l.max_batch_size && 'up to ' + l.max_batch_size + ' requests'],
      ['Batch tokens', l.max_batch_tokens && 'up to ' + l.max_batch_tokens],
      ['Queue', l.max_queue && 'up to ' + l.max_queue + ' waiting'],
      ['Text', l.max_text_chars && 'up to ' + l.max_text_chars + ' characters, ' + l.max_tokens + ' tokens'],
      ['Masks per text', l.max_masks && '1 to ' + l.max_masks],
      ['top_k', topK.max && topK.min + ' to ' + topK.max + ' (default ' + topK.default + ')'],
    ];
    el.limits.replaceChildren();
    for (const [name, value] of rows) {
      if (value === undefined || value === null || value === '') continue;
      const dt = document.createElement('dt');
      dt.textContent = name;
      const dd = document.createElement('dd');
      dd.textContent = String(value);
      el.limits.append(dt, dd);
    }
  }

  // ---------------------------------------------------------------- requests

  /** Send one fill_mask request and give it a card. Returns the record, or null when offline. */
  function sendRequest(text, topK, burst) {
    if (!state.ws || !state.hello || state.ws.readyState !== WebSocket.OPEN) {
      showNotice('Not connected yet; the request was not sent.');
      return null;
    }
    const id = state.nextId++;
    const frame = { type: 'fill_mask', id: id, text: text };
    if (topK !== null) frame.top_k = topK;
    const rec = { id, text, topK, burst, sentAt: performance.now(), card: makeCard(id, text, topK, burst), result: null };
    state.inflight.set(id, rec);
    state.ws.send(JSON.stringify(frame));
    updateInflight();
    return rec;
  }

  function makeCard(id, text, topK, burst) {
    const card = el.cardTemplate.content.firstElementChild.cloneNode(true);
    card.dataset.id = String(id);
    card.dataset.state = 'pending';
    card.tabIndex = -1;
    card.querySelector('[data-testid="card-id"]').textContent = '#' + id;
    const tag = [];
    if (topK !== null) tag.push('top ' + topK);
    if (burst) tag.push('burst ' + burst.n);
    card.querySelector('.card-tag').textContent = tag.join(' · ');
    appendWithMasks(card.querySelector('.card-text'), text);
    setBadge(card, 'pending', 'Waiting');
    card.querySelector('.cancel').setAttribute('aria-label', 'Cancel request ' + id);
    card.querySelector('.retry').setAttribute('aria-label', 'Send request ' + id + ' again');
    card.querySelector('.cancel').addEventListener('click', () => cancelRequest(id));
    card.querySelector('.retry').addEventListener('click', () => {
      const again = sendRequest(text, topK, null);
      if (again) again.card.querySelector('.cancel').focus();
    });
    el.cards.prepend(card);
    el.empty.hidden = true;
    trimCards();
    return card;
  }

  function setBadge(card, kind, label) {
    card.dataset.state = kind;
    const badge = card.querySelector('.badge');
    badge.textContent = label;
    badge.dataset.kind = kind;
  }

  function setMessage(card, text) {
    const p = card.querySelector('.card-message');
    p.textContent = text;
    p.hidden = !text;
  }

  function cancelRequest(id) {
    const rec = state.inflight.get(id);
    if (!rec || !state.ws) return;
    state.ws.send(JSON.stringify({ type: 'cancel', id: id }));
    rec.cancelAsked = true;
    const button = rec.card.querySelector('.cancel');
    button.disabled = true;
    button.textContent = 'Cancelling…';
    setBadge(rec.card, 'pending', 'Cancelling');
  }

  /** Close a request's story: badge, message, buttons, counters. */
  function settle(rec, kind, label, message, canRetry) {
    state.inflight.delete(rec.id);
    if (!rec.doneAt) rec.doneAt = performance.now();
    const card = rec.card;
    setBadge(card, kind, label);
    setMessage(card, message || '');
    const cancel = card.querySelector('.cancel');
    // Hiding a focused button would drop keyboard focus to the page start: keep it on the card.
    if (document.activeElement === cancel) card.focus();
    cancel.hidden = true;
    card.querySelector('.retry').hidden = !canRetry;
    updateInflight();
    if (rec.burst) updateBurst(rec.burst);
    announce('Request ' + rec.id + ': ' + (message || label));
  }

  function onResult(rec, msg) {
    rec.result = msg;
    rec.doneAt = performance.now();
    const groups = Array.isArray(msg.predictions) && Array.isArray(msg.predictions[0])
      ? msg.predictions : [msg.predictions || []];
    renderMetrics(rec, msg);
    const preds = rec.card.querySelector('.preds');
    preds.replaceChildren(...groups.map((group, i) => renderGroup(group, i, groups.length)));
    const late = rec.cancelAsked ? 'It was already running, so the cancel came too late. ' : '';
    settle(rec, 'done', 'Done', late);
    const top = groups.map((g) => (g[0] ? g[0].token_str + ' ' + formatScore(g[0].score) : 'nothing'));
    announce('Request ' + rec.id + ': ' + late + 'top prediction ' + top.join('; then ') + '.');
  }

  function renderMetrics(rec, msg) {
    const box = rec.card.querySelector('.metrics');
    const items = [
      ['queue-ms', 'queue', formatMs(msg.queue_ms), msg.queue_ms],
      ['inference-ms', 'inference', formatMs(msg.inference_ms), msg.inference_ms],
      ['batch-size', 'batch', msg.batch_size + (msg.batch_size === 1 ? ' request' : ' requests'), msg.batch_size],
      ['round-trip-ms', 'round trip', formatMs(rec.doneAt ? rec.doneAt - rec.sentAt : performance.now() - rec.sentAt), null],
    ];
    box.replaceChildren();
    for (const [key, name, shown, raw] of items) {
      const span = document.createElement('span');
      span.className = 'metric';
      span.dataset.testid = 'metric-' + key;
      if (raw !== null && raw !== undefined) span.dataset.value = String(raw);
      const label = document.createElement('span');
      label.className = 'metric-name';
      label.textContent = name;
      const value = document.createElement('span');
      value.className = 'metric-value';
      value.textContent = shown;
      span.append(label, value);
      box.append(span);
    }
    if (msg.batch_size > 1) box.querySelector('[data-testid="metric-batch-size"]').classList.add('batched');
    box.hidden = false;
  }

  /** One ranked list for one mask, with the filled-in sentence of the selected row above it. */
  function renderGroup(predictions, index, count) {
    const section = document.createElement('section');
    section.className = 'mask-group';
    section.dataset.testid = 'prediction-list';
    section.dataset.maskIndex = String(index);
    if (count > 1) {
      const h = document.createElement('h4');
      h.className = 'mask-title';
      h.textContent = 'Mask ' + (index + 1) + ' of ' + count;
      section.append(h);
    }
    const filled = document.createElement('p');
    filled.className = 'filled';
    filled.dataset.testid = 'filled-sentence';
    section.append(filled);

    const list = document.createElement('ol');
    list.className = 'pred-list';
    list.setAttribute('aria-label', count > 1 ? 'Candidates for mask ' + (index + 1) : 'Candidates');
    const sequences = predictions.map((p) => String(p.sequence ?? ''));
    const buttons = predictions.map((p, rank) => {
      const li = document.createElement('li');
      li.className = 'pred';
      li.dataset.testid = 'prediction';
      li.dataset.rank = String(rank + 1);
      li.dataset.token = String(p.token);
      li.dataset.tokenStr = String(p.token_str);
      li.dataset.score = String(p.score);
      li.dataset.sequence = sequences[rank];

      const button = document.createElement('button');
      button.type = 'button';
      button.className = 'pred-button';
      button.title = sequences[rank];
      const rankEl = document.createElement('span');
      rankEl.className = 'rank';
      rankEl.textContent = String(rank + 1);
      const tok = document.createElement('span');
      tok.className = 'tok';
      tok.dataset.testid = 'prediction-token';
      tok.textContent = /^\s*$/.test(p.token_str) ? '␣' : p.token_str;
      const bar = document.createElement('span');
      bar.className = 'bar';
      bar.setAttribute('aria-hidden', 'true');
      const fill = document.createElement('span');
      fill.className = 'fill';
      fill.style.width = Math.max(0, Math.min(1, Number(p.score) || 0)) * 100 + '%';
      bar.append(fill);
      const score = document.createElement('span');
      score.className = 'score';
      score.dataset.testid = 'prediction-score';
      score.textContent = formatScore(p.score);
      button.append(rankEl, tok, bar, score);
      li.append(button);
      list.append(li);
      return button;
    });
    section.append(list);

    // The rows work like a radio group: one tab stop, arrows move, the chosen row fills the sentence.
    function select(i, focus) {
      buttons.forEach((b, j) => {
        b.setAttribute('aria-pressed', String(i === j));
        b.tabIndex = i === j ? 0 : -1;
      });
      renderFilled(filled, sequences, i, predictions[i]);
      if (focus) buttons[i].focus();
    }
    buttons.forEach((b, i) => {
      b.addEventListener('click', () => select(i, false));
      b.addEventListener('keydown', (event) => {
        const moves = { ArrowDown: i + 1, ArrowRight: i + 1, ArrowUp: i - 1, ArrowLeft: i - 1, Home: 0, End: buttons.length - 1 };
        if (!(event.key in moves)) return;
        event.preventDefault();
        select(Math.max(0, Math.min(buttons.length - 1, moves[event.key])), true);
      });
    });
    if (buttons.length) select(0, false);
    return section;
  }

  /**
   * Show the server's `sequence` for row `i` with the predicted token highlighted. The rows of one
   * list differ only where the token went, so the prefix and suffix they share bound it; within
   * that window the token's own text is preferred, when it is found there.
   */
  function renderFilled(target, sequences, i, prediction) {
    const seq = sequences[i];
    target.replaceChildren();
    const label = document.createElement('span');
    label.className = 'filled-label';
    label.textContent = 'Filled in: ';
    target.append(label);
    let start = -1;
    let end = -1;
    if (sequences.length > 1) {
      let pre = 0;
      while (sequences.every((s) => s.length > pre && s[pre] === seq[pre])) pre++;
      let suf = 0;
      while (sequences.every((s) => s.length - suf > pre && s[s.length - 1 - suf] === seq[seq.length - 1 - suf])) suf++;
      // The shared prefix may have eaten the token's first letters (capital/city): look back to a word start.
      const tokenText = String(prediction.token_str || '');
      const winStart = Math.max(0, pre - tokenText.length);
      const winEnd = Math.min(seq.length, seq.length - suf + tokenText.length);
      const at = tokenText ? seq.slice(winStart, winEnd).indexOf(tokenText) : -1;
      if (at !== -1) {
        start = winStart + at;
        end = start + tokenText.length;
      } else if (seq.length - suf > pre) {
        start = pre;
        end = seq.length - suf;
      }
    } else if (prediction.token_str && seq.split(prediction.token_str).length === 2) {
      start = seq.indexOf(prediction.token_str);
      end = start + prediction.token_str.length;
    }
    if (start === -1) {
      target.append(document.createTextNode(seq));
      return;
    }
    const mark = document.createElement('mark');
    mark.className = 'fill-token';
    mark.textContent = seq.slice(start, end);
    target.append(document.createTextNode(seq.slice(0, start)), mark, document.createTextNode(seq.slice(end)));
  }

  function onError(rec, msg) {
    const code = msg.code ? ' (' + msg.code + ')' : '';
    settle(rec, 'error', 'Error' + code, msg.message || 'The server rejected this request.');
  }

  function onOverloaded(rec, msg) {
    const wait = Number(msg.retry_after_ms) || 0;
    const reasons = {
      queue_full: 'The server queue is full',
      shutting_down: 'The server is shutting down',
      deadline_exceeded: 'The deadline passed while the request waited',
    };
    const reason = reasons[msg.reason] || 'The server is overloaded';
    const status = msg.status ? ' (' + msg.status + ')' : '';
    settle(rec, 'overloaded', 'Overloaded' + status,
      reason + '; retry after ' + formatMs(wait) + '.', true);
    const retry = rec.card.querySelector('.retry');
    rec.card.querySelector('.card-message').dataset.retryAfterMs = String(wait);
    retry.disabled = true;
    window.setTimeout(() => { retry.disabled = false; }, wait);
  }

  /** The connection is gone: its requests will never be answered (§8), so say so on each card. */
  function dropInflight(message) {
    for (const rec of Array.from(state.inflight.values())) {
      settle(rec, 'lost', 'Not answered', message, true);
    }
  }

  function updateInflight() {
    const n = state.inflight.size;
    el.inflight.textContent = n ? plural(n, 'request', 'requests') + ' in flight' : 'none in flight';
    el.inflight.dataset.count = String(n);
  }

  function trimCards() {
    const cards = Array.from(el.cards.children);
    for (const card of cards.slice(MAX_CARDS).reverse()) {
      if (!state.inflight.has(Number(card.dataset.id))) card.remove();
    }
  }

  // ---------------------------------------------------------------- burst

  function sendBurst(n) {
    const burst = { n: state.nextBurst++, size: n, records: [], startedAt: performance.now() };
    const offset = Math.floor(Math.random() * BURST_SENTENCES.length);
    const topK = readTopK();
    for (let i = 0; i < n; i++) {
      const text = BURST_SENTENCES[(offset + i) % BURST_SENTENCES.length].split('MASK').join(state.maskToken);
      const rec = sendRequest(text, topK, burst);
      if (!rec) break;
      burst.records.push(rec);
    }
    updateBurst(burst);
  }

  /**
   * Summarise a burst: how many answered and in which batches. Requests of one batch share its
   * batch_size, batch_tokens and inference_ms, which is how batches are told apart here.
   */
  function updateBurst(burst) {
    const done = burst.records.filter((r) => !state.inflight.has(r.id));
    const batches = new Map();
    for (const r of done) {
      if (!r.result) continue;
      const key = r.result.batch_size + '|' + r.result.batch_tokens + '|' + r.result.inference_ms;
      if (!batches.has(key)) batches.set(key, { size: r.result.batch_size, ours: 0 });
      batches.get(key).ours++;
    }
    const sizes = Array.from(batches.values()).map((b) => b.size);
    const box = el.burstSummary;
    box.dataset.burst = String(burst.n);
    box.dataset.done = String(done.length);
    box.dataset.total = String(burst.records.length);
    box.dataset.maxBatch = String(sizes.length ? Math.max(...sizes) : 0);
    box.replaceChildren();
    const line = document.createElement('p');
    const allDone = done.length === burst.records.length;
    const elapsed = allDone && done.length
      ? ' in ' + formatMs(Math.max(...done.map((r) => r.doneAt)) - burst.startedAt) : '';
    line.textContent = 'Burst ' + burst.n + ': ' + done.length + ' of ' + burst.records.length + ' answered' + elapsed + '.';
    box.append(line);
    if (sizes.length) {
      const chips = document.createElement('p');
      chips.className = 'batch-chips';
      const label = document.createElement('span');
      label.className = 'muted';
      label.textContent = 'Batch sizes ';
      chips.append(label);
      for (const b of batches.values()) {
        const chip = document.createElement('span');
        chip.className = 'batch-chip' + (b.size > 1 ? ' batched' : '');
        chip.dataset.testid = 'batch-chip';
        chip.dataset.size = String(b.size);
        chip.textContent = String(b.size);
        chip.title = b.ours + ' of this burst in a batch of ' + b.size;
        chips.append(chip);
      }
      box.append(chips);
    }
  }

  // ---------------------------------------------------------------- form wiring

  function readTopK() {
    const raw = el.topK.value.trim();
    if (raw === '') return null;
    return Number(raw);
  }

  function updateCounter() {
    const text = el.text.value;
    const masks = countMasks(text);
    const limits = (state.hello && state.hello.limits) || {};
    const maxChars = limits.max_text_chars;
    const maxMasks = limits.max_masks;
    const parts = [plural(masks, 'mask', 'masks')];
    parts.push(text.length + (maxChars ? ' / ' + maxChars : '') + ' characters');
    el.textCount.textContent = parts.join(' · ');
    const bad = masks === 0 || (maxMasks && masks > maxMasks) || (maxChars && text.length > maxChars);
    el.textCount.classList.toggle('warn', Boolean(bad && text.length));
  }

  function insertMask() {
    const t = el.text;
    const start = t.selectionStart;
    const end = t.selectionEnd;
    const before = t.value.slice(0, start);
    const after = t.value.slice(end);
    const pre = before && !/\s$/.test(before) ? ' ' : '';
    const post = after && !/^[\s.,;:!?)'"]/.test(after) ? ' ' : '';
    const insert = pre + state.maskToken + post;
    t.focus();
    t.setSelectionRange(start, end);
    // execCommand keeps the browser's undo history; setRangeText is the fallback.
    if (!document.execCommand || !document.execCommand('insertText', false, insert)) {
      t.setRangeText(insert, start, end, 'end');
    }
    updateCounter();
  }

  el.askForm.addEventListener('submit', (event) => {
    event.preventDefault();
    if (el.submit.disabled) {
      showNotice('Not connected yet, so nothing was sent. Send again once the status says Connected.');
      return;
    }
    const text = el.text.value;
    if (!text.trim()) {
      showNotice('Type a sentence first.');
      el.text.focus();
      return;
    }
    showNotice('');
    // The server checks the text (mask count, length) and answers on the card: it is the authority.
    sendRequest(text, readTopK(), null);
  });

  el.text.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      el.askForm.requestSubmit();
    }
  });
  el.text.addEventListener('input', updateCounter);
  el.insertMask.addEventListener('click', insertMask);
  document.addEventListener('keydown', (event) => {
    if (event.altKey && !event.ctrlKey && !event.metaKey && (event.key === 'm' || event.key === 'M' || event.code === 'KeyM')) {
      event.preventDefault();
      insertMask();
    }
  });
  el.topK.addEventListener('input', () => { el.topK.dataset.touched = '1'; });

  el.burstForm.addEventListener('submit', (event) => {
    event.preventDefault();
    if (el.burstSend.disabled) return;
    const n = Math.round(Number(el.burstSize.value));
    const max = Number(el.burstSize.max);
    if (!Number.isFinite(n) || n < 2 || n > max) {
      showNotice('A burst is 2 to ' + max + ' sentences.');
      el.burstSize.focus();
      return;
    }
    showNotice('');
    sendBurst(n);
  });

  el.serverForm.addEventListener('submit', (event) => {
    event.preventDefault();
    const raw = el.wsUrl.value.trim();
    if (!raw) return;
    state.url = normaliseUrl(raw);
    const params = new URLSearchParams(window.location.search);
    params.set('ws', state.url);
    try {
      window.history.replaceState(null, '', '?' + params.toString() + window.location.hash);
    } catch (err) {
      // Some browsers refuse history changes on file:// pages; the connection works regardless.
    }
    state.attempt = 0;
    state.everConnected = false;
    showNotice('');
    connect();
  });

  el.reconnectNow.addEventListener('click', () => { state.attempt = 0; connect(); });

  el.clear.addEventListener('click', () => {
    for (const card of Array.from(el.cards.children)) {
      if (!state.inflight.has(Number(card.dataset.id))) card.remove();
    }
    el.empty.hidden = el.cards.children.length > 0;
    el.burstSummary.replaceChildren();
  });

  state.url = resolveUrl();
  updateCounter();
  updateInflight();
  connect();
})();
