// Package storetest is the conformance suite of outboxdriver.Store: every driver's tests call Run with a
// Harness for their database, and a driver is done when the suite passes. Where a dialect
// legitimately cannot do something (listen for notifications, share relay work between
// instances), the Harness says so and the suite checks the documented degraded behaviour instead.
package storetest
