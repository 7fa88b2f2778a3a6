// Package store implements the outbox storage contract (outboxdriver.Store) over database/sql: the
// queries of one dialect, embedded numbered migrations, validated table names and a binary-safe
// metadata encoding. Dialects live in the drivers/ packages.
package store
