// Package pgtest provides a throwaway PostgreSQL server for tests: call Run from TestMain,
// then DSN or DB in each test to get a fresh, isolated database that is dropped on cleanup.
// Set OUTBOX_TEST_DSN to use an existing server instead of starting one (it must allow CREATE DATABASE).
package pgtest
