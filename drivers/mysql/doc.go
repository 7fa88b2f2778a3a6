// Package mysql is the MySQL and MariaDB driver of the outbox framework (MySQL 8.0+, MariaDB
// 10.6+), on database/sql with github.com/go-sql-driver/mysql. It is a module of its own, so that
// a service on PostgreSQL never downloads the MySQL client.
//
// # Opening the database
//
// Register go-sql-driver/mysql and put DSNParams in the connection string:
//
//	import _ "github.com/go-sql-driver/mysql"
//
//	db, err := sql.Open("mysql", "app:secret@tcp(db:3306)/orders?"+mysql.DSNParams)
//	// DSNParams = "parseTime=true&interpolateParams=true&charset=utf8mb4"
//	ob, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: pub})
//
// Config.Schema names the database of the outbox tables; empty means the connection's own.
// The tables are InnoDB, utf8mb4. Identifiers (message IDs, consumers, topics, ordering keys,
// idempotency scopes and keys, cancel keys) are binary strings, VARBINARY and BLOB: they compare
// byte for byte, as on PostgreSQL ("a", "a " and " a" are three messages, as are "é" composed and
// decomposed). A text collation would not do: utf8mb4_bin pads with spaces ('a' = 'a '), and no
// collation that does not has one name on MySQL 8 and MariaDB. The bytes are those the connection
// sends, UTF-8 under DSNParams (charset=utf8mb4).
// Migrate creates them (and the database, when Schema names one) under GET_LOCK, so that many
// instances may start at once; MySQL commits DDL implicitly, so every statement of a migration
// is idempotent and a migration interrupted half way is completed by the next Migrate.
//
// # How it differs from PostgreSQL
//
//   - The claim is a plain read, then INSERT IGNORE: a second copy of a message waits on the
//     first one's claim and sees its outcome, as on PostgreSQL, under REPEATABLE READ (MySQL's
//     default) and READ COMMITTED alike. When the first one rolls back, the copies that waited
//     may deadlock among themselves (1213): the framework runs their units of work again at
//     once (IsRetryable, also for a lock wait timeout, 1205), without counting a failed attempt.
//   - A deadlock rolls back the whole transaction and MySQL then runs the session's next
//     statements in autocommit mode: a handler must return the error of a failed statement, not
//     go on (on PostgreSQL the transaction would refuse every statement after it).
//   - No notifications: the relays of other processes find handed-over effects at their next
//     poll (Config.RelayInterval); the relay of the process that handed them over is woken at
//     once. The relay claims with SELECT ... FOR UPDATE SKIP LOCKED, so relays of several
//     processes share the work.
//   - Dispatched effects stay in the effects table, marked, until cleanup deletes them after
//     EffectRetention (or at the next cleanup when it is zero). Cleanup deletes in batches of
//     Config.CleanupBatchSize; one process cleans at a time (a lock row taken FOR UPDATE SKIP
//     LOCKED).
//   - No savepoint can be told apart: every insert of effects is checked before the commit (one
//     more statement per unit of work with effects).
//   - A statement carries at most max_allowed_packet bytes (16 MiB on MariaDB, 64 MiB on MySQL 8
//     by default): a unit of work's effects are inserted 1,000 per statement, so their payloads
//     must fit.
//   - Timestamps are DATETIME(6) in UTC (UTC_TIMESTAMP), whatever the session's time zone.
//   - An idempotency key is locked with GET_LOCK of a hashed name, a lock of the session: a keyed
//     unit of work runs on a connection reserved for it, which releases the lock after the
//     transaction has ended (or is closed when it cannot). Claims of one key take turns on it and
//     never deadlock on the key's row.
//   - Delayed effects are moved by the relay in a READ COMMITTED transaction that takes the due
//     ones FOR UPDATE SKIP LOCKED: a unit of work that cancels one holds it, and once its cancel
//     commits the effect is never sent.
package mysql
