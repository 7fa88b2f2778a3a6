package idempotency

import (
	"bytes"
	"fmt"
	"net/http"
	"reflect"
	"testing"
)

// A stored response reads back as it was stored, and one cut anywhere before its body is refused
// as unreadable rather than read with headers missing (or read past its end).
func TestStoredRoundTripAndTruncation(t *testing.T) {
	s := stored{Status: 201, Header: http.Header{"Location": {"/orders/7"}, "Etag": {`"a"`, `"b"`}}, Body: []byte("body \x00\xff")}
	b, err := encodeStored(s)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeStored(b)
	if err != nil || !reflect.DeepEqual(got, s) {
		t.Fatalf("decoded %+v, %v; want %+v", got, err, s)
	}
	head := len(b) - len(s.Body)
	for n := range head {
		if got, err := decodeStored(b[:n]); err == nil {
			t.Errorf("cut to %d of the %d bytes before the body: decoded %+v, want an error", n, head, got)
		}
	}
	// A count larger than what follows is refused before anything is allocated for it.
	huge := append([]byte(storedMagic), 201, 0xff, 0xff, 0xff, 0xff, 0x0f)
	if _, err := decodeStored(huge); err == nil {
		t.Error("a header count larger than the response: decoded, want an error")
	}
	if got, err := decodeStored(bytes.Clone(b[:head])); err != nil || len(got.Body) != 0 || got.Status != 201 {
		t.Errorf("a response without a body: %+v, %v", got, err)
	}
}

// A stored status net/http cannot send (below 200: informational, or none; above 999) is refused
// as unreadable: replayed, it made net/http panic and drop the connection at every retry of the
// key for as long as the key lived (a row written by another version, or by hand).
func TestStoredStatusOutOfRangeIsRefused(t *testing.T) {
	for _, status := range []int{0, 42, 103, 1000} {
		b := append([]byte(storedMagic), byte(status&0x7f|0x80*min(status>>7, 1)))
		if status >= 128 {
			b = append(b, byte(status>>7))
		}
		b = append(b, 0) // no header
		if got, err := decodeStored(b); err == nil {
			t.Errorf("a stored status %d: decoded %+v, want an error", status, got)
		}
		if got, err := decodeStored([]byte(`{"status":` + fmt.Sprint(status) + `}`)); err == nil {
			t.Errorf("a stored status %d in JSON: decoded %+v, want an error", status, got)
		}
	}
}
