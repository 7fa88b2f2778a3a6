// Package outbox gives Watermill consumers exactly-once effects: every incoming message changes the
// database once, and every message or side effect it causes is delivered at least once with a
// stable ID, through an inbox (processed-ID claims) and an outbox committed in one transaction.
package outbox
