// Package idempotency is net/http middleware that makes POST and PATCH requests idempotent with
// the Idempotency-Key header (IETF draft-ietf-httpapi-idempotency-key-header): each request runs
// its handler in an outbox unit of work keyed by the header within its caller's scope (Config.Caller:
// keys belong to the caller who sent them), and a retry with the same key and request gets the first
// response back (status, selected headers, body) without running again.
package idempotency
