package store

import (
	"maps"
	"testing"
)

func FuzzMetadataRoundTrip(f *testing.F) {
	f.Add("k", "v", "nul\x00", "\xff\xfe")
	f.Add("", "", "", "")
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		md := map[string]string{k1: v1, k2: v2}
		got, err := DecodeMetadata(EncodeMetadata(md))
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(got, md) {
			t.Fatalf("got %q want %q", got, md)
		}
	})
}

func FuzzDecodeMetadataNeverPanics(f *testing.F) {
	f.Add([]byte{1, 1, 'k', 1, 'v'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := DecodeMetadata(b)
		if err == nil {
			if _, err := DecodeMetadata(EncodeMetadata(md)); err != nil {
				t.Fatal(err)
			}
		}
	})
}
