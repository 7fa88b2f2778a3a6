// Package storetest is the conformance suite of outboxdriver.Store: every driver's tests call Run with a
// Harness for their database, and a driver is done when the suite passes. Where a dialect
// legitimately cannot do something (listen for notifications, share relay work between
// instances), the Harness says so and the suite checks the documented degraded behaviour instead.
// The tenant package's tests run it on members of a tenant.Set (a prefix or a schema on the pool
// of other members, or a database of its own) while the other members handle traffic of their
// own.
package storetest
