// A small JavaScript client of the fill-mask WebSocket protocol.
//
// Written from the machine-readable contract alone: protocol/asyncapi.yaml (its operations and
// messages, named below as `operation` / `message`) and the JSON Schemas it references under
// protocol/schemas/. It is not derived from the project's Python client or server code.
//
// Runs in Node.js 20 or later (with the `ws` package: `npm install` in this folder) and, unchanged, in
// browsers and Node.js 22+, which have a standard WebSocket of their own.
//
//   import { FillMaskClient } from './fillmask-client.mjs';
//   const client = await FillMaskClient.connect('ws://localhost:8765/');
//   const perMask = await client.fill('Paris is the [MASK] of France.', { topK: 3 });
//   client.close();

/** The protocol version this client speaks (`hello.protocol`). */
export const PROTOCOL = 1;
/** Frames that end a request (the reply of operation `receiveFillMask`). */
const TERMINAL = new Set(['result', 'error', 'overloaded', 'cancelled']);

const WebSocketImpl = globalThis.WebSocket ?? (await import('ws')).WebSocket;

/** A request that did not end in a `result`: the terminal frame says why (`error`, `overloaded`,
 *  `cancelled`), or the connection ended first (`frame` is null then). */
export class FillMaskError extends Error {
  constructor(message, frame = null) {
    super(message);
    this.name = 'FillMaskError';
    this.frame = frame;
  }

  /** The error code (`error`) or the reason (`overloaded`), when the server sent one. */
  get code() {
    return this.frame?.code ?? this.frame?.reason ?? null;
  }

  /** `overloaded` frames say when to try again; anything else has no advice. */
  get retryAfterMs() {
    return this.frame?.retry_after_ms ?? null;
  }
}

/** Characters as the protocol counts them: Unicode code points, not UTF-16 units. */
export function codePoints(text) {
  return Array.from(text).length; // string iteration yields code points
}

/** `result.predictions` as one list per mask: a text with one mask gets one list of candidates, a text
 *  with several gets a list per mask; the first element tells them apart (is it an array?). */
export function perMask(predictions) {
  return predictions.length > 0 && Array.isArray(predictions[0]) ? predictions : [predictions];
}

export class FillMaskClient {
  /**
   * Open a connection and wait for its `hello` (operation `sendHello`, always the first frame).
   * A server of another protocol version is incompatible: the connection is closed (1000) and the
   * promise rejects. `token`: the server's `--token`, sent as `Authorization: Bearer` where the
   * WebSocket implementation can set headers (Node's `ws`), else as the `token` query parameter.
   */
  static async connect(url, { token = null, openTimeoutMs = 10_000 } = {}) {
    const target = new URL(url);
    let options;
    if (token !== null) {
      if (WebSocketImpl === globalThis.WebSocket) target.searchParams.set('token', token);
      else options = { headers: { Authorization: `Bearer ${token}` } };
    }
    // No subprotocol (the server negotiates none); `ws` reads messages up to 100 MiB by default,
    // far above the largest result (hello.limits.max_result_bytes plus a 1 KiB envelope).
    const socket = options ? new WebSocketImpl(target, options) : new WebSocketImpl(target);
    const client = new FillMaskClient(socket);
    let timer;
    try {
      await Promise.race([
        client.#helloReceived,
        new Promise((_, reject) => {
          timer = setTimeout(() => reject(new FillMaskError(`no hello from ${url} within ${openTimeoutMs} ms`)),
            openTimeoutMs);
        }),
      ]);
    } catch (error) {
      client.close();
      throw error;
    } finally {
      clearTimeout(timer);
    }
    return client;
  }

  #socket;
  #pending = new Map(); // request id -> {resolve} until its terminal frame
  #nextId = 1;
  #helloReceived;
  #goingAway = null;

  /** Called with each `stats` frame while subscribed (operation `sendStats`). */
  onStats = null;
  /** Called with the `going_away` frame (operation `sendGoingAway`); by default nothing more is sent here. */
  onGoingAway = null;
  /** Called with an `error` frame that names no request of ours (`id` null: a frame we sent was unreadable). */
  onUnattributedError = null;
  /** Resolves with {code, reason} once the connection has closed. */
  closed;

