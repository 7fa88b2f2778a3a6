// Package postgres is the PostgreSQL driver of the outbox framework. It works through database/sql
// with lib/pq or pgx's stdlib, and uses ON CONFLICT claims, SKIP LOCKED, advisory locks and
// asynchronous commits for the dispatched marks.
package postgres
