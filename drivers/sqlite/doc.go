// Package sqlite is the SQLite driver of the outbox framework, for runs with nothing to set up: the
// outbox tables live in the application's SQLite file, next to its business tables. It works
// through database/sql with a driver the program registers (modernc.org/sqlite, tested, or
// mattn/go-sqlite3); the library imports neither.
//
// # Opening the database
//
// Open the DB with DSN (or add DSNParams to your own connection string):
//
//	import _ "modernc.org/sqlite"
//
//	db, err := sql.Open("sqlite", sqlite.DSN("orders.db"))
//	// = "orders.db?_txlock=immediate&_busy_timeout=10000&_journal_mode=WAL&_synchronous=FULL"
//	ob, err := outbox.New(outbox.Config{DB: db, Driver: sqlite.Driver{}, Publisher: pub})
//
// _txlock=immediate is required: every transaction then takes the write lock at BEGIN, and a
// second copy of a message waits there (up to busy_timeout) for the first one's outcome. Without
// it a transaction that reads before it writes (the relay, a handler that SELECTs first) fails
// with "database is locked" whenever another connection wrote in between, instead of waiting.
// Use a file, not ":memory:" (each connection would get its own database).
//
// # How it differs from PostgreSQL
//
// SQLite has a single writer and no SKIP LOCKED, advisory locks, NOTIFY or schemas:
//
//   - Write transactions of all processes take turns. A second copy of a message waits for the
//     first one's transaction, as on PostgreSQL, but so does every other message: throughput is
//     that of one writer.
//   - The relay holds the write lock for a whole round, while it publishes. Relays of several
//     processes do not share the work, they take turns; and handlers wait while a round runs.
//     Keep rounds short (Config.RelayBatchSize, Config.PublishTimeout) and busy_timeout longer
//     than a round; a handler that waits longer fails with "database is locked" and is redelivered.
//     For the same reason an applier or a Publisher must not write to the same database file (the
//     watermill-sql publisher on it, say): called by the relay, it would wait for the lock the
//     relay holds until busy_timeout, and fail every time.
//   - Cleanup does not skip when another process cleans: its batches take turns with the other's.
//   - No notifications: the relays of other processes find handed-over effects at their next poll
//     (Config.RelayInterval); the relay of the process that handed them over is woken at once.
//   - No schemas: Config.Schema must be empty or "main"; tell table sets apart with TablePrefix.
//   - One connection (db.SetMaxOpenConns(1)) is often faster than several waiting on busy_timeout
//     (whose retries sleep up to 100 ms); then an applier must not use the same *sql.DB (the relay
//     holds the only connection while it runs appliers).
//   - Timestamps are UTC TEXT with millisecond precision, compared as strings; payloads and
//     metadata are BLOBs, stored byte for byte.
//
// As on PostgreSQL, identifiers (message IDs, consumers, ordering keys, idempotency and cancel
// keys) compare byte for byte: they are TEXT in SQLite's default collation, BINARY (memcmp),
// which neither pads nor folds ("a" and "a " are two messages).
package sqlite
