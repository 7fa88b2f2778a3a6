// Package listencheck holds what the relay listeners of both forms share to prove, after LISTEN,
// that they receive notifications: they send one of their own on their channel, the way the
// other instances' notifications come, and wait for it.
package listencheck

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"
)

// Timeout bounds the wait of a listener for its own notification.
const Timeout = 5 * time.Second

// Token returns the payload of a listener's own notification, unique to the attempt: a
// notification that reached the listener by another way (delivered to its connection while it
// ran LISTEN on a server process, behind a pooler, that had listened before) proves nothing.
func Token() (string, error) {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("listener check token: %w", err)
	}
	return "outbox-listener-check-" + hex.EncodeToString(b[:]), nil
}
