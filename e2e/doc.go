// Package e2e holds the end-to-end tests that run the framework across real brokers (RabbitMQ and
// Redis Streams from Debian's packages, started by the tests on loopback), consumer processes
// that are killed and restarted, and broker crashes. It is a module of its own, so that the
// broker clients never enter the library's go.mod.
package e2e