  constructor(socket) {
    this.#socket = socket;
    this.hello = null;
    let helloResolve;
    let helloReject;
    this.#helloReceived = new Promise((resolve, reject) => {
      helloResolve = resolve;
      helloReject = reject;
    });
    this.closed = new Promise((resolve) => {
      socket.addEventListener('close', (event) => {
        const why = `connection closed (${event.code}${event.reason ? `: ${event.reason}` : ''})`;
        helloReject(new FillMaskError(why));
        for (const { resolve: settle } of this.#pending.values()) settle({ closed: true, why });
        this.#pending.clear();
        resolve({ code: event.code, reason: event.reason });
      });
    });
    socket.addEventListener('error', () => {}); // a 'close' event always follows; it settles everything
    socket.addEventListener('message', (event) => {
      if (typeof event.data !== 'string') return; // the server sends text frames only
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        return;
      }
      if (frame === null || typeof frame !== 'object' || typeof frame.type !== 'string') return;
      if (this.hello === null) {
        if (frame.type !== 'hello' || frame.protocol !== PROTOCOL) {
          helloReject(new FillMaskError(frame.type === 'hello'
            ? `the server speaks protocol ${frame.protocol}; this client speaks ${PROTOCOL}`
            : `expected hello first, got ${frame.type}`, frame));
          socket.close(1000);
          return;
        }
        this.hello = frame;
        helloResolve(frame);
        return;
      }
      this.#dispatch(frame);
    });
  }

  #dispatch(frame) {
    if (TERMINAL.has(frame.type)) {
      // duplicate_id answers only the frame it rejected: the request in flight keeps its own answer.
      if (frame.type === 'error' && frame.code === 'duplicate_id') return;
      if (frame.id === null) {
        this.onUnattributedError?.(frame);
        return;
      }
      const waiting = this.#pending.get(frame.id);
      if (waiting === undefined) return; // not ours (a frame for an id we never sent)
      this.#pending.delete(frame.id);
      waiting.resolve({ frame });
    } else if (frame.type === 'stats') {
      this.onStats?.(frame);
    } else if (frame.type === 'going_away') {
      this.#goingAway = frame;
      this.onGoingAway?.(frame);
    }
    // Frames of any other type come from a later protocol version: ignored, as the contract says.
  }

  /** The limits in force (`hello.limits`). */
  get limits() {
    return this.hello.limits;
  }

  /** Requests sent and not yet answered. */
  get inFlight() {
    return this.#pending.size;
  }

  /**
   * Send one `fill_mask` (operation `receiveFillMask`) and return {id, answer}: `answer` resolves with
   * its terminal frame (`result`, `error`, `overloaded` or `cancelled`), or with {closed, why} when
   * the connection ended first. The request is checked against `hello.limits` first (RangeError).
   */
  send(text, { topK = null, targets = null, deadlineMs = null } = {}) {
    if (this.#goingAway !== null) {
      throw new FillMaskError('the server is going away: connect again (to it or another one)', this.#goingAway);
    }
    this.#check(text, topK);
    const id = this.#nextId++; // a safe integer, written as JSON integer digits by JSON.stringify
    const frame = { type: 'fill_mask', id, text };
    if (topK !== null) frame.top_k = topK;
    if (targets !== null) frame.targets = targets;
    if (deadlineMs !== null) frame.deadline_ms = deadlineMs;
    const answer = new Promise((resolve) => this.#pending.set(id, { resolve }));
    this.#socket.send(JSON.stringify(frame));
    return { id, answer };
  }

  /** Fill the masks of `text`: the candidates per mask (a list of lists), or a FillMaskError. */
  async fill(text, options = {}) {
    const { frame, closed, why } = await this.send(text, options).answer;
    if (closed) throw new FillMaskError(why);
    if (frame.type === 'result') return perMask(frame.predictions);
    if (frame.type === 'error') throw new FillMaskError(`${frame.code}: ${frame.message}`, frame);
    if (frame.type === 'overloaded') {
      throw new FillMaskError(`overloaded (${frame.status} ${frame.reason}); retry after ${frame.retry_after_ms} ms`,
        frame);
    }
    throw new FillMaskError(`request ${frame.id} was cancelled`, frame);
  }

  /** Cancel a request still queued (operation `receiveCancel`); its answer is then `cancelled`. A request
   *  already running keeps its `result`: either way its `answer` settles once. */
  cancel(id) {
    this.#socket.send(JSON.stringify({ type: 'cancel', id }));
  }

  /** Ask for `stats` frames every `intervalMs` (operation `receiveSubscribeStats`). */
  subscribeStats(intervalMs = this.hello.stats.default_interval_ms) {
    this.#socket.send(JSON.stringify({ type: 'subscribe_stats', interval_ms: intervalMs }));
  }

  /** Stop the `stats` frames (operation `receiveUnsubscribeStats`). */
  unsubscribeStats() {
    this.#socket.send(JSON.stringify({ type: 'unsubscribe_stats' }));
  }

  /** Close the connection normally (1000); requests still in flight settle with {closed}. */
  close() {
    if (this.#socket.readyState <= 1) this.#socket.close(1000);
    return this.closed;
  }

  #check(text, topK) {
    const limits = this.hello.limits;
    const length = codePoints(text);
    if (length < 1 || length > limits.max_text_chars) {
      throw new RangeError(`the text has ${length} characters; the server takes 1 to ${limits.max_text_chars}`);
    }
    const masks = text.split(this.hello.mask_token).length - 1;
    if (masks < 1 || masks > limits.max_masks) {
      throw new RangeError(`the text has ${masks} ${this.hello.mask_token}; the server takes 1 to ${limits.max_masks}`);
    }
    if (topK !== null && (!Number.isInteger(topK) || topK < limits.top_k.min || topK > limits.top_k.max)) {
      throw new RangeError(`top_k must be an integer from ${limits.top_k.min} to ${limits.top_k.max}`);
    }
  }
}
