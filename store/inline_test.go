package store

import (
	"reflect"
	"testing"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

func TestEffectsRoundTrip(t *testing.T) {
	src := outboxdriver.Source{Consumer: "c", ID: "m"}
	in := []outboxdriver.Effect{
		{Seq: 0, Kind: "", Topic: "t", UUID: "u1", Payload: []byte{0, 1, 0xff}, Metadata: map[string]string{"a": "\x00b", "": ""}, OrderingKey: "c/m", Source: src},
		{Seq: 7, Kind: "mail", UUID: "u2", Payload: []byte{}, Metadata: map[string]string{}, OrderingKey: "k", Source: src},
	}
	b := EncodeEffects(in)
	out, err := DecodeEffects(b, src)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(in, out) {
		t.Fatalf("round trip:\n in %+v\nout %+v", in, out)
	}
	for cut := 0; cut < len(b); cut++ {
		if _, err := DecodeEffects(b[:cut], src); err == nil {
			t.Fatalf("a truncated encoding (%d of %d bytes) decoded", cut, len(b))
		}
	}
	if _, err := DecodeEffects(append(b, 0), src); err == nil {
		t.Fatal("trailing bytes decoded")
	}
}
