// Talking to kvik's HTTP API. The API key lives in sessionStorage: this tab only, gone when the tab
// closes, sent only in the Authorization header (never a cookie, so no request a foreign page makes
// can carry it: nothing to forge, no CSRF token needed).
const KEY_ITEM = 'kvik.apiKey';

export const auth = {
  get key() {
    return sessionStorage.getItem(KEY_ITEM);
  },
  set key(value) {
    if (value) sessionStorage.setItem(KEY_ITEM, value);
    else sessionStorage.removeItem(KEY_ITEM);
  },
  headers() {
    const key = this.key;
    return key ? {Authorization: `Bearer ${key}`} : {};
  },
};

/** An error answer of the API, in OpenAI's shape, with what the page needs to explain it. */
export class ApiError extends Error {
  constructor(status, error = {}, retryAfterS = null) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.type = error.type || null;
    this.code = error.code || null;
    this.param = error.param || null;
    this.retryAfterS = retryAfterS;
  }
}

export async function errorFromResponse(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's error page): the status says enough
  }
  const retry = Number.parseInt(response.headers.get('retry-after') || '', 10);
  return new ApiError(response.status, body?.error || {}, Number.isFinite(retry) ? retry : null);
}

/** fetch + JSON with the key; throws ApiError for any non-2xx answer. */
export async function api(path, {method = 'GET', body, signal, key} = {}) {
  const headers = key !== undefined ? (key ? {Authorization: `Bearer ${key}`} : {}) : auth.headers();
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let response;
  try {
    response = await fetch(path, {method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
      credentials: 'omit', cache: 'no-store'});
  } catch (exc) {
    if (exc.name === 'AbortError') throw exc;
    throw new ApiError(0, {message: 'The server cannot be reached. Check that it is running.'});
  }
  if (!response.ok) throw await errorFromResponse(response);
  return response.status === 204 ? null : response.json();
}

/** A sentence a person can act on, for any ApiError (429s and quota said kindly). */
export function explain(error) {
  if (!(error instanceof ApiError)) return String(error?.message || error);
  if (error.status === 429) {
    if (error.code === 'insufficient_quota' || /budget/i.test(error.message)) {
      return 'This API key has used its token budget. Ask your administrator to raise it.';
    }
    const wait = error.retryAfterS ? ` Try again in ${error.retryAfterS} s.` : ' Try again in a moment.';
    return `Slow down a little: this key's rate limit was reached.${wait}`;
  }
  if (error.status === 401) return 'The API key was not accepted. Sign in again.';
  if (error.status === 403) return error.message || 'This API key may not do that.';
  if (error.status === 503) return `The server is busy or still loading.${error.retryAfterS ? ` Retrying in ${error.retryAfterS} s is a good idea.` : ''}`;
  if (error.status === 0) return error.message;
  return error.message;
}
