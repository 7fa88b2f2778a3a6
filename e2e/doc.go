// Package e2e holds the end-to-end tests that run the framework across real brokers (RabbitMQ and
// Redis Streams from Debian's packages, started by the tests on loopback), consumer processes
// that are killed and restarted, and broker crashes; and, with the OpenTelemetry SDK and a
// Prometheus exporter, the telemetry scenario and the instrumentation benchmark. Its
// subpackages hold the other tests whose dependencies the library must not carry: nats (NATS
// JetStream in process), pgx (pgx's database/sql driver), sqlite (the SQLite driver over
// modernc.org/sqlite), console (the web console in headless Chromium) and failover (a PostgreSQL
// primary killed and its streaming standby promoted, both forms); internal/natstest is their
// in-process NATS set-up. It is a module of its own, so that none of these enters the library's
// go.mod (scripts/depcheck.sh checks it).
package e2e
