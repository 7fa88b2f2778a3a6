package idempotency

import (
	"bytes"
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
