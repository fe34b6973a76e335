// Streaming completions: over one WebSocket (docs/websocket.md) when it works, else over HTTP with
// server-sent events. Both give the same callbacks:
//   onStart({requestId}), onChunk(chunk), onError(ApiError), onDone(status)
// where status is 'completed', 'cancelled' or 'failed', and onDone always comes last, once.
import {ApiError, auth, errorFromResponse} from './api.js';

const CONNECT_TIMEOUT_MS = 4000;
const WS_RETRY_AFTER_MS = 30000;

/** Streams over HTTP (fetch + ReadableStream); cancel() aborts the request. */
export function streamOverHttp(path, body, handlers) {
  const controller = new AbortController();
  let finished = false;
  const done = (status) => {
    if (!finished) {
      finished = true;
      handlers.onDone(status);
    }
  };
  (async () => {
    let response;
    try {
      response = await fetch(path, {method: 'POST', signal: controller.signal, credentials: 'omit', cache: 'no-store',
        headers: {'Content-Type': 'application/json', Accept: 'text/event-stream', ...auth.headers()},
        body: JSON.stringify({...body, stream: true})});
    } catch (exc) {
      if (exc.name === 'AbortError') return done('cancelled');
      handlers.onError(new ApiError(0, {message: 'The server cannot be reached.'}));
      return done('failed');
    }
    if (!response.ok) {
      handlers.onError(await errorFromResponse(response));
      return done('failed');
    }
    handlers.onStart({requestId: response.headers.get('x-request-id')});
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    let sawDone = false;
    let failed = false;
    try {
      for (;;) {
        const {value, done: end} = await reader.read();
        if (end) break;
        buffer += decoder.decode(value, {stream: true}).replace(/\r\n/g, '\n');
        let cut;
        while ((cut = buffer.indexOf('\n\n')) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = event.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
          if (!data) continue;
          if (data === '[DONE]') {
            sawDone = true;
            continue;
          }
          let chunk;
          try {
            chunk = JSON.parse(data);
          } catch {
            continue;
          }
          if (chunk.error && !chunk.object) {
            failed = true;
            handlers.onError(new ApiError(500, chunk.error));
          } else {
            handlers.onChunk(chunk);
          }
        }
      }
    } catch (exc) {
      if (exc.name === 'AbortError') return done('cancelled');
      handlers.onError(new ApiError(0, {message: 'The connection broke during the answer.'}));
      return done('failed');
    }
    done(sawDone && !failed ? 'completed' : 'failed');
  })();
  return {cancel: () => controller.abort()};
}

/** One WebSocket per endpoint, shared by every stream of the page; reconnects on demand. */
export class SocketClient {
  constructor(path) {
    this.path = path;
    this.socket = null;
    this.ready = null; // Promise<WebSocket> while connecting or open
    this.streams = new Map(); // stream_id -> handlers
    this.counter = 0;
    this.failedAt = 0;
  }

  get usable() {
    return typeof WebSocket !== 'undefined' && Date.now() - this.failedAt > WS_RETRY_AFTER_MS;
  }

  connect() {
    if (this.ready) return this.ready;
    const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}${this.path}`;
    this.ready = new Promise((resolve, reject) => {
      const socket = new WebSocket(url);
      const timer = setTimeout(() => {
        socket.close();
        reject(new Error('WebSocket connect timeout'));
      }, CONNECT_TIMEOUT_MS);
      socket.addEventListener('open', () => {
        // Browsers cannot set headers on a WebSocket: the key is the first message instead.
        socket.send(JSON.stringify({type: 'auth', api_key: auth.key || undefined}));
      });
      socket.addEventListener('message', (event) => {
        let message;
        try {
          message = JSON.parse(event.data);
        } catch {
          return;
        }
        if (message.type === 'session.created') {
          clearTimeout(timer);
          this.socket = socket;
          resolve(socket);
          return;
        }
        if (message.type === 'error' && !message.stream_id && !this.socket) {
          clearTimeout(timer);
          reject(new ApiError(message.status || 400, message.error));
          return;
        }
        this.dispatch(socket, message);
      });
      socket.addEventListener('close', () => {
        clearTimeout(timer);
        if (this.socket !== socket) reject(new Error('WebSocket closed'));
        this.dropSocket(socket);
      });
      socket.addEventListener('error', () => {
        // `close` follows and does the clean-up
      });
    });
    this.ready.catch(() => {
      this.ready = null;
    });
    return this.ready;
  }

  dropSocket(socket) {
    if (this.socket === socket) this.socket = null;
    this.ready = null;
    for (const [id, handlers] of this.streams) {
      if (handlers.socket !== socket) continue;
      this.streams.delete(id);
      handlers.onError(new ApiError(0, {message: 'The connection closed during the answer.'}));
      handlers.onDone('failed');
    }
  }

  dispatch(socket, message) {
    if (message.type === 'ping') {
      socket.send(JSON.stringify({type: 'pong', ts: message.ts}));
      return;
    }
    const handlers = this.streams.get(message.stream_id);
    if (!handlers) return;
    switch (message.type) {
      case 'response.created':
        handlers.onStart({requestId: message.request_id});
        break;
      case 'error':
        handlers.onError(new ApiError(message.status || 500, message.error, message.retry_after_s ?? null));
        break;
      case 'response.done':
        this.streams.delete(message.stream_id);
        handlers.onDone(message.status);
        break;
      default:
        handlers.onChunk(message);
    }
  }

  /** Start a stream; resolves to {cancel()} once sent, rejects if the socket cannot be used. */
  async stream(body, handlers) {
    const socket = await this.connect();
    const streamId = `s${++this.counter}-${Math.random().toString(36).slice(2, 8)}`;
    this.streams.set(streamId, {...handlers, socket});
    socket.send(JSON.stringify({...body, stream: undefined, type: 'response.create', stream_id: streamId}));
    return {
      cancel: () => {
        if (this.streams.has(streamId) && socket.readyState === WebSocket.OPEN) {
          socket.send(JSON.stringify({type: 'response.cancel', stream_id: streamId}));
        }
      },
    };
  }

  close() {
    this.socket?.close();
  }
}

/** Picks the transport: 'websocket', 'sse' or 'auto' (WebSocket, falling back to SSE). */
export class Transport {
  constructor(path, mode = 'auto') {
    this.path = path;
    this.mode = mode;
    this.socket = new SocketClient(path);
    this.lastUsed = null;
  }

  async stream(body, handlers) {
    if (this.mode !== 'sse' && (this.mode === 'websocket' || this.socket.usable)) {
      try {
        const stream = await this.socket.stream(body, handlers);
        this.lastUsed = 'websocket';
        return stream;
      } catch (exc) {
        if (exc instanceof ApiError && (exc.status === 401 || exc.status === 403)) throw exc;
        if (this.mode === 'websocket') throw exc;
        this.socket.failedAt = Date.now();
      }
    }
    this.lastUsed = 'sse';
    return streamOverHttp(this.path, body, handlers);
  }

  reset() {
    this.socket.close();
    this.socket = new SocketClient(this.path);
  }
}
