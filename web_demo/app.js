/* Fill-mask demo page: one WebSocket, many requests in flight, every reply shown on its own card.
 *
 * Wire format: protocol.md at the repository root (section numbers below refer to it). Pure helpers
 * live in lib.js (text, tokens, snippets, accounting, diagnosis) and live.js (the stats panel).
 * Plain scripts, no build step and no modules, so the page also works opened from disk.
 *
 * Invariants the code keeps:
 * - Every server string reaches the page through textContent, never as HTML.
 * - A request id is never reused on this page (ids only grow), so a late frame about an old request
 *   can never land on a newer card, even one sent on a later connection.
 * - A request belongs to the connection it was sent on. Its card leaves `inflight` exactly when its
 *   terminal frame arrives on that connection (§8) or that connection closes (the server drops the
 *   requests of a closed connection, so nothing more will come for them).
 * - After `going_away` (§10) the old connection only receives (the answers still owed on it) while
 *   a new one is opened; nothing more is sent on it.
 */
'use strict';

(function () {
  const FillMask = window.FillMask;
  const lib = FillMask.lib;
  const live = FillMask.live;
  const { formatScore, formatMs, plural } = lib;

  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  const MAX_ITEMS = 100;           // top-level cards kept (a burst is one); unanswered ones always stay
  const MAX_OURS = 1024;          // batch ids of this page's results remembered for the timeline
  const LOG_MAX_ENTRIES = 500;
  const LOG_MAX_CHARS = 2000;
  const PROBE_TIMEOUT_MS = 3000;
  const DEFAULT_WS_FROM_DISK = 'ws://127.0.0.1:8765/';
  const WIDE = window.matchMedia('(min-width: 900px)');
  const REDUCED_MOTION = window.matchMedia('(prefers-reduced-motion: reduce)');

  // Sentences for the burst control; MASK is replaced by the server's mask token. They are 11 or 12 tokens
  // long (BERT's uncased vocabulary) so that the server, which batches only texts within --max-length-ratio
  // (1.15 by default) of each other, runs a burst together.
  const BURST_SENTENCES = [
    'I forgot my MASK at home this morning.',
    'The MASK is the largest planet we know.',
    'He plays the MASK in a small jazz band.',
    'Water boils at one hundred degrees MASK.',
    'Please turn off the MASK when you leave.',
    'The train to the MASK leaves at noon.',
    'Our team won the MASK again last night.',
    'A good MASK makes every long journey shorter.',
    'They built a house next to the MASK.',
    'My favourite season of the year is MASK.',
    'The doctor told him to get more MASK.',
    'We read an old MASK about dragons and kings.',
    'The museum opens at nine in the MASK.',
    'She speaks three languages, one of them MASK.',
    'The MASK barked at the postman all afternoon.',
    'Bread is made from flour, water and MASK.',
    'The children played in the MASK after school.',
    'He looked up at the MASK and counted stars.',
    'This MASK tastes better with a little salt.',
    'The MASK of the story is a young engineer.',
  ];

  const $ = (id) => document.getElementById(id);
  const el = {
    conn: $('conn'), connText: $('conn-text'), connDetail: $('conn-detail'), reconnectNow: $('reconnect-now'),
    modelName: $('model-name'), randomBadge: $('random-badge'), randomHelp: $('random-help'),
    askForm: $('ask-form'), text: $('text'), textCount: $('text-count'), insertMask: $('insert-mask'),
    options: $('options'), optionsBrief: $('options-brief'), targets: $('targets'), deadline: $('deadline'),
    topK: $('top-k'), submit: $('submit'),
    live: $('live'), liveInterval: $('live-interval'),
    inflight: $('inflight'), cancelAll: $('cancel-all'), clear: $('clear'), empty: $('empty'), cards: $('cards'),
    burstForm: $('burst-form'), burstSize: $('burst-size'), burstSend: $('burst-send'), burstStatus: $('burst-status'),
    serverInfo: $('server-info'), limits: $('limits'), serverForm: $('server-form'), wsUrl: $('ws-url'),
    frameLog: $('frame-log'), logList: $('log-list'), logCount: $('log-count'), logDropped: $('log-dropped'),
    logHideStats: $('log-hide-stats'), logClear: $('log-clear'),
    notice: $('notice'), announcer: $('announcer'),
    cardTemplate: $('card-template'), burstTemplate: $('burst-template'),
  };

  const state = {
    url: '',
    // The connection new requests go to: {url, ws, opened, hello, retiring}. After going_away it is
    // marked retiring and replaced; it still delivers the answers owed on it until it closes.
    conn: null,
    maskToken: '[MASK]',
    attempt: 0,            // reconnections since the last connection that lasted
    connectedAt: 0,        // when the current connection's hello arrived (0: none)
    everConnected: false,
    restarting: false,     // a going_away came and no hello since
    label: { kind: 'connecting', text: 'Connecting…' },  // what the status says while a retry counts down
    retryTimer: 0,
    countdownTimer: 0,
    nextId: 1,
    inflight: new Map(),   // id -> request record
    nextBurst: 1,
    newestOwn: null,       // the latest request the user sent (not a burst's)
    stats: { supported: null, subscribed: false, pending: false, history: [], ours: new Set(), last: null },
    log: new lib.FrameLog(LOG_MAX_ENTRIES, LOG_MAX_CHARS),
    startedAt: performance.now(),
    glyphMissing: null,
  };

  // ---------------------------------------------------------------- small helpers

  function announce(message) {
    // Replacing the text (not appending) keeps the live region short; the delay lets a screen
    // reader notice the change when two messages come in the same frame.
    window.setTimeout(() => { el.announcer.textContent = message; }, 30);
  }

  function showNotice(message) {
    el.notice.textContent = message;
    el.notice.hidden = !message;
  }

  function hello() { return (state.conn && state.conn.hello) || null; }

  function limits() { return (hello() && hello().limits) || {}; }

  function readable(tokenStr) {
    if (!state.glyphMissing) {
      state.glyphMissing = lib.glyphProbe('600 16px ' + getComputedStyle(document.body).fontFamily);
    }
    return lib.readableToken(tokenStr, state.glyphMissing);
  }

  // ---------------------------------------------------------------- raw-frame log

  function logFrame(dir, text, type) {
    const entry = state.log.add(dir, text, type, performance.now() - state.startedAt);
    if (el.frameLog.open) appendLogEntry(entry);
    updateLogCount();
  }

  function logEvent(text) { logFrame('event', text, 'connection'); }

  function logEntryNode(entry) {
    const li = document.createElement('li');
    li.className = 'log-entry';
    li.dataset.testid = 'log-entry';
    li.dataset.dir = entry.dir;
    li.dataset.type = entry.type;
    li.dataset.seq = String(entry.seq);
    const time = document.createElement('span');
    time.className = 'log-time';
    time.textContent = '+' + (entry.at / 1000).toFixed(3) + ' s';
    const dir = document.createElement('span');
    dir.className = 'log-dir';
    dir.textContent = { out: '→', in: '←', event: '•' }[entry.dir];
    dir.title = { out: 'sent', in: 'received', event: 'connection' }[entry.dir];
    const words = document.createElement('span');
    words.className = 'visually-hidden';
    words.textContent = dir.title + ': ';
    const text = document.createElement('code');
    text.className = 'log-text';
    text.textContent = entry.text;
    li.append(time, dir, words, text);
    return li;
  }

  /** Keep the open list equal to the log: add the entry, drop what fell off the log's front. */
  function appendLogEntry(entry) {
    const list = el.logList;
    const atEnd = list.scrollTop + list.clientHeight >= list.scrollHeight - 8;
    list.append(logEntryNode(entry));
    const oldest = state.log.entries.length ? state.log.entries[0].seq : Infinity;
    while (list.firstElementChild && Number(list.firstElementChild.dataset.seq) < oldest) list.firstElementChild.remove();
    if (atEnd) list.scrollTop = list.scrollHeight;  // newest last: follow the end unless the user scrolled up
  }

  function renderLog() {
    el.logList.replaceChildren(...state.log.entries.map(logEntryNode));
    el.logList.scrollTop = el.logList.scrollHeight;
  }

  function updateLogCount() {
    el.logCount.textContent = '(' + state.log.entries.length + ')';
    el.logDropped.textContent = state.log.dropped ? plural(state.log.dropped, 'older frame', 'older frames') + ' dropped' : '';
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
    el.reconnectNow.hidden = kind === 'connected' || kind === 'connecting';
    const usable = kind === 'connected';
    el.submit.disabled = !usable;
    el.burstSend.disabled = !usable;
  }

  function stopTimers() {
    window.clearTimeout(state.retryTimer);
    window.clearInterval(state.countdownTimer);
  }

  function connect() {
    stopTimers();
    if (state.conn) {
      const old = state.conn;
      state.conn = null;
      old.ws.close(1000);
      dropInflight(old, 'The connection was closed before an answer came.');
    }
    el.wsUrl.value = state.url;
    const conn = { url: state.url, ws: null, opened: false, hello: null, retiring: false };
    try {
      conn.ws = new WebSocket(conn.url);
    } catch (err) {
      setConn('offline', 'Cannot connect');
      showNotice('"' + state.url + '" is not a WebSocket URL. Enter one like ws://127.0.0.1:8765 under "Server and limits".');
      el.serverInfo.open = true;
      return;
    }
    state.conn = conn;
    logEvent('connecting to ' + conn.url);
    if (state.restarting) setConn('reconnecting', 'Server is restarting; reconnecting', 'now');
    else if (state.everConnected || state.attempt > 0) setConn(state.label.kind, state.label.text, 'now');
    else setConn('connecting', 'Connecting…');
    conn.ws.onopen = () => { conn.opened = true; };
    conn.ws.onmessage = (event) => onFrame(conn, event.data);
    conn.ws.onclose = (event) => onClose(conn, event);
    conn.ws.onerror = () => { /* a close event always follows; it is handled there */ };
  }

  function closeReason(code) {
    if (code === 1009) return 'The server closed the connection: a message was too big (1009).';
    if (code === 1001) return 'The server went away (1001) before answering.';
    return 'The connection closed before an answer came; the server drops requests of closed connections.';
  }

  function onClose(conn, event) {
    logEvent('closed' + (event.code ? ' with ' + event.code : '') + (event.reason ? ': ' + event.reason : '') +
      (conn.opened ? '' : ' (the handshake failed)'));
    dropInflight(conn, closeReason(event.code));
    if (conn.retiring) return;  // the answers it owed have come (or are lost, said above)
    if (conn !== state.conn) return;  // replaced by connect(): already dealt with
    state.conn = null;
    // Back off from scratch only after a connection that lasted: a server that accepts and then
    // drops every connection must not be hammered twice a second.
    if (state.connectedAt && Date.now() - state.connectedAt > 5000) state.attempt = 0;
    state.connectedAt = 0;
    const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** state.attempt) * (0.8 + 0.4 * Math.random());
    state.attempt += 1;
    // A restart that takes this long is no longer a restart: say what the probes find instead.
    if (state.restarting && state.attempt > 4) state.restarting = false;
    if (state.restarting) state.label = { kind: 'reconnecting', text: 'Server is restarting; reconnecting' };
    // A diagnosis (refused, offline) stands until the next probe says otherwise.
    else if (state.label.kind !== 'refused' && state.label.kind !== 'offline') state.label = { kind: 'reconnecting', text: 'Reconnecting' };
    retryIn(delay, event.code && event.code !== 1006 ? ' (closed with ' + event.code + ')' : '');
    if (!conn.opened) diagnoseFailure(conn.url, state.attempt);
  }

  function retryIn(delay, suffix) {
    stopTimers();
    const retryAt = Date.now() + delay;
    const tick = () => {
      const left = Math.max(0, retryAt - Date.now());
      setConn(state.label.kind, state.label.text, 'in ' + Math.ceil(left / 1000) + ' s' + suffix);
    };
    tick();
    state.countdownTimer = window.setInterval(tick, 250);
    state.retryTimer = window.setTimeout(connect, delay);
  }

  /**
   * A handshake failed: find out why (lib.diagnose) and say it. Browsers hide the refusal's HTTP
   * status, so the page asks the server's /healthz (open to any page): an answer means the server is
   * up and refused this page. Same-origin pages can read /readyz too (draining, engine stopped).
   */
  async function diagnoseFailure(url, attempt) {
    const probe = await probeServer(url);
    if (attempt !== state.attempt || hello()) return;  // a newer attempt, or connected meanwhile
    const verdict = lib.diagnose(Object.assign({
      url, pageProtocol: window.location.protocol, pageOrigin: window.location.origin,
      restarting: state.restarting, everConnected: state.everConnected,
    }, probe));
    state.label = { kind: verdict.kind, text: verdict.label };
    el.conn.dataset.state = verdict.kind;
    el.connText.textContent = verdict.label;
    if (verdict.notice) {
      showNotice(verdict.notice);
      el.serverInfo.open = true;
    }
  }

  async function probeServer(url) {
    let base;
    try {
      base = lib.httpBase(url);
    } catch (err) {
      return { reachable: false, ready: null };
    }
    const controller = new AbortController();
    const timer = window.setTimeout(() => controller.abort(), PROBE_TIMEOUT_MS);
    try {
      if (base === window.location.origin) {
        const response = await fetch(base + '/readyz', { cache: 'no-store', signal: controller.signal });
        const body = await response.json().catch(() => ({}));
        return { reachable: true, ready: typeof body.status === 'string' ? body.status : null };
      }
      // Cross-origin (a file: page, another port): the answer is opaque, but that it came is enough.
      await fetch(base + '/healthz', { mode: 'no-cors', cache: 'no-store', signal: controller.signal });
      return { reachable: true, ready: null };
    } catch (err) {
      return { reachable: false, ready: null };
    } finally {
      window.clearTimeout(timer);
    }
  }

  /**
   * §10: the server is draining. Requests already accepted are still answered on this connection,
   * so it stays open (receiving only) while a new one is opened after a random delay within
   * reconnect_within_ms (full jitter: many pages must not all come back at the same moment).
   */
  function onGoingAway(conn, msg) {
    if (conn !== state.conn) return;
    conn.retiring = true;
    state.conn = null;
    state.restarting = true;
    state.attempt = 0;
    const within = Number(msg.reconnect_within_ms);
    const delay = Math.random() * (Number.isFinite(within) && within >= 0 ? within : 1000);
    state.label = { kind: 'reconnecting', text: 'Server is restarting; reconnecting' };
    retryIn(delay, '');
    updateInflight();
    const owed = Array.from(state.inflight.values()).filter((r) => r.conn === conn).length;
    announce('The server is restarting; the page reconnects by itself.' +
      (owed ? ' ' + plural(owed, 'request', 'requests') + ' already sent still get their answers.' : ''));
  }

  // ---------------------------------------------------------------- frames in

  function onFrame(conn, data) {
    if (conn !== state.conn && !conn.retiring) return;
    let msg;
    try {
      msg = JSON.parse(data);
    } catch (err) {
      logFrame('in', data, 'not JSON');
      showNotice('The server sent a frame that is not JSON; it was ignored.');
      return;
    }
    const type = msg && typeof msg === 'object' && typeof msg.type === 'string' ? msg.type : '';
    logFrame('in', data, type);
    if (!type) return;
    if (type === 'hello') { if (conn === state.conn) onHello(conn, msg); return; }
    if (type === 'going_away') { onGoingAway(conn, msg); return; }
    if (type === 'stats') { if (conn === state.conn) onStats(msg); return; }
    const rec = msg.id === null || msg.id === undefined ? undefined : state.inflight.get(msg.id);
    if (!rec || rec.conn !== conn) {
      // An error about no request of ours (id null), or a frame for a request already settled.
      if (type === 'error' && conn === state.conn) onStrayError(msg);
      return;
    }
    switch (type) {
      case 'result': onResult(rec, msg); break;
      case 'error': onError(rec, msg); break;
      case 'overloaded': onOverloaded(rec, msg); break;
      case 'cancelled': settle(rec, 'cancelled', 'Cancelled', 'Cancelled while it waited in the queue; the model never saw it.'); break;
      default: break; // §1: unknown frame types are ignored
    }
  }

  function onStrayError(msg) {
    // The only frames this page sends without an id are subscribe_stats/unsubscribe_stats: an id-less
    // error while one is unanswered is about it. A server without stats says unknown_type; that is
    // not a fault, only a server that offers no live view.
    if (msg.id === null && state.stats.pending) {
      state.stats.pending = false;
      state.stats.subscribed = false;
      state.stats.supported = false;
      el.live.hidden = true;
      if (msg.code === 'unknown_type') return;
      showNotice('The live view is not available: ' + (msg.message || msg.code));
      return;
    }
    showNotice('Server error (' + msg.code + '): ' + msg.message);
  }

  function onHello(conn, msg) {
    conn.hello = msg;
    state.connectedAt = Date.now();
    state.everConnected = true;
    state.restarting = false;
    state.label = { kind: 'connected', text: 'Connected' };
    stopTimers();
    if (typeof msg.mask_token === 'string' && msg.mask_token) setMaskToken(msg.mask_token);
    el.modelName.textContent = msg.model || 'unknown model';
    document.title = 'Fill-mask · ' + (msg.model || 'demo');
    const random = msg.random_weights === true;
    el.randomBadge.hidden = !random;
    el.randomHelp.hidden = !random;
    document.body.classList.toggle('random-weights', random);
    applyLimits(msg.limits || {});
    renderLimits(msg);
    updateCounter();
    updateOptionsBrief();
    showNotice(msg.protocol === 1 ? '' : 'This server speaks protocol ' + msg.protocol + '; the page was written for 1.');
    setConn('connected', 'Connected');
    updateInflight();
    startStats();
  }

  function applyLimits(l) {
    const topK = l.top_k || {};
    if (Number.isInteger(topK.min)) el.topK.min = topK.min;
    if (Number.isInteger(topK.max)) el.topK.max = topK.max;
    if (Number.isInteger(topK.default) && !el.topK.dataset.touched) el.topK.value = topK.default;
    if (Number.isFinite(l.max_deadline_ms)) el.deadline.max = l.max_deadline_ms;
  }

  function setMaskToken(token) {
    const old = state.maskToken;
    state.maskToken = token;
    document.querySelectorAll('.mask-token').forEach((node) => { node.textContent = token; });
    if (old !== token && el.text.value.includes(old)) el.text.value = el.text.value.split(old).join(token);
  }

  function renderLimits(msg) {
    const l = msg.limits || {};
    const topK = l.top_k || {};
    const rows = [
      ['Server', msg.server],
      ['Protocol', msg.protocol],
      ['Weights', msg.random_weights === true ? 'random (never trained)' : msg.random_weights === false ? 'trained' : null],
      ['Mask token', msg.mask_token],
      ['Batch size', l.max_batch_size && 'up to ' + l.max_batch_size + ' requests'],
      ['Batch tokens', l.max_batch_tokens && 'up to ' + l.max_batch_tokens],
      ['Queue', l.max_queue && 'up to ' + l.max_queue + ' waiting'],
      ['Text', l.max_text_chars && 'up to ' + l.max_text_chars + ' characters, ' + l.max_tokens + ' tokens'],
      ['Masks per text', l.max_masks && '1 to ' + l.max_masks],
      ['top_k', topK.max && topK.min + ' to ' + topK.max + ' (default ' + topK.default + ')'],
      ['Targets', l.max_targets && 'up to ' + l.max_targets + ' words of up to ' + l.max_target_chars + ' characters'],
      ['Deadline', l.max_deadline_ms && 'up to ' + formatMs(l.max_deadline_ms)],
      ['In flight', l.max_inflight_per_connection && 'up to ' + l.max_inflight_per_connection + ' per connection'],
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

  // ---------------------------------------------------------------- live view (stats frames)

  function sendFrame(conn, frame) {
    const text = JSON.stringify(frame);
    conn.ws.send(text);
    logFrame('out', text, frame.type);
  }

  /** On every hello: forget the old server's batches and ask this one for stats if its hello offers
   *  them (protocol §2, §13). A server without hello.stats has no live view, which is not a fault: the
   *  panel stays hidden and nothing is asked. */
  function startStats() {
    Object.assign(state.stats, { subscribed: false, pending: false, history: [], ours: new Set(), last: null });
    const offered = Boolean(state.conn && state.conn.hello && state.conn.hello.stats);
    state.stats.supported = offered ? null : false;
    if (!offered) { el.live.hidden = true; return; }
    subscribeStats();
  }

  function subscribeStats() {
    const conn = state.conn;
    if (!conn || !conn.hello || document.hidden || state.stats.supported === false) return;
    sendFrame(conn, { type: 'subscribe_stats', interval_ms: Number(el.liveInterval.value) });
    state.stats.subscribed = true;
    state.stats.pending = true;
  }

  function unsubscribeStats() {
    const conn = state.conn;
    // Only to a server known to have stats: another would answer an error for nothing.
    if (!conn || !conn.hello || !state.stats.subscribed || state.stats.supported !== true) return;
    sendFrame(conn, { type: 'unsubscribe_stats' });
    state.stats.subscribed = false;
    state.stats.pending = false;
  }

  function onStats(frame) {
    state.stats.pending = false;
    state.stats.supported = true;
    el.live.hidden = false;
    state.stats.history = live.mergeBatches(state.stats.history, frame.batches, live.MAX_BATCHES);
    state.stats.last = frame;
    drawStats();
  }

  function drawStats() {
    const frame = state.stats.last;
    if (!frame) return;
    live.render(el.live, live.view(frame, state.stats.history, { maxBatchSize: limits().max_batch_size, ours: state.stats.ours }));
  }

  // ---------------------------------------------------------------- requests

  /** The request fields from the form, or null (with a notice saying why) when they cannot be sent. */
  function readRequest() {
    const fields = { text: el.text.value };
    const topK = readTopK();
    if (topK !== null) fields.top_k = topK;
    const targets = lib.parseTargets(el.targets.value);
    if (targets !== null) {
      if (!targets.length) {
        showNotice('Targets: give one or more words separated by commas, or leave the field empty.');
        el.options.open = true;
        el.targets.focus();
        return null;
      }
      fields.targets = targets;
    }
    const deadline = readDeadline();
    if (deadline === undefined) return null;
    if (deadline !== null) fields.deadline_ms = deadline;
    return fields;
  }

  function readTopK() {
    const raw = el.topK.value.trim();
    return raw === '' ? null : Number(raw);
  }

  /** The deadline in ms, null for none, undefined (after a notice) for something that is not a number. */
  function readDeadline() {
    if (el.deadline.validity.badInput) {
      showNotice('Deadline: give a number of milliseconds, or leave the field empty.');
      el.options.open = true;
      el.deadline.focus();
      return undefined;
    }
    const raw = el.deadline.value.trim();
    // Out-of-range values are sent as they are: the server's invalid_deadline answer says the rule.
    return raw === '' ? null : Number(raw);
  }

  /** Send one fill_mask request and give it a card. Returns the record, or null when offline. */
  function sendRequest(fields, burst) {
    const conn = state.conn;
    if (!conn || !conn.hello || conn.ws.readyState !== WebSocket.OPEN) {
      showNotice('Not connected yet; the request was not sent.');
      return null;
    }
    const id = state.nextId++;
    const frame = Object.assign({ type: 'fill_mask', id: id }, fields);
    const rec = {
      id, frame, text: fields.text, maskToken: state.maskToken, burst, conn, kind: 'pending',
      sentAt: performance.now(), doneAt: 0, result: null, card: null, cancelAsked: false,
    };
    rec.card = makeCard(rec);
    state.inflight.set(id, rec);
    sendFrame(conn, frame);
    updateInflight();
    return rec;
  }

  function describeOptions(frame) {
    const tag = [];
    if (frame.top_k !== undefined) tag.push('top ' + frame.top_k);
    if (frame.targets) tag.push('targets: ' + frame.targets.join(', '));
    if (frame.deadline_ms !== undefined) tag.push('deadline ' + formatMs(frame.deadline_ms));
    return tag;
  }

  function makeCard(rec) {
    const card = el.cardTemplate.content.firstElementChild.cloneNode(true);
    card.dataset.id = String(rec.id);
    card.dataset.state = 'pending';
    card.tabIndex = -1;
    card.querySelector('[data-testid="card-id"]').textContent = '#' + rec.id;
    const tag = describeOptions(rec.frame);
    if (rec.burst) tag.push('burst ' + rec.burst.n);
    card.querySelector('.card-tag').textContent = tag.join(' · ');
    appendWithMasks(card.querySelector('.card-text'), rec.text, rec.maskToken);
    setBadge(card, 'pending', 'Waiting');
    const cancel = card.querySelector('.cancel');
    cancel.setAttribute('aria-label', 'Cancel request ' + rec.id);
    cancel.addEventListener('click', () => cancelRequest(rec));
    const retry = card.querySelector('.retry');
    retry.setAttribute('aria-label', 'Send request ' + rec.id + ' again');
    retry.addEventListener('click', () => {
      const fields = Object.assign({}, rec.frame);
      delete fields.type;
      delete fields.id;
      const again = sendRequest(fields, null);
      if (again) again.card.querySelector('.cancel').focus();
    });
    wireCopyButtons(card, rec);
    if (rec.burst) {
      rec.burst.list.append(card);
    } else {
      el.cards.prepend(card);
      state.newestOwn = rec;
      reveal(card);
    }
    el.empty.hidden = true;
    trimCards();
    return card;
  }

  /** Bring a card into view with the least scrolling (on a phone it is below the form). */
  function reveal(card) {
    card.scrollIntoView({ block: 'nearest', behavior: REDUCED_MOTION.matches ? 'auto' : 'smooth' });
  }

  /** Append `text` to `parent`, wrapping each mask token in <mark class="mask">. */
  function appendWithMasks(parent, text, token) {
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

  /** Requests that a cancel can still reach: in flight on the connection that takes new frames. */
  function cancellable() {
    return Array.from(state.inflight.values()).filter((r) => r.conn === state.conn && !r.cancelAsked);
  }

  function cancelRequest(rec) {
    if (!state.inflight.has(rec.id) || rec.cancelAsked || rec.conn !== state.conn) return;
    sendFrame(rec.conn, { type: 'cancel', id: rec.id });
    rec.cancelAsked = true;
    const button = rec.card.querySelector('.cancel');
    button.disabled = true;
    button.textContent = 'Cancelling…';
    setBadge(rec.card, 'pending', 'Cancelling');
    updateInflight();
  }

  /** Close a request's story: badge, message, buttons, counters. */
  function settle(rec, kind, label, message, canRetry) {
    state.inflight.delete(rec.id);
    rec.kind = kind;
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
    else if (kind !== 'done') announce('Request ' + rec.id + ': ' + (message || label));
  }

  function onResult(rec, msg) {
    rec.result = msg;
    rec.doneAt = performance.now();
    // Batches that answered this page stand out on the timeline (drawn with the next stats frame,
    // which may come after the result). The oldest ids go first: the timeline shows recent ones only.
    if (Number.isInteger(msg.batch_id)) {
      state.stats.ours.add(msg.batch_id);
      if (state.stats.ours.size > MAX_OURS) state.stats.ours.delete(state.stats.ours.values().next().value);
    }
    const groups = Array.isArray(msg.predictions) && Array.isArray(msg.predictions[0])
      ? msg.predictions : [msg.predictions || []];
    renderMetrics(rec, msg);
    renderPredictions(rec, groups);
    const late = rec.cancelAsked ? 'It was already running, so the cancel came too late. ' : '';
    // Is the card being looked at? Then it stays in view as it grows (phones: it is below the form).
    const rect = rec.card.getBoundingClientRect();
    const watched = rec === state.newestOwn && rect.top < window.innerHeight && rect.bottom > 0;
    settle(rec, 'done', 'Done', late);
    if (watched) reveal(rec.card);
    if (!rec.burst) {
      const top = groups.map((g) => (g[0] ? readable(g[0].token_str).text + ' ' + formatScore(g[0].score) : 'nothing'));
      announce('Request ' + rec.id + ': ' + late + 'top prediction ' + top.join('; then ') + '.');
    }
  }

  function renderMetrics(rec, msg) {
    const box = rec.card.querySelector('.metrics');
    const items = [
      ['queue-ms', 'queue', formatMs(msg.queue_ms), msg.queue_ms],
      ['inference-ms', 'inference', formatMs(msg.inference_ms), msg.inference_ms],
      ['batch-size', 'batch', msg.batch_size + (msg.batch_size === 1 ? ' request' : ' requests'), msg.batch_size],
      ['batch-id', 'batch id', '#' + msg.batch_id, msg.batch_id],
      ['round-trip-ms', 'round trip', formatMs(rec.doneAt - rec.sentAt), null],
    ];
    box.replaceChildren();
    for (const [key, name, shown, raw] of items) {
      if (key === 'batch-id' && !Number.isInteger(raw)) continue;
      box.append(metric(key, name, shown, raw));
    }
    if (msg.batch_size > 1) box.querySelector('[data-testid="metric-batch-size"]').classList.add('batched');
    if (rec.conn.hello && rec.conn.hello.random_weights === true) {
      const chip = metric('random', '', 'random weights: arbitrary words', null);
      chip.classList.add('warn');
      box.append(chip);
    }
    box.hidden = false;
  }

  function metric(key, name, shown, raw) {
    const span = document.createElement('span');
    span.className = 'metric';
    span.dataset.testid = 'metric-' + key;
    if (raw !== null && raw !== undefined) span.dataset.value = String(raw);
    if (name) {
      const label = document.createElement('span');
      label.className = 'metric-name';
      label.textContent = name;
      span.append(label);
    }
    const value = document.createElement('span');
    value.className = 'metric-value';
    value.textContent = shown;
    span.append(value);
    return span;
  }

  /**
   * One filled-in sentence for the whole text (the chosen candidate of each mask in place of that
   * mask), then one ranked list per mask. Choosing a row in a list changes that mask's word.
   */
  function renderPredictions(rec, groups) {
    const chosen = groups.map(() => 0);
    const filled = document.createElement('p');
    filled.className = 'filled';
    filled.dataset.testid = 'filled-sentence';
    const redraw = () => renderFilled(filled, rec, groups, chosen);
    const lists = groups.map((group, i) => renderGroup(group, i, groups.length, (row) => {
      chosen[i] = row;
      redraw();
    }));
    rec.card.querySelector('.preds').replaceChildren(filled, ...lists);
    redraw();
  }

  function renderFilled(target, rec, groups, chosen) {
    const fills = groups.map((g, i) => (g[chosen[i]] ? readable(g[chosen[i]].token_str).text : rec.maskToken));
    const label = document.createElement('span');
    label.className = 'filled-label';
    label.textContent = 'Filled in: ';
    target.replaceChildren(label);
    for (const seg of lib.filledSegments(rec.text, rec.maskToken, fills)) {
      if (seg.mask === -1) {
        target.append(document.createTextNode(seg.text));
        continue;
      }
      const mark = document.createElement('mark');
      mark.className = 'fill-token';
      mark.dataset.mask = String(seg.mask);
      mark.textContent = seg.text;
      target.append(mark);
    }
  }

  /** One ranked list for one mask: rows work like a radio group (one tab stop, arrows move). */
  function renderGroup(predictions, index, count, onSelect) {
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
    const list = document.createElement('ol');
    list.className = 'pred-list';
    list.setAttribute('aria-label', count > 1 ? 'Candidates for mask ' + (index + 1) : 'Candidates');
    const buttons = predictions.map((p, rank) => {
      const li = renderRow(p, rank, count === 1);
      list.append(li);
      return li.querySelector('button');
    });
    section.append(list);

    function select(i, focus) {
      buttons.forEach((b, j) => {
        b.setAttribute('aria-pressed', String(i === j));
        b.tabIndex = i === j ? 0 : -1;
      });
      onSelect(i);
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

  function renderRow(p, rank, singleMask) {
    const li = document.createElement('li');
    li.className = 'pred';
    li.dataset.testid = 'prediction';
    li.dataset.rank = String(rank + 1);
    li.dataset.token = String(p.token);
    li.dataset.tokenStr = String(p.token_str);
    li.dataset.score = String(p.score);
    li.dataset.sequence = String(p.sequence ?? '');

    const button = document.createElement('button');
    button.type = 'button';
    button.className = 'pred-button';
    // With one mask the pipeline's sequence is a clean sentence worth a tooltip; with several it
    // holds the special tokens and the other masks (§4).
    if (singleMask) button.title = String(p.sequence ?? '');
    const rankEl = document.createElement('span');
    rankEl.className = 'rank';
    rankEl.textContent = String(rank + 1);
    const shown = readable(p.token_str);
    const tok = document.createElement('span');
    tok.className = 'tok' + (shown.special ? ' special' : '');
    tok.dataset.testid = 'prediction-token';
    tok.textContent = shown.text;
    if (shown.note) tok.title = shown.note;
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
    if (shown.note) {
      const note = document.createElement('span');
      note.className = 'visually-hidden';
      note.textContent = ' (' + shown.note + ')';
      button.append(note);
    }
    li.append(button);
    return li;
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
      engine_stopped: "The server's model worker stopped",
      deadline_exceeded: 'The deadline passed while the request waited',
    };
    const reason = reasons[msg.reason] || 'The server is overloaded';
    const status = msg.status ? ' (' + msg.status + ')' : '';
    settle(rec, 'overloaded', 'Overloaded' + status, reason + '; retry after ' + formatMs(wait) + '.', true);
    const retry = rec.card.querySelector('.retry');
    rec.card.querySelector('.card-message').dataset.retryAfterMs = String(wait);
    retry.disabled = true;
    window.setTimeout(() => { retry.disabled = false; }, wait);
  }

  /** A connection is gone: its requests will never be answered (§8), so say so on each card. */
  function dropInflight(conn, message) {
    for (const rec of Array.from(state.inflight.values())) {
      if (rec.conn === conn) settle(rec, 'lost', 'Not answered', message, true);
    }
  }

  function updateInflight() {
    const n = state.inflight.size;
    el.inflight.textContent = n ? plural(n, 'request', 'requests') + ' in flight' : 'none in flight';
    el.inflight.dataset.count = String(n);
    el.cancelAll.disabled = cancellable().length === 0;
  }

  /** Keep at most MAX_ITEMS top-level cards, dropping the oldest finished ones. */
  function trimCards() {
    const items = Array.from(el.cards.children);
    for (const item of items.slice(MAX_ITEMS).reverse()) {
      if (!itemBusy(item)) item.remove();
    }
  }

  /** A top-level card with a request still unanswered (a request card, or a burst with one). */
  function itemBusy(item) {
    const ids = item.classList.contains('burst-card')
      ? Array.from(item.querySelectorAll('[data-testid="request-card"]'), (c) => Number(c.dataset.id))
      : [Number(item.dataset.id)];
    return ids.some((id) => state.inflight.has(id));
  }

  // ---------------------------------------------------------------- copy as code

  function wireCopyButtons(card, rec) {
    const pre = card.querySelector('.snippet');
    const status = card.querySelector('.copy-status');
    const buttons = Array.from(card.querySelectorAll('.copy-as button'));
    for (const button of buttons) {
      const language = button.dataset.lang;
      button.setAttribute('aria-label', 'Copy request ' + rec.id + ' as ' + button.textContent);
      button.addEventListener('click', async () => {
        const again = button.getAttribute('aria-pressed') === 'true';
        buttons.forEach((b) => b.setAttribute('aria-pressed', String(b === button && !again)));
        if (again) {  // a second click on the same language hides the code
          pre.hidden = true;
          status.textContent = '';
          return;
        }
        const code = lib.snippet(language, rec.conn.url, rec.frame);
        pre.textContent = code;
        pre.dataset.lang = language;
        pre.hidden = false;
        status.textContent = await copyText(code) ? 'copied' : 'select it below and copy';
      });
    }
  }

  /** Put text on the clipboard; false where the browser refuses (the code is shown either way). */
  async function copyText(text) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch (err) {
      return false;
    }
  }

  // ---------------------------------------------------------------- burst

  function sendBurst(n) {
    const fields = {};
    const topK = readTopK();
    if (topK !== null) fields.top_k = topK;
    const deadline = readDeadline();
    if (deadline === undefined) return;
    if (deadline !== null) fields.deadline_ms = deadline;

    const card = el.burstTemplate.content.firstElementChild.cloneNode(true);
    const burst = { n: state.nextBurst++, size: n, records: [], startedAt: performance.now(), card,
      list: card.querySelector('.nested'), announced: false };
    card.dataset.burst = String(burst.n);
    card.querySelector('.burst-title').textContent = 'Burst ' + burst.n;
    const cancel = card.querySelector('[data-testid="burst-cancel"]');
    cancel.setAttribute('aria-label', 'Cancel the requests of burst ' + burst.n + ' still queued');
    cancel.addEventListener('click', () => burst.records.forEach(cancelRequest));
    el.cards.prepend(card);
    el.empty.hidden = true;
    const offset = Math.floor(Math.random() * BURST_SENTENCES.length);
    for (let i = 0; i < n; i++) {
      const text = BURST_SENTENCES[(offset + i) % BURST_SENTENCES.length].split('MASK').join(state.maskToken);
      const rec = sendRequest(Object.assign({ text }, fields), burst);
      if (!rec) break;
      burst.records.push(rec);
    }
    updateBurst(burst);
  }

  /**
   * A burst's card: each outcome counted on its own (a cancelled request is not "answered"), and
   * the batches its results ran in, told apart by batch_id (§4).
   */
  function updateBurst(burst) {
    const t = lib.tally(burst.records.map((r) => r.kind));
    const batches = new Map();
    for (const r of burst.records) {
      if (!r.result) continue;
      const key = Number.isInteger(r.result.batch_id) ? r.result.batch_id
        : r.result.batch_size + '|' + r.result.batch_tokens + '|' + r.result.inference_ms;
      if (!batches.has(key)) batches.set(key, { id: r.result.batch_id, size: r.result.batch_size, ours: 0 });
      batches.get(key).ours++;
    }
    const sizes = Array.from(batches.values(), (b) => b.size);
    const card = burst.card;
    const summary = card.querySelector('[data-testid="burst-summary"]');
    Object.assign(summary.dataset, {
      burst: burst.n, total: t.sent, done: t.sent - t.waiting, answered: t.answered, cancelled: t.cancelled,
      overloaded: t.overloaded, errors: t.errors, lost: t.lost, waiting: t.waiting,
      maxBatch: sizes.length ? Math.max(...sizes) : 0,
    });
    const finished = burst.records.filter((r) => r.doneAt);
    const elapsed = !t.waiting && finished.length
      ? ' in ' + formatMs(Math.max(...finished.map((r) => r.doneAt)) - burst.startedAt) : '';
    const line = lib.tallyText(t) + elapsed + '.';
    summary.textContent = line;
    el.burstStatus.textContent = 'Burst ' + burst.n + ': ' + line;
    setBadge(card, t.waiting ? 'pending' : 'done', t.waiting ? 'Running' : 'Finished');
    card.dataset.state = t.waiting ? 'pending' : 'done';
    card.querySelector('[data-testid="burst-cancel"]').hidden = !t.waiting;
    card.querySelector('.burst-requests summary').textContent = 'Its ' + plural(t.sent, 'request', 'requests');
    renderBatchChips(card.querySelector('.batch-chips'), batches);
    if (!t.waiting && !burst.announced) {
      burst.announced = true;
      announce('Burst ' + burst.n + ' finished: ' + line);
    }
  }

  function renderBatchChips(box, batches) {
    box.replaceChildren();
    box.hidden = batches.size === 0;
    if (!batches.size) return;
    const label = document.createElement('span');
    label.className = 'muted';
    label.textContent = 'Batch sizes ';
    box.append(label);
    for (const b of batches.values()) {
      const chip = document.createElement('span');
      chip.className = 'batch-chip' + (b.size > 1 ? ' batched' : '');
      chip.dataset.testid = 'batch-chip';
      chip.dataset.size = String(b.size);
      chip.textContent = String(b.size);
      chip.title = (b.id !== undefined ? 'Batch #' + b.id + ': ' : '') + b.ours + ' of this burst in a batch of ' + b.size;
      box.append(chip);
    }
  }

  // ---------------------------------------------------------------- form wiring

  function updateCounter() {
    const text = el.text.value;
    const masks = lib.countOccurrences(text, state.maskToken);
    const l = limits();
    const chars = lib.codePoints(text);  // as the server counts (§3), not UTF-16 units
    const parts = [plural(masks, 'mask', 'masks')];
    parts.push(chars + (l.max_text_chars ? ' / ' + l.max_text_chars : '') + ' characters');
    el.textCount.textContent = parts.join(' · ');
    el.textCount.dataset.chars = String(chars);
    const bad = masks === 0 || (l.max_masks && masks > l.max_masks) || (l.max_text_chars && chars > l.max_text_chars);
    el.textCount.classList.toggle('warn', Boolean(bad && text.length));
  }

  function updateOptionsBrief() {
    const targets = lib.parseTargets(el.targets.value);
    const parts = [];
    if (targets && targets.length) parts.push(plural(targets.length, 'target', 'targets'));
    if (el.deadline.value.trim()) parts.push('deadline ' + el.deadline.value.trim() + ' ms');
    el.optionsBrief.textContent = parts.length ? '(' + parts.join(', ') + ')' : '(none)';
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
    if (!el.text.value.trim()) {
      showNotice('Type a sentence first.');
      el.text.focus();
      return;
    }
    const fields = readRequest();
    if (!fields) return;
    showNotice('');
    // The server checks the text (mask count, length) and answers on the card: it is the authority.
    sendRequest(fields, null);
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
  el.targets.addEventListener('input', updateOptionsBrief);
  el.deadline.addEventListener('input', updateOptionsBrief);

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

  el.cancelAll.addEventListener('click', () => {
    const recs = cancellable();
    recs.forEach(cancelRequest);
    announce('Asked the server to cancel ' + plural(recs.length, 'request', 'requests') + '; those already running finish.');
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
    state.label = { kind: 'connecting', text: 'Connecting…' };
    showNotice('');
    connect();
  });

  el.reconnectNow.addEventListener('click', () => { state.attempt = 0; connect(); });

  el.clear.addEventListener('click', () => {
    for (const item of Array.from(el.cards.children)) {
      if (!itemBusy(item)) item.remove();
    }
    el.empty.hidden = el.cards.children.length > 0;
    el.burstStatus.textContent = '';
  });

  el.liveInterval.addEventListener('change', () => {
    if (state.stats.supported === true) subscribeStats();  // sending it again changes the interval
  });
  document.addEventListener('visibilitychange', () => {
    // Nobody is looking at a hidden tab: stop the stats frames until it is shown again.
    if (document.hidden) unsubscribeStats();
    else if (!state.stats.subscribed) subscribeStats();
  });

  el.frameLog.addEventListener('toggle', () => {
    if (el.frameLog.open) renderLog();
    else el.logList.replaceChildren();  // a closed log costs nothing to keep up to date
  });
  el.logHideStats.addEventListener('change', () => {
    el.logList.classList.toggle('hide-stats', el.logHideStats.checked);
  });
  el.logClear.addEventListener('click', () => {
    state.log.clear();
    el.logList.replaceChildren();
    updateLogCount();
  });

  // For the browser test and the console: feed the page a frame as if the server had sent it, and
  // reach the frame log (its bound can be lowered to watch it drop old frames).
  window.FillMaskDemo = {
    receive(text) { if (state.conn) onFrame(state.conn, text); },
    frameLog: state.log,
  };

  el.live.open = WIDE.matches;  // on a phone the live view starts folded (its summary line still updates)
  state.url = resolveUrl();
  updateCounter();
  updateOptionsBrief();
  updateInflight();
  updateLogCount();
  connect();
})();
