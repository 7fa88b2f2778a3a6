package outboxpgx

import "time"

// SetListenTimings shortens how long the listener waits before it pings its connection, and how
// long the ping may take; the returned function restores them.
func SetListenTimings(idle, ping time.Duration) (restore func()) {
	oldIdle, oldPing := listenIdle.Swap(int64(idle)), listenPingTimeout.Swap(int64(ping))
	return func() { listenIdle.Store(oldIdle); listenPingTimeout.Store(oldPing) }
}
