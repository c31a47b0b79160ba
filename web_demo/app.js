/* Fill-mask demo page: one WebSocket, many requests in flight, every reply shown on its own card.
 *
 * Wire format: protocol.md at the repository root (section numbers below refer to it). The
 * connection (its states, reconnection, drains, request ids, which request a frame answers) is
 * client.js, which has no DOM; pure helpers live in lib.js (text, tokens, snippets, accounting,
 * diagnosis) and live.js (the stats panel). This file is the page: it draws what client.js reports.
 * Plain scripts, no build step and no modules, so the page also works opened from disk.
 *
 * Invariants the code keeps:
 * - Every server string reaches the page through textContent, never as HTML.
 * - Every request's card is settled exactly once, when client.js settles the request (its terminal
 *   frame, or its connection closed): client.js's invariants (ids never reused, a request belongs to
 *   the connection it was sent on, nothing sent on a draining connection) hold for the cards too.
 */
'use strict';

(function () {
  const FillMask = window.FillMask;
  const lib = FillMask.lib;
  const live = FillMask.live;
  const { State, Client, overloadText, ERROR_CODES, hintMs, redactToken } = FillMask.client;
  const { formatScore, formatMs, plural } = lib;

  const MAX_ITEMS = 100;           // top-level cards kept (a burst is one); unanswered ones always stay
  const BURST_MAX = 64;             // the most sentences one burst sends (fewer if the server allows fewer in flight)
  const MAX_REQUEST_CARDS = 500;   // request cards kept in all, a burst's included (memory: each holds a DOM)
  const MAX_OURS = 1024;          // batch ids of this page's results remembered for the timeline
  const LOG_MAX_ENTRIES = 500;
  const LOG_MAX_CHARS = 2000;
  const CARD_TEXT_CHARS = 300;    // a card shows this much of its text until "Show all" is pressed
  const FILLED_CONTEXT_CHARS = 60; // and, of a text that long, this much on each side of a filled mask
  const PROBE_TIMEOUT_MS = 3000;
  const STALL_MS = 10000;         // requests waiting and no answer for this long: the status says so
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
    live: $('live'), liveInterval: $('live-interval'), liveStale: $('live-stale'),
    inflight: $('inflight'), cancelAll: $('cancel-all'), clear: $('clear'), empty: $('empty'), cards: $('cards'),
    burstForm: $('burst-form'), burstSize: $('burst-size'), burstSend: $('burst-send'), burstStatus: $('burst-status'),
    serverInfo: $('server-info'), limits: $('limits'), serverForm: $('server-form'), wsUrl: $('ws-url'), wsError: $('ws-error'),
    frameLog: $('frame-log'), logList: $('log-list'), logCount: $('log-count'), logDropped: $('log-dropped'),
    logHideStats: $('log-hide-stats'), logClear: $('log-clear'),
    notice: $('notice'), announcer: $('announcer'),
    cardTemplate: $('card-template'), burstTemplate: $('burst-template'),
  };

  // The connection, its state, the requests in flight and their ids: client.js. What is here is the page's.
  const state = {
    maskToken: '[MASK]',
    diagnosis: null,       // {kind, text} from the last failed handshake's probe, until a hello or a new URL
    countdownTimer: 0,
    nextBurst: 1,
    newestOwn: null,       // the latest request the user sent (not a burst's)
    stats: { supported: null, subscribed: false, pending: false, history: [], ours: new Set(), last: null },
    log: new lib.FrameLog(LOG_MAX_ENTRIES, LOG_MAX_CHARS),
    startedAt: performance.now(),
    glyphMissing: null,
    lastAnswerAt: 0,       // when the last terminal frame came (performance.now())
    stallMs: STALL_MS,     // (the browser test shortens it)
    stalled: false,        // the status says "no answer for N s" (watchStall)
    urlFromForm: false,    // the address being connected to was typed under "Server and limits"
  };

  // The sticky header's height, for the page's scroll-padding (style.css): an element the keyboard
  // focuses, or a card scrolled into view, stops below the header, however tall zoom or a wrapped
  // line make it (a trial found focus hidden under it: nine Tab stops at 200% zoom).
  const topBar = document.querySelector('.top-bar');
  new ResizeObserver(() => {
    document.documentElement.style.setProperty('--header-height', topBar.offsetHeight + 'px');
  }).observe(topBar);

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

  function limits() { return (client.hello && client.hello.limits) || {}; }

  function readable(tokenStr) {
    if (!state.glyphMissing) {
      state.glyphMissing = lib.glyphProbe('600 16px ' + getComputedStyle(document.body).fontFamily);
    }
    return lib.readableToken(tokenStr, state.glyphMissing);
  }

  // ---------------------------------------------------------------- raw-frame log

  function logFrame(dir, text, type) {
    const entry = state.log.add(dir, text, type, performance.now() - state.startedAt);
    const removed = state.log.takeRemoved();  // (old stats frames: they keep a share of the log)
    if (el.frameLog.open) {
      for (const seq of removed) el.logList.querySelector('[data-seq="' + seq + '"]')?.remove();
      appendLogEntry(entry);
    }
    updateLogCount();
  }

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
    // An address (a bookmark, history) that holds a token: used once, no longer kept.
    if (param && redactToken(param, false) !== param) keepInAddress(param);
    if (param) return normaliseUrl(param);
    if (window.location.protocol === 'http:' || window.location.protocol === 'https:') {
      return (window.location.protocol === 'https:' ? 'wss://' : 'ws://') + window.location.host + '/';
    }
    return DEFAULT_WS_FROM_DISK;
  }

  /**
   * Write `url` as the page's own ?ws= (so a reload connects there again), without its token: the
   * address, history and bookmarks keep no secret (a reload's request line would carry it too), and
   * after a reload the token must be given again.
   */
  function keepInAddress(url) {
    const params = new URLSearchParams(window.location.search);
    params.set('ws', redactToken(url, false));
    try {
      window.history.replaceState(null, '', '?' + params.toString() + window.location.hash);
    } catch (err) {
      // Some browsers refuse history changes on file:// pages; the connection works regardless.
    }
  }

  /** Take ?ws= out of the page address (it named no usable WebSocket URL). */
  function dropFromAddress() {
    const params = new URLSearchParams(window.location.search);
    if (!params.has('ws')) return;
    params.delete('ws');
    const query = params.toString();
    try {
      window.history.replaceState(null, '', (query ? '?' + query : window.location.pathname) + window.location.hash);
    } catch (err) {
      // (file:// pages: as keepInAddress)
    }
  }

  /** Accept ws://h:p, wss://..., http(s)://... (mapped to ws(s)) or a bare host:port (wss:// on an
   *  https page, which browsers allow no ws:// but to loopback). */
  function normaliseUrl(raw) {
    let url = raw.trim();
    if (/^https?:\/\//i.test(url)) url = url.replace(/^http/i, 'ws');
    else if (!/^wss?:\/\//i.test(url)) {
      const loopback = /^(localhost|127\.[\d.]+|\[::1\])(:|\/|$)/i.test(url);  // (ws:// allowed there from https)
      url = (window.location.protocol === 'https:' && !loopback ? 'wss://' : 'ws://') + url;
    }
    return url;
  }

  /** `text` is announced (it changes only with the state); `detail` (the countdown) is not. `noRetry`:
   *  no "Retry now" (an address that is no WebSocket URL: trying it again does nothing). */
  function setConn(kind, text, detail, noRetry) {
    el.conn.dataset.state = kind;
    if (el.connText.textContent !== text) el.connText.textContent = text;
    el.connDetail.textContent = detail || '';
    el.conn.title = (kind === 'connected' ? 'Connected to ' : '') + redactToken(client.url);
    el.reconnectNow.hidden = kind === 'connected' || kind === 'connecting' || Boolean(noRetry);
    const usable = kind === 'connected';
    el.submit.disabled = !usable;
    el.burstSend.disabled = !usable;
  }

  const RESTARTING = { kind: 'reconnecting', text: 'Server is restarting; reconnecting' };

  /** What the status pill says for the client's status `s` (client.js): {kind, text}. */
  function connLabel(s) {
    if (s.state === State.OPEN) return { kind: 'connected', text: 'Connected' };
    if (s.restarting) return RESTARTING;
    // A diagnosis (refused, offline) stands until the next probe, or a hello, says otherwise.
    if (state.diagnosis) return state.diagnosis;
    if (s.state === State.CONNECTING && !s.everConnected && s.attempt === 0) return { kind: 'connecting', text: 'Connecting…' };
    return { kind: 'reconnecting', text: 'Reconnecting' };
  }

  /** Redraw the connection status (and the live view's "not connected"); while a reconnection is
   *  scheduled, count down to it. */
  function showStatus() {
    window.clearInterval(state.countdownTimer);
    const s = client.status();
    markLive(s.state === State.OPEN);
    const label = connLabel(s);
    if (s.state === State.OPEN) { setConn(label.kind, label.text); return; }
    // No WebSocket URL: nothing is scheduled and nothing to retry until another address is given.
    // (Only while nothing else is under way: a refused address keeps the connection there was, and its
    // scheduled retry, which the status then shows.)
    if (s.badUrl && !s.retryAt && !client.current) { setConn('offline', 'Not a WebSocket URL', '', true); return; }
    if (!s.retryAt) {
      setConn(label.kind, label.text, s.attempt > 0 || s.everConnected ? 'now' : '');
      return;
    }
    const code = s.lastClose && s.lastClose.code !== 1006 ? ' (closed with ' + s.lastClose.code + ')' : '';
    const tick = () => {
      const left = Math.max(0, s.retryAt - Date.now());
      setConn(label.kind, label.text, 'in ' + Math.ceil(left / 1000) + ' s' + code);
    };
    tick();
    state.countdownTimer = window.setInterval(tick, 250);
  }

  function closeReason(code) {
    if (code === 1009) return 'The server closed the connection: a message was too big (1009).';
    if (code === 1001) return 'The server went away (1001) before answering.';
    return 'The connection closed before an answer came; the server drops requests of closed connections.';
  }

  /**
   * A handshake failed: find out why (lib.diagnose) and say it. Browsers hide the refusal's HTTP
   * status, so the page asks the server's /healthz (open to any page): an answer means the server is
   * up and refused this page. Same-origin pages can read /readyz too (draining, engine stopped).
   */
  async function diagnoseFailure(url, attempt) {
    const probe = await probeServer(url);
    if (attempt !== client.attempt || url !== client.url || client.hello) return;  // a newer attempt, or connected
    const s = client.status();
    const verdict = lib.diagnose(Object.assign({
      url: redactToken(url), pageProtocol: window.location.protocol, pageOrigin: window.location.origin,
      restarting: s.restarting, everConnected: s.everConnected, attempts: attempt,
    }, probe));
    state.diagnosis = { kind: verdict.kind, text: verdict.label };
    showStatus();
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
        const body = await response.json().catch(() => null);
        const ready = body && typeof body.status === 'string' ? body.status : null;
        // A fill-mask server answers /readyz with {"status": ...} (§9). A 404, or a success without it,
        // is some other server; a 5xx may be a balancer or an Ingress with no replica yet: unknown.
        const other = ready === null && (response.status === 404 || response.ok);
        return { reachable: true, ready, fillMask: other ? false : undefined,
          unavailable: ready === null && response.status >= 500,
          tokenRequired: ready === 'ready' ? await needsToken(base, controller.signal) : undefined };
      }
      // Cross-origin (a file: page, another port): the answer is opaque, but that it came is enough.
      await fetch(base + '/healthz', { mode: 'no-cors', cache: 'no-store', signal: controller.signal });
      return { reachable: true, ready: null };
    } catch (err) {
      return { reachable: false, ready: null, plainHttp: await answersPlainHttp(url, controller.signal) };
    } finally {
      window.clearTimeout(timer);
    }
  }

  /** Whether the page's own server was started with --token: its /metrics answers 401 without one
   *  (§9), 200 with none set (undefined: it could not tell), so that a refusal can be told apart from
   *  a full server's (--max-connections: a trial found it called a probable token problem). */
  async function needsToken(base, signal) {
    try {
      const response = await fetch(base + '/metrics', { cache: 'no-store', signal });
      return response.status === 401 ? true : response.ok ? false : undefined;
    } catch (err) {
      return undefined;
    }
  }

  /** A wss:// address that TLS could not reach: does the same host and port answer plain HTTP (a server
   *  without --certfile)? Only from an http: page: an https: page may not fetch http: (mixed content). */
  async function answersPlainHttp(url, signal) {
    if (!/^wss:/i.test(url) || window.location.protocol !== 'http:') return false;
    try {
      await fetch(lib.httpBase('ws' + url.slice(3)) + '/healthz', { mode: 'no-cors', cache: 'no-store', signal });
      return true;
    } catch (err) {
      return false;
    }
  }

  function onGoingAway(msg, owed) {
    // A cancel can no longer reach the draining server (§10: it sends nothing more there): its owed
    // cards lose their Cancel button and say their answer is still coming.
    for (const rec of client.inflight.values()) {
      if (rec.card && rec.conn !== client.current) {
        const cancel = rec.card.querySelector('.cancel');
        if (document.activeElement === cancel) rec.card.focus();
        cancel.hidden = true;
        setMessage(rec.card, 'The server is restarting; this answer is still coming on the old connection.');
        if (rec.burst) updateBurst(rec.burst);
      }
    }
    updateInflight();
    announce('The server is restarting; the page reconnects by itself.' +
      (owed ? ' ' + plural(owed, 'request', 'requests') + ' already sent still get their answers.' : ''));
  }

  /** The WebSocket constructor refused `url`: say why under the address field (where it is typed; the
   *  notice at the top is out of view there), and at the top too when the address came from the page's
   *  own ?ws= (at load nobody is looking at the field). The status says it (showStatus). */
  function onBadUrl(url, errorName) {
    const why = lib.wsUrlProblem(url);
    // Chromium's SecurityError: a ws:// address from an https page (loopback excepted), a valid URL.
    const message = errorName === 'SecurityError'
      ? 'This page was loaded over https, and browsers let it open only wss:// connections: "' + redactToken(url) +
        '" is refused. Use the wss:// address (a server started with --certfile), or open the page over http.'
      : '"' + redactToken(url) + '" is not a WebSocket URL' + (why ? ': ' + why : '') +
        '. Enter one like ws://127.0.0.1:8765/ and press Connect.';
    // (Emptied first, so that the same message after a second try is announced again.)
    el.wsError.textContent = '';
    el.wsError.textContent = message;
    el.wsError.hidden = false;
    el.wsUrl.setAttribute('aria-invalid', 'true');
    el.serverInfo.open = true;
    if (state.urlFromForm) {
      // The field is often at the window's bottom edge: bring the line under it into view.
      el.wsError.scrollIntoView({ block: 'nearest', behavior: REDUCED_MOTION.matches ? 'auto' : 'smooth' });
    } else {
      showNotice(message);
      dropFromAddress();  // a link's bad ?ws= would leave every reload stuck on it
    }
  }

  function clearUrlError() {
    el.wsError.textContent = '';
    el.wsError.hidden = true;
    el.wsUrl.removeAttribute('aria-invalid');
  }

  // ---------------------------------------------------------------- frames in

  /** A request's terminal frame came, or its connection closed (outcome 'lost'): client.js settles each once. */
  function onSettle(rec, outcome, msg) {
    state.lastAnswerAt = performance.now();
    switch (outcome) {
      case 'result': onResult(rec, msg); break;
      case 'error': onError(rec, msg); break;
      case 'overloaded': onOverloaded(rec, msg); break;
      case 'cancelled': settle(rec, 'cancelled', 'Cancelled', 'Cancelled while it waited in the queue; the model never saw it.'); break;
      default: settle(rec, 'lost', 'Not answered', msg.code === 1000
        ? 'The connection was closed before an answer came.' : closeReason(msg.code), true);
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

  function onHello(msg) {
    state.diagnosis = null;
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
    showNotice('');
    updateInflight();
    startStats(msg);
  }

  function applyLimits(l) {
    const topK = l.top_k || {};
    if (Number.isInteger(topK.min)) el.topK.min = topK.min;
    if (Number.isInteger(topK.max)) el.topK.max = topK.max;
    if (Number.isInteger(topK.default) && !el.topK.dataset.touched) el.topK.value = topK.default;
    if (Number.isFinite(l.max_deadline_ms)) el.deadline.max = l.max_deadline_ms;
    // A burst larger than the connection may have in flight would be answered too_many_inflight in part.
    const most = Number.isInteger(l.max_inflight_per_connection)
      ? Math.max(2, Math.min(BURST_MAX, l.max_inflight_per_connection)) : BURST_MAX;
    el.burstSize.max = most;
    if (Number(el.burstSize.value) > most) el.burstSize.value = most;
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

  /** On every hello: forget the old server's figures and ask this one for stats if its hello offers
   *  them (protocol §2, §13). The panel shows at once (empty figures until the first stats frame), so
   *  it does not appear under the user's eyes later. A server without hello.stats has no live view,
   *  which is not a fault: the panel stays hidden and nothing is asked. */
  function startStats(msg) {
    Object.assign(state.stats, { subscribed: false, pending: false, history: [], ours: new Set(), last: null });
    const offered = Boolean(msg.stats);
    state.stats.supported = offered ? null : false;
    el.live.hidden = !offered;
    if (!offered) return;
    live.render(el.live, live.view({}, [], { maxBatchSize: limits().max_batch_size }));
    subscribeStats();
  }

  function subscribeStats() {
    if (!client.hello || document.hidden || state.stats.supported === false) return;
    if (!client.send({ type: 'subscribe_stats', interval_ms: Number(el.liveInterval.value) })) return;
    state.stats.subscribed = true;
    state.stats.pending = true;
  }

  function unsubscribeStats() {
    // Only to a server known to have stats: another would answer an error for nothing.
    if (!client.hello || !state.stats.subscribed || state.stats.supported !== true) return;
    if (!client.send({ type: 'unsubscribe_stats' })) return;
    state.stats.subscribed = false;
    state.stats.pending = false;
  }

  /** Grey the live view out, saying "not connected", while there is no open connection: its last
   *  figures are not current. The next stats frame (after a hello) brings it back. */
  function markLive(connected) {
    el.live.dataset.connected = String(connected);
    el.liveStale.hidden = connected;
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
    const v = live.view(frame, state.stats.history, { maxBatchSize: limits().max_batch_size, ours: state.stats.ours });
    // live.js writes the window with one decimal: the 0.25 s interval read "over the last 0.3 s".
    if (v.window) v.window = 'over the last ' + lib.formatSeconds(frame.window_s);
    live.render(el.live, v);
  }

  // ---------------------------------------------------------------- requests

  /** The request fields from the form, or null (with a notice saying why) when they cannot be sent. */
  function readRequest() {
    const fields = { text: el.text.value };
    const topK = readTopK();
    if (topK === undefined) return null;
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

  /** top_k, null for none (the server's default), undefined (after a notice) for something that is not
   *  a number: the browser reads "e", "-" or "3e" in a number field as empty, and the request went
   *  without top_k, its card saying "server default" (a trial's find). */
  function readTopK() {
    if (el.topK.validity.badInput) {
      const topK = limits().top_k || {};
      const range = Number.isInteger(topK.min) && Number.isInteger(topK.max) ? ' from ' + topK.min + ' to ' + topK.max : '';
      showNotice('Top k: give a whole number' + range + ', or leave the field empty for the server\'s default.');
      el.topK.focus();
      return undefined;
    }
    const raw = el.topK.value.trim();
    // Out-of-range values are sent as they are: the server's invalid_top_k answer says the rule.
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
    const sentAt = performance.now();
    const rec = client.request(fields);
    if (!rec) {
      showNotice('Not connected yet; the request was not sent.');
      return null;
    }
    // The page's own fields next to client.js's (id, frame, conn, url, cancelAsked).
    Object.assign(rec, { text: fields.text, maskToken: state.maskToken, burst, kind: 'pending', sentAt,
      doneAt: 0, result: null, card: null, hello: client.hello });
    rec.card = makeCard(rec);
    // Larger than the server takes: client.js sent nothing (the server would have closed the
    // connection with 1009, losing every request in flight on it). Its card says so; no Retry, which
    // would be refused the same way.
    if (rec.tooBig) settle(rec, 'error', 'Not sent', tooBigText(rec.tooBig));
    updateInflight();
    return rec;
  }

  function tooBigText(big) {
    return 'Not sent: as JSON this request is ' + lib.formatCount(big.bytes) + ' bytes, and the server takes ' +
      'frames of at most ' + lib.formatCount(big.limit) + ' bytes (limits.max_frame_bytes). Shorten the text.';
  }

  /** The card's tag: what the request asked for; without a top_k, the server's default (hello, §2). */
  function describeOptions(frame, hello) {
    const tag = [];
    const fallback = hello && hello.limits && hello.limits.top_k && hello.limits.top_k.default;
    if (frame.top_k !== undefined) tag.push('top ' + frame.top_k);
    else if (fallback !== undefined && !frame.targets) tag.push('top ' + fallback + ' (server default)');
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
    const tag = describeOptions(rec.frame, rec.hello);
    if (rec.burst) tag.push('burst ' + rec.burst.n);
    card.querySelector('.card-tag').textContent = tag.join(' · ');
    renderCardText(card, rec);
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
      if (again) (again.tooBig ? again.card : again.card.querySelector('.cancel')).focus();
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

  /**
   * The card's copy of its text: the first CARD_TEXT_CHARS characters, and a button that shows the
   * rest (a 50,000-character text must not make a card thousands of pixels tall).
   */
  function renderCardText(card, rec) {
    const box = card.querySelector('.card-text');
    const toggle = card.querySelector('.text-toggle');
    const clip = lib.clipText(rec.text, CARD_TEXT_CHARS, rec.maskToken);
    toggle.hidden = !clip.more;
    rec.textClipped = clip.more > 0;
    const draw = (all) => {
      rec.showAll = all;
      if (rec.redrawFilled) rec.redrawFilled();
      box.replaceChildren();
      appendWithMasks(box, all ? rec.text : clip.text, rec.maskToken);
      if (!all && clip.more) box.append('…');
      box.dataset.shown = all ? 'all' : 'start';
      toggle.textContent = all ? 'Show less' : 'Show all ' + lib.formatCount(clip.total) + ' characters';
      toggle.setAttribute('aria-expanded', String(all));
    };
    draw(false);
    toggle.addEventListener('click', () => draw(box.dataset.shown !== 'all'));
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

  function cancelRequest(rec) {
    if (!client.cancel(rec)) return;
    const button = rec.card.querySelector('.cancel');
    button.disabled = true;
    button.textContent = 'Cancelling…';
    setBadge(rec.card, 'pending', 'Cancelling');
    updateInflight();
  }

  /** Close a request's story: badge, message, buttons, counters. */
  function settle(rec, kind, label, message, canRetry) {
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
    try {
      if (!groups.every((g) => Array.isArray(g) && g.every((p) => p && typeof p === 'object'))) {
        throw new Error('its predictions are not lists of objects');
      }
      renderMetrics(rec, msg);
      renderNotes(rec, msg);
      renderPredictions(rec, groups);
    } catch (err) {
      // A result the page cannot show still ends its card (every card is settled exactly once).
      rec.card.querySelector('.preds').replaceChildren();
      settle(rec, 'error', 'Error', 'The server sent a result this page cannot read (' + err.message + ').');
      return;
    }
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

  /**
   * result.targets (§4): each target that is not one vocabulary token, and the token scored in its
   * place (its first piece, as the pipeline does), so nobody thinks "new york" itself was scored.
   */
  function renderNotes(rec, msg) {
    const box = rec.card.querySelector('.card-notes');
    const replaced = Array.isArray(msg.targets) ? msg.targets.filter((t) => t && typeof t === 'object') : [];
    box.replaceChildren(...replaced.map((t) => {
      const li = document.createElement('li');
      li.dataset.testid = 'targets-note';
      li.dataset.given = String(t.given);
      li.dataset.scored = String(t.scored);
      const scored = t.scored === null ? '' : readable(String(t.scored)).text;
      // The same word but for case, accents or the tokenizer's word-start mark (an uncased model's
      // "capital" for "Capital"), or only its first piece (the pipeline scores that, §4). Compared as
      // the token is, not as shown (readable() may mark invisible characters).
      const spelling = t.scored !== null && lib.foldWord(String(t.scored)) === lib.foldWord(String(t.given));
      li.textContent = t.scored === null
        ? 'Note: target "' + String(t.given) + '" was ignored: it has no token in the vocabulary.'
        : 'Note: target "' + String(t.given) + '" was scored as "' + scored + '"' + (spelling
          ? ', the vocabulary\'s spelling of it.' : ', its first piece (it is not one token of the vocabulary).');
      return li;
    }));
    box.hidden = replaced.length === 0;
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
    if (rec.hello && rec.hello.random_weights === true) {
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
    rec.redrawFilled = redraw;
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
    let segments = lib.filledSegments(rec.text, rec.maskToken, fills);
    // A long text, not shown in full: only the words around each mask (the card's text is above).
    if (rec.textClipped && !rec.showAll) segments = lib.excerptSegments(segments, FILLED_CONTEXT_CHARS);
    for (const seg of segments) {
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
    // What the code means, from client.js's table of §7 (a code it does not know gets no tooltip).
    rec.card.querySelector('.badge').title = Object.prototype.hasOwnProperty.call(ERROR_CODES, msg.code)
      ? msg.code + ': ' + ERROR_CODES[msg.code] : '';
  }

  function onOverloaded(rec, msg) {
    const wait = hintMs(msg.retry_after_ms, 0);  // held to a minute, as the Python client does
    const reason = overloadText(msg.reason);
    const status = msg.status ? ' (' + msg.status + ')' : '';
    settle(rec, 'overloaded', 'Overloaded' + status, reason + '; retry after ' + formatMs(wait) + '.', true);
    const retry = rec.card.querySelector('.retry');
    rec.card.querySelector('.card-message').dataset.retryAfterMs = String(wait);
    retry.disabled = true;
    window.setTimeout(() => { retry.disabled = false; }, wait);
  }

  function updateInflight() {
    const n = client.inflight.size;
    el.inflight.textContent = n ? plural(n, 'request', 'requests') + ' in flight' : 'none in flight';
    el.inflight.dataset.count = String(n);
    el.cancelAll.disabled = client.cancellable().length === 0;
  }

  /** Keep at most MAX_ITEMS top-level cards and MAX_REQUEST_CARDS request cards, dropping the oldest
   *  finished ones. (Counting a burst as one card let a long session keep 6,400 cards: gigabytes.) */
  function trimCards() {
    const items = Array.from(el.cards.children);  // newest first
    const size = (item) => item.querySelectorAll('[data-testid="request-card"]').length +
      (item.matches('[data-testid="request-card"]') ? 1 : 0);
    let cards = items.reduce((sum, item) => sum + size(item), 0);
    for (let i = items.length - 1; i >= 0 && (i >= MAX_ITEMS || cards > MAX_REQUEST_CARDS); i -= 1) {
      if (itemBusy(items[i])) continue;
      cards -= size(items[i]);
      items[i].remove();
    }
  }

  /** A top-level card with a request still unanswered (a request card, or a burst with one). */
  function itemBusy(item) {
    const ids = item.classList.contains('burst-card')
      ? Array.from(item.querySelectorAll('[data-testid="request-card"]'), (c) => Number(c.dataset.id))
      : [Number(item.dataset.id)];
    return ids.some((id) => client.inflight.has(id));
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
        const code = lib.snippet(language, rec.url, rec.frame);
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
    if (topK === undefined) {
      el.burstStatus.textContent = 'Top k is not a number; nothing was sent.';  // (the notice may be out of view)
      return;
    }
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
    // Offered while a request of it waits on the current connection: one owed on a draining one can no
    // longer be cancelled (onGoingAway).
    card.querySelector('[data-testid="burst-cancel"]').hidden =
      !burst.records.some((r) => client.inflight.get(r.id) === r && r.conn === client.current);
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

  /**
   * A server that stops answering (a stopped process, a model that hangs) may keep its connection open
   * and send nothing: the page said "Connected" and "Waiting" for good. While requests wait and none
   * has been answered for STALL_MS, the status says for how long, until an answer comes.
   */
  function watchStall() {
    let oldest = Infinity;
    for (const rec of client.inflight.values()) if (rec.sentAt < oldest) oldest = rec.sentAt;
    const quiet = oldest === Infinity ? 0 : performance.now() - Math.max(oldest, state.lastAnswerAt);
    if (client.status().state === State.OPEN && quiet >= state.stallMs) {
      const seconds = Math.floor(quiet / 1000);
      if (!state.stalled) announce('No answer from the server for ' + seconds + ' seconds.');
      state.stalled = true;
      el.conn.dataset.stalled = 'true';
      el.connDetail.textContent = 'no answer for ' + seconds + ' s';
    } else if (state.stalled) {
      state.stalled = false;
      delete el.conn.dataset.stalled;
      showStatus();
    }
  }

  // ---------------------------------------------------------------- the connection (client.js)

  const client = new Client({
    WebSocket: window.WebSocket,
    on: {
      status: showStatus,
      log: logFrame,
      hello: onHello,
      stats: onStats,
      settle: onSettle,
      strayError: onStrayError,
      goingAway: onGoingAway,
      handshakeFailed: diagnoseFailure,
      badUrl: onBadUrl,
      notJson: () => showNotice('The server sent a frame that is not JSON; it was ignored.'),
      incompatible: (version) => showNotice('This server speaks protocol ' + String(version).slice(0, 40) +
        '; this page speaks protocol 1, so it closed the connection. Open the demo page that server serves.'),
    },
  });

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
      // Typing in another field (targets, the address...) is left alone: Alt+M there is not for the
      // sentence (and on a Mac it types µ).
      const typing = event.target instanceof Element && event.target.matches('input, textarea, select, [contenteditable]');
      if (typing && event.target !== el.text) return;
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
    // A whole number, as typed: "2.5" was rounded to 3, and "e" (read as empty by the browser) refused
    // only by accident.
    const raw = el.burstSize.value.trim();
    const n = Number(raw);
    const max = Number(el.burstSize.max);
    if (el.burstSize.validity.badInput || raw === '' || !Number.isInteger(n) || n < 2 || n > max) {
      const message = 'A burst is a whole number of sentences, 2 to ' + max + '; nothing was sent.';
      showNotice(message);
      el.burstStatus.textContent = message;  // (next to the form: the notice may be out of view)
      el.burstSize.focus();
      return;
    }
    showNotice('');
    sendBurst(n);
  });

  el.cancelAll.addEventListener('click', () => {
    const recs = client.cancellable();
    recs.forEach(cancelRequest);
    announce('Asked the server to cancel ' + plural(recs.length, 'request', 'requests') + '; those already running finish.');
  });

  el.serverForm.addEventListener('submit', (event) => {
    event.preventDefault();
    const raw = el.wsUrl.value.trim();
    if (!raw) return;
    const url = normaliseUrl(raw);
    showNotice('');
    if (lib.wsUrlProblem(url)) {  // (not even tried: the connection that is open stays open)
      state.urlFromForm = true;
      onBadUrl(url);
      return;
    }
    connectTo(url, true);
    // Only an address the browser takes goes into ?ws= (a bad one made every reload stuck on it).
    if (!client.status().badUrl) keepInAddress(url);
  });

  el.reconnectNow.addEventListener('click', () => client.retryNow());

  el.clear.addEventListener('click', () => {
    for (const item of Array.from(el.cards.children)) {
      if (!itemBusy(item)) item.remove();
    }
    el.empty.hidden = el.cards.children.length > 0;
    el.burstStatus.textContent = '';
  });

  el.liveInterval.addEventListener('change', () => {
    // Sending it again changes the interval (§13), also while the first subscription has had no stats
    // frame yet (supported null: a choice made then was ignored, a trial found). subscribeStats sends
    // nothing to a server without stats, or while not connected (the next hello uses this choice).
    subscribeStats();
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
    receive(text) { if (client.current) client.onMessage(client.current, text); },
    frameLog: state.log,
    client,
    set stallMs(ms) { state.stallMs = ms; },
  };

  /** Connect to `url` afresh: no diagnosis, no backoff carried over from another address. `fromForm`:
   *  typed under "Server and limits" (else the page's own ?ws= or default). */
  function connectTo(url, fromForm) {
    state.diagnosis = null;
    state.urlFromForm = Boolean(fromForm);
    clearUrlError();
    el.wsUrl.value = url;
    client.connect(url);
  }

  el.live.open = WIDE.matches;  // on a phone the live view starts folded (its summary line still updates)
  updateCounter();
  updateOptionsBrief();
  updateInflight();
  updateLogCount();
  window.setInterval(watchStall, 1000);
  connectTo(resolveUrl());
})();
