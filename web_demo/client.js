/* Fill-mask demo page: the WebSocket client, with no DOM (window.FillMask.client; also a CommonJS
 * module, so Node can test it).
 *
 * Wire format: protocol.md at the repository root (section numbers below refer to it).
 *
 * Each connection has one explicit state, changed only by transition():
 *
 *   connecting --hello--> open --going_away--> draining
 *        \________________\_______________________\___close__> closed
 *
 * - connecting: the socket is opening, or open without its hello yet; nothing is sent.
 * - open: hello came; requests go here (the Client's `current` connection).
 * - draining: going_away came (§10). It only receives the answers still owed on it; nothing more is
 *   sent on it, and a new connection is opened after a random delay within reconnect_within_ms.
 * - closed: final. Requests still in flight on it are lost (the server drops them, §8).
 *
 * Invariants the Client keeps:
 * - Request ids only grow and are never reused (not even on a later connection), so a late frame
 *   about an old request can never land on a newer one.
 * - A request belongs to the connection it was sent on, and is settled exactly once: by its terminal
 *   frame on that connection, or when that connection closes.
 * - At most one connection is `current` (connecting or open); any number may be draining.
 * - While no connection is current, exactly one reconnection is scheduled (unless the URL is bad).
 */
'use strict';

(function (root) {
  // ---------------------------------------------------------------- the wire's tables

  /** Every `overloaded` reason (§6) with its status and what to tell a person. Checked against
   *  protocol/schemas/overloaded.json by tests/test_web_demo.py. */
  const OVERLOAD_REASONS = Object.freeze({
    queue_full: { status: 503, text: 'The server queue is full' },
    shutting_down: { status: 503, text: 'The server is shutting down' },
    engine_stopped: { status: 503, text: "The server's model worker stopped" },
    deadline_exceeded: { status: 504, text: 'The deadline passed while the request waited' },
    queue_share: { status: 429, text: 'This page holds its share of the server queue (the server keeps room for other clients)' },
  });

  /** Every `error` code (§7), with a few words on what it means. Checked against
   *  protocol/schemas/defs.json (error_code) by tests/test_web_demo.py. */
  const ERROR_CODES = Object.freeze({
    invalid_json: 'the frame was not valid JSON',
    not_an_object: 'the frame was not a JSON object',
    binary_frame: 'the frame was binary, not text',
    missing_field: 'a required field is missing',
    unknown_type: 'the server does not know this frame type',
    invalid_id: 'the id is not a valid request id',
    duplicate_id: 'a request with this id is still in flight',
    invalid_field: 'a field has the wrong type or value',
    text_too_long: 'the text is longer than the server allows',
    no_mask: 'the text has no mask token',
    too_many_masks: 'the text has more masks than the server allows',
    invalid_top_k: 'top_k is out of range',
    invalid_targets: 'the targets are not valid',
    invalid_deadline: 'the deadline is out of range',
    too_many_inflight: 'this connection has too many requests in flight',
    result_too_large: 'the result would be larger than the server sends',
    internal_error: 'the server failed on this request',
  });

  /** What an overloaded frame means for a person: "The server queue is full". */
  function overloadText(reason) {
    const known = Object.prototype.hasOwnProperty.call(OVERLOAD_REASONS, reason) ? OVERLOAD_REASONS[reason] : null;
    return known ? known.text : 'The server is overloaded';
  }

  // ---------------------------------------------------------------- connection state

  const State = Object.freeze({
    CONNECTING: 'connecting',
    OPEN: 'open',
    DRAINING: 'draining',
    CLOSED: 'closed',
  });

  const TRANSITIONS = Object.freeze({
    connecting: Object.freeze({ hello: State.OPEN, going_away: State.DRAINING, close: State.CLOSED }),
    open: Object.freeze({ going_away: State.DRAINING, close: State.CLOSED }),
    draining: Object.freeze({ close: State.CLOSED }),
    closed: Object.freeze({}),
  });

  /**
   * The state after `event` ('hello', 'going_away' or 'close'): the one place a connection's state
   * changes. An event that means nothing in a state (a second hello, a going_away while draining,
   * anything after close) leaves it as it is.
   */
  function transition(state, event) {
    const next = TRANSITIONS[state];
    if (!next) throw new Error('unknown connection state: ' + state);
    return Object.prototype.hasOwnProperty.call(next, event) ? next[event] : state;
  }

  /** The protocol version this page speaks (hello.protocol, §2). */
  const PROTOCOL_VERSION = 1;

  /** The most a server's hint (retry_after_ms, reconnect_within_ms) makes the page wait, as the Python client. */
  const MAX_HINT_MS = 60000;

  /** A server's wait hint in ms (retry_after_ms, reconnect_within_ms) held to [0, MAX_HINT_MS];
   *  `fallback` when it is not a number. */
  function hintMs(value, fallback) {
    const given = Number(value);
    return Number.isFinite(given) ? Math.min(Math.max(given, 0), MAX_HINT_MS) : fallback;
  }

  /** Delay before reconnection attempt `attempt` (0, 1, ...): exponential, capped, ±20% jitter. */
  function backoffMs(attempt, firstMs, maxMs, random) {
    return Math.min(maxMs, firstMs * 2 ** attempt) * (0.8 + 0.4 * random());
  }

  const WS_OPEN = 1;  // WebSocket.OPEN, the same in browsers and in Node's ws package

  /**
   * The length of `text` in UTF-8 bytes: what the server counts against hello.limits.max_frame_bytes
   * (§1, §14), not String.length's UTF-16 units ("é" is 1 unit and 2 bytes, "😀" 2 units and 4 bytes).
   * A lone surrogate counts 3, as the U+FFFD a browser sends for it (JSON.stringify escapes them anyway).
   */
  function utf8Bytes(text) {
    let n = 0;
    for (let i = 0; i < text.length; i++) {
      const c = text.charCodeAt(i);
      if (c < 0x80) n += 1;
      else if (c < 0x800) n += 2;
      else if (c >= 0xd800 && c <= 0xdbff && (text.charCodeAt(i + 1) & 0xfc00) === 0xdc00) { n += 4; i++; }
      else n += 3;
    }
    return n;
  }

  // ---------------------------------------------------------------- the client

  /**
   * One page's connection to one server address, kept up by itself: reconnects with backoff,
   * follows a drain (§10), and routes every terminal frame to its request.
   *
   * options: {url, WebSocket (constructor), on (callbacks, all optional, see emit() calls), and
   * for tests: setTimeout, clearTimeout, random, now, backoffFirstMs, backoffMaxMs, lastedMs}.
   *
   * Callbacks: status(s) whenever what the page should say about the connection may have changed;
   * log(dir, text, type) for every frame sent ('out') and received ('in') and every connection event
   * ('event'); hello(msg); stats(msg); settle(rec, outcome, msg) once per request (outcome 'result',
   * 'error', 'overloaded', 'cancelled', or 'lost' with msg {code} the close code); strayError(msg);
   * goingAway(msg, owed); handshakeFailed(url, attempt); badUrl(url); notJson(data).
   */
  class Client {
    constructor(options) {
      this.WebSocket = options.WebSocket;
      this.on = options.on || {};
      this.setTimeout = options.setTimeout || ((f, ms) => setTimeout(f, ms));
      this.clearTimeout = options.clearTimeout || ((t) => clearTimeout(t));
      this.random = options.random || Math.random;
      this.now = options.now || Date.now;
      this.backoffFirstMs = options.backoffFirstMs || 500;
      // At most 5 s (+20%) between attempts: a restart takes a server 8-20 s to load its model, and a
      // longer wait after it is ready is what a person watching the page sees.
      this.backoffMaxMs = options.backoffMaxMs || 5000;
      this.lastedMs = options.lastedMs || 5000;  // a connection this long resets the backoff
      // An attempt without a hello by then is given up and retried with the backoff (0: never): a
      // server that accepts TCP but never answers the handshake, or never says hello, would
      // otherwise hold the page on "Connecting" for good.
      this.helloTimeoutMs = options.helloTimeoutMs ?? 10000;
      this.url = options.url || '';
      this.badUrl = false;       // the WebSocket constructor refused this.url (not an address): no retry
      this.current = null;       // the connection new requests go to (connecting or open), or null
      this.draining = new Set(); // connections after going_away, until they close
      this.attempt = 0;          // reconnections since the last connection that lasted
      this.openedAt = 0;         // when the current connection's hello came (0: none)
      this.everConnected = false;
      this.restarting = false;   // a going_away came and no hello since
      this.retryAt = 0;          // when the scheduled reconnection runs (0: none scheduled)
      this.retryTimer = null;
      this.lastClose = null;     // {code, reason, opened} of the last current connection that closed
      this.nextId = 1;
      this.inflight = new Map(); // id -> request record
    }

    emit(name, ...args) {
      const f = this.on[name];
      if (typeof f === 'function') f(...args);
    }

    // ------------------------------------------------ what the page shows

    /** The current connection's hello, or null while not open. */
    get hello() { return this.current && this.current.state === State.OPEN ? this.current.hello : null; }

    /** True when a request sent now would go out. */
    get isOpen() {
      return Boolean(this.current && this.current.state === State.OPEN && this.current.ws.readyState === WS_OPEN);
    }

    /** The state to show: the current connection's, else 'draining' while one drains, else 'closed'. */
    get state() {
      if (this.current) return this.current.state;
      return this.draining.size ? State.DRAINING : State.CLOSED;
    }

    status() {
      return {
        state: this.state, url: this.url, attempt: this.attempt, retryAt: this.retryAt,
        restarting: this.restarting, everConnected: this.everConnected, lastClose: this.lastClose,
        badUrl: this.badUrl,
      };
    }

    /** The largest frame the current server takes (hello.limits.max_frame_bytes, §2), in UTF-8 bytes;
     *  Infinity while there is no hello or it names none. */
    get maxFrameBytes() {
      const limits = this.hello && this.hello.limits;
      const most = limits && limits.max_frame_bytes;
      return Number.isInteger(most) && most > 0 ? most : Infinity;
    }

    // ------------------------------------------------ connecting

    /** Connect now; given a `url`, to it, afresh (no backoff or history carried over). The current
     *  connection, if any, is closed and its requests are lost, once the new one could be made: an
     *  address the WebSocket constructor refuses (not a URL, or ws:// from an https page: its
     *  SecurityError) changes nothing but `badUrl`, and is reported with the error's name. */
    connect(url) {
      const target = url !== undefined ? url : this.url;
      let ws;
      try {
        ws = new this.WebSocket(target);
      } catch (err) {
        // Nothing to retry until another URL is given; a connection still open stays (a typo in the
        // address field must not cost the requests in flight).
        this.badUrl = true;
        this.emit('badUrl', target, (err && err.name) || 'SyntaxError');
        this.emit('status', this.status());
        return;
      }
      this.badUrl = false;
      if (url !== undefined) {
        this.url = url;
        this.attempt = 0;
        this.everConnected = false;
        this.restarting = false;
        this.lastClose = null;
      }
      this.cancelRetry();
      if (this.current) {
        const old = this.current;
        this.current = null;
        this.closeConnection(old, { code: 1000, reason: '', wasClean: true });
        old.ws.close(1000);
        if (this.current) {  // a callback of the lost requests connected meanwhile: that connection stays
          ws.onopen = ws.onmessage = ws.onerror = ws.onclose = () => {};
          ws.close(1000);
          return;
        }
      }
      const conn = { url: this.url, ws, state: State.CONNECTING, hello: null, opened: false };
      this.current = conn;
      if (this.helloTimeoutMs > 0) {
        conn.helloTimer = this.setTimeout(() => this.onNoHello(conn), this.helloTimeoutMs);
      }
      this.emit('log', 'event', 'connecting to ' + redactToken(conn.url), 'connection');
      conn.ws.onopen = () => { conn.opened = true; };
      conn.ws.onmessage = (event) => this.onMessage(conn, event.data);
      conn.ws.onclose = (event) => this.onSocketClose(conn, event);
      conn.ws.onerror = () => { /* a close event always follows; it is handled there */ };
      this.emit('status', this.status());
    }

    /** Reconnect now instead of waiting for the scheduled attempt. */
    retryNow() {
      this.attempt = 0;
      this.connect();
    }

    cancelRetry() {
      if (this.retryTimer !== null) this.clearTimeout(this.retryTimer);
      this.retryTimer = null;
      this.retryAt = 0;
    }

    scheduleRetry(delay) {
      this.cancelRetry();
      this.retryAt = this.now() + delay;
      this.retryTimer = this.setTimeout(() => {
        this.retryTimer = null;
        this.retryAt = 0;
        this.connect();
      }, delay);
    }

    advance(conn, event) {
      conn.state = transition(conn.state, event);
    }

    stopHelloTimer(conn) {
      if (conn.helloTimer) this.clearTimeout(conn.helloTimer);
      conn.helloTimer = null;
    }

    /** No hello within helloTimeoutMs: give this attempt up, as if the connection had dropped. */
    onNoHello(conn) {
      conn.helloTimer = null;
      if (conn !== this.current || conn.state !== State.CONNECTING) return;
      const why = 'no hello within ' + this.helloTimeoutMs / 1000 + ' s';
      conn.ws.close();
      this.onSocketClose(conn, { code: 1006, reason: why });
    }

    /** The current connection's hello came more than lastedMs ago. */
    lasted() {
      return Boolean(this.openedAt) && this.now() - this.openedAt > this.lastedMs;
    }

    /** The wait before the next reconnection, advancing `attempt`: the backoff starts over only after
     *  a connection that lasted (a server that accepts and then drops every connection must not be
     *  hammered twice a second). */
    nextBackoffMs() {
      if (this.lasted()) this.attempt = 0;
      this.openedAt = 0;
      const delay = backoffMs(this.attempt, this.backoffFirstMs, this.backoffMaxMs, this.random);
      this.attempt += 1;
      return delay;
    }

    /** A connection is closed (by either side): its requests are lost. Idempotent. */
    closeConnection(conn, event) {
      this.stopHelloTimer(conn);
      if (conn.state === State.CLOSED) return;
      this.advance(conn, 'close');
      this.draining.delete(conn);
      for (const rec of Array.from(this.inflight.values())) {
        if (rec.conn === conn) this.settle(rec, 'lost', { code: event.code || 1006 });
      }
    }

    onSocketClose(conn, event) {
      const wasCurrent = conn === this.current;
      const wasClosed = conn.state === State.CLOSED;
      this.emit('log', 'event', 'closed' + (event.code ? ' with ' + event.code : '') +
        (event.reason ? ': ' + event.reason : '') + (conn.opened ? '' : ' (the handshake failed)'), 'connection');
      // No longer current before its lost requests' callbacks run: one of them may connect() at once.
      if (wasCurrent && !wasClosed) this.current = null;
      this.closeConnection(conn, event);
      if (!wasCurrent || wasClosed) {  // a drained connection, or one replaced by connect()
        this.emit('status', this.status());
        return;
      }
      this.lastClose = { code: event.code || 1006, reason: event.reason || '', opened: conn.opened };
      if (this.current) {  // a callback connected meanwhile: no reconnection to schedule
        this.emit('status', this.status());
        return;
      }
      const delay = this.nextBackoffMs();
      // A restart that takes this long is no longer a restart.
      if (this.restarting && this.attempt > 4) this.restarting = false;
      this.scheduleRetry(delay);
      this.emit('status', this.status());
      if (!conn.opened) this.emit('handshakeFailed', conn.url, this.attempt);
    }

    // ------------------------------------------------ frames in

    onMessage(conn, data) {
      if (conn.state === State.CLOSED) return;
      let msg;
      try {
        msg = JSON.parse(data);
      } catch (err) {
        this.emit('log', 'in', data, 'not JSON');
        this.emit('notJson', data);
        return;
      }
      const type = msg && typeof msg === 'object' && typeof msg.type === 'string' ? msg.type : '';
      this.emit('log', 'in', data, type);
      if (!type) return;
      if (type === 'hello') { this.onHello(conn, msg); return; }
      if (type === 'going_away') { this.onGoingAway(conn, msg); return; }
      if (type === 'stats') { if (conn === this.current && conn.state === State.OPEN) this.emit('stats', msg); return; }
      // §7: duplicate_id is about a frame that reused an id in flight, never that request's answer.
      const aboutAnother = type === 'error' && msg.code === 'duplicate_id';
      const rec = msg.id === null || msg.id === undefined || aboutAnother ? undefined : this.inflight.get(msg.id);
      if (!rec || rec.conn !== conn) {
        // An error about no request of ours (id null), or a frame for a request already settled.
        if (type === 'error' && conn === this.current) this.emit('strayError', msg);
        return;
      }
      if (type === 'result' || type === 'error' || type === 'overloaded' || type === 'cancelled') {
        this.settle(rec, type, msg);
      }
      // §1: other frame types are ignored
    }

    onHello(conn, msg) {
      if (conn !== this.current || conn.state !== State.CONNECTING) return;
      if (msg.protocol !== PROTOCOL_VERSION) {
        // §14: a server of another protocol version gets a close with 1000 and no retry: nothing this
        // page would send means there what it means here. connect() (Retry now) tries again.
        this.current = null;
        this.cancelRetry();
        this.closeConnection(conn, { code: 1000, reason: '', wasClean: true });
        conn.ws.close(1000);
        this.emit('incompatible', msg.protocol);
        this.emit('status', this.status());
        return;
      }
      this.stopHelloTimer(conn);
      conn.hello = msg;
      this.advance(conn, 'hello');
      this.openedAt = this.now();
      this.everConnected = true;
      this.restarting = false;
      this.lastClose = null;
      this.cancelRetry();
      this.emit('hello', msg);
      this.emit('status', this.status());
    }

    /**
     * §10: the server is draining. Requests already accepted are still answered on this connection,
     * so it stays open (receiving only) while a new one is opened after a random delay within
     * reconnect_within_ms (full jitter: many pages must not all come back at the same moment).
     */
    onGoingAway(conn, msg) {
      if (conn !== this.current) return;
      this.advance(conn, 'going_away');
      this.current = null;
      this.draining.add(conn);
      this.restarting = true;
      // A server that says going_away soon after every hello must not get a reconnect per hint: after
      // a connection that did not last, the backoff's next step is the least wait (nextBackoffMs), and
      // the hint is held to [0, MAX_HINT_MS] (§14: a client bounds what it is told to wait).
      const within = hintMs(msg.reconnect_within_ms, 1000);
      if (this.lasted()) {
        this.attempt = 0;
        this.openedAt = 0;
        this.scheduleRetry(this.random() * within);
      } else {
        const delay = this.nextBackoffMs();
        this.scheduleRetry(Math.max(delay, this.random() * within));
      }
      const owed = Array.from(this.inflight.values()).filter((r) => r.conn === conn).length;
      this.emit('status', this.status());
      this.emit('goingAway', msg, owed);
    }

    // ------------------------------------------------ frames out

    /** Send a frame on the open current connection; false (nothing sent) when there is none, or when
     *  the frame is larger than the server takes (§1: it would close the connection with 1009, and
     *  every request in flight on it would be lost). */
    send(frame) {
      if (!this.isOpen) return false;
      const text = JSON.stringify(frame);
      if (utf8Bytes(text) > this.maxFrameBytes) return false;
      this.current.ws.send(text);
      this.emit('log', 'out', text, frame.type);
      return true;
    }

    /** Send one fill_mask request with `fields`. Returns its record {id, frame, conn, data, ...}, or
     *  null (nothing sent) while not open. `data` is the caller's, carried along. A frame larger than
     *  the server's max_frame_bytes is not sent: its record comes back settled, with `tooBig` {bytes,
     *  limit} and outcome 'too_big' (its id is used up, never sent; the connection and the requests
     *  in flight on it are untouched). */
    request(fields, data) {
      if (!this.isOpen) return null;
      const id = this.nextId++;
      const frame = Object.assign({ type: 'fill_mask', id: id }, fields);
      const rec = { id, frame, conn: this.current, url: this.current.url, data, cancelAsked: false, outcome: null };
      const bytes = utf8Bytes(JSON.stringify(frame));
      if (bytes > this.maxFrameBytes) {
        rec.conn = null;
        rec.outcome = 'too_big';
        rec.tooBig = { bytes, limit: this.maxFrameBytes };
        return rec;
      }
      this.inflight.set(id, rec);
      this.send(frame);
      return rec;
    }

    /** Requests a cancel can still reach: in flight on the current connection, not yet cancelled. */
    cancellable() {
      return Array.from(this.inflight.values()).filter((r) => r.conn === this.current && !r.cancelAsked);
    }

    /** Ask the server to cancel `rec` (§5); false when that can no longer reach it. */
    cancel(rec) {
      if (!this.inflight.has(rec.id) || rec.cancelAsked || rec.conn !== this.current) return false;
      if (!this.send({ type: 'cancel', id: rec.id })) return false;
      rec.cancelAsked = true;
      return true;
    }

    settle(rec, outcome, msg) {
      if (!this.inflight.delete(rec.id)) return;
      rec.outcome = outcome;
      this.emit('settle', rec, outcome, msg);
    }
  }

  /**
   * `url` with the value of its `token` query parameter (the server's access token, §9) written as ***,
   * or with the parameter left out when `keep` is false: for everything the page shows or keeps (the
   * frame log, tooltips, notices, its own address and history), so that the secret stays in memory.
   * A `url` without a token comes back unchanged; one that does not parse has its `token=` values
   * hidden (or cut) as text.
   */
  function redactToken(url, keep = true) {
    let parsed;
    try {
      parsed = new URL(url);
    } catch (err) {
      return String(url).replace(/([?&])tok(?:en|%65n)=[^&#]*(&?)/gi,
        (all, before, after) => (keep ? before + 'token=***' + after : (after ? before : '')));
    }
    if (!parsed.searchParams.has('token')) return url;
    if (keep) parsed.searchParams.set('token', '***');
    else parsed.searchParams.delete('token');
    return parsed.toString();
  }

  const api = { redactToken, utf8Bytes, State, transition, backoffMs, Client, OVERLOAD_REASONS, ERROR_CODES, overloadText, MAX_HINT_MS, hintMs, PROTOCOL_VERSION };
  if (typeof module === 'object' && module.exports) module.exports = api;
  else (root.FillMask = root.FillMask || {}).client = api;
})(typeof window !== 'undefined' ? window : globalThis);
