package ops

import "testing"

func TestFingerprint(t *testing.T) {
	for _, c := range []struct{ a, b string }{
		{`publish 1 message(s) to "invoices": refused for order 4711`, `publish 3 message(s) to "receipts": refused for order 12`},
		{"effect 0b8f8f8e-5a3c-4d6e-9a43-6f75746278a1 timed out after 30s", "effect 1c9f8f8e-5a3c-4d6e-9a43-6f75746278a2 timed out after 2.5s"},
		{"pointer 0xc000123 nil", "pointer 0xdeadbeef nil"},
		{"a   b\n c", "a b c"},
	} {
		if fa, fb := Fingerprint(c.a), Fingerprint(c.b); fa != fb {
			t.Errorf("%q and %q: fingerprints %q and %q, want one", c.a, c.b, fa, fb)
		}
	}
	if Fingerprint("refused: schema v1") == Fingerprint("timeout") {
		t.Error("different causes share a fingerprint")
	}
	long := make([]byte, 1000)
	for i := range long {
		long[i] = 'x'
	}
	if n := len(Fingerprint(string(long))); n > 200 {
		t.Errorf("fingerprint of 1000 bytes is %d bytes, want at most 200", n)
	}
}
