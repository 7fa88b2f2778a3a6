// Package outbox gives Watermill consumers exactly-once effects: every incoming message changes the
// database once, and every message or side effect it causes is delivered at least once with a
// stable ID, through an inbox (processed-ID claims) and an outbox committed in one transaction.
//
// # The calls you need
//
// Set up one Outbox per process, on the database that holds your business tables:
//
//	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: publisher})
//	err = ob.Migrate(ctx) // creates or upgrades the outbox tables; safe from every instance
//	go ob.Run(ctx)        // the relay and the cleanup, in every instance
//
// Wrap each consumer's handler function with the middleware (package middleware; innermost by
// construction, inside any Retry or PoisonQueue), and in the handler write through the message's
// transaction and record what the message causes:
//
//	router.AddConsumerHandler("reserve-stock", "orders", subscriber, middleware.WrapConsumer(ob, func(msg *message.Message) error {
//		ctx := msg.Context()
//		if _, err := outbox.Tx(ctx).ExecContext(ctx, `UPDATE stock ...`); err != nil {
//			return err
//		}
//		return outbox.Publish(ctx, "stock.reserved", message.NewMessage(watermill.NewUUID(), payload))
//	}))
//
// The claim that the message was processed, the business writes and the recorded messages commit
// together; the messages are sent after the commit, before the incoming message is acked, with
// the same UUIDs on every re-send. A redelivered message skips the handler and re-sends what is
// still pending. Outside a consumer (an HTTP handler, a job), Outbox.InTx gives the same: one
// transaction, messages sent after it commits; Outbox.JoinTx joins a transaction you own.
//
// Custom side effects (an e-mail, a call to another service) are recorded with Record and applied
// after the commit by an Applier registered with Outbox.RegisterApplier, at least once, with a
// stable Effect.UUID to use as an idempotency key.
//
// # Operating it
//
// Outbox.ParkedEffects, RetryParked and DiscardParked resolve what could not be sent;
// ReplayPoisoned lets a poisoned message run again. Outbox.Stats samples the tables, Outbox.Health
// (and HealthHandler) reports what an on-call engineer needs, and the OpenTelemetry metrics and
// spans (Config.MeterProvider, Config.TracerProvider) show the rest: see docs/observability.md.
//
// # Packages
//
//   - middleware: the Watermill HandlerMiddleware, and CheckRouter for unsafe middleware orders.
//   - tenant: a Set of Outboxes, one per tenant or shard database (or table prefix), whose
//     middleware runs each message on the member it resolves to.
//   - drivers/postgres and drivers/sqlite: the databases (lib/pq or pgx's database/sql driver for
//     PostgreSQL; an embedded SQLite for runs with nothing to set up).
//   - drivers/outboxpgx (a module of its own): the pgx v5 form, for handlers that write through a
//     pgx.Tx (outboxpgx.Tx), with BEGIN and the claim, and the side effects and COMMIT, each in one
//     round trip (docs/pgx.md).
//   - outboxtest: test your handlers with the outbox on: a PostgreSQL per test, a recording
//     Publisher, and a crash matrix that checks your handler is applied once under every failure.
//   - outboxdriver: the contract a database driver implements (driver authors only), with store
//     (SQL over database/sql) and store/storetest (the conformance suite).
//
// The guarantees, what they require of a handler and what they do not cover are in
// docs/guarantees.md; every option in docs/configuration.md; the settings each broker needs in
// docs/brokers.md.
package outbox
