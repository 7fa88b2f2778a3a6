package idempotency

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
)

// defaultMaxResponseBytes is Config.MaxResponseBytes when it is not set.
const defaultMaxResponseBytes = 1 << 20

// storedHeaderRoom is what a stored response may take besides its body: the encoding's own
// bytes, the status and the StoredHeaders. MaxResponseBytes must leave it within the Outbox's
// MaxPayloadBytes, so that every body the recorder accepts can be stored.
const storedHeaderRoom = 8 << 10

// storedMagic begins a stored response in the binary form. A JSON text cannot begin with NUL,
// so the form a response was stored in is told by its first byte: results stored in JSON before
// this form (with the body in base64, 4/3 of its bytes) are still read.
const storedMagic = "\x00\x01"

// encodeStored encodes s as status, headers and then the body's raw bytes, so that the body
// counts once against MaxPayloadBytes. It refuses, wrapping errTooLarge, a status and headers
// that take more than storedHeaderRoom.
func encodeStored(s stored) ([]byte, error) {
	var b []byte
	b = append(b, storedMagic...)
	b = binary.AppendUvarint(b, uint64(s.Status))
	b = binary.AppendUvarint(b, uint64(len(s.Header)))
	for name, values := range s.Header {
		b = appendString(b, name)
		b = binary.AppendUvarint(b, uint64(len(values)))
		for _, v := range values {
			b = appendString(b, v)
		}
	}
	if len(b) > storedHeaderRoom {
		return nil, fmt.Errorf("%w: the status and stored headers take %d bytes, more than the %d kept for them", errTooLarge, len(b), storedHeaderRoom)
	}
	return append(b, s.Body...), nil
}

func appendString(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

// errCorrupt is returned for a stored response that ends too soon or declares more than it holds.
var errCorrupt = errors.New("truncated or malformed")

// decodeStored reads a response stored by encodeStored, or in the JSON form stored before it.
func decodeStored(b []byte) (stored, error) {
	if !bytes.HasPrefix(b, []byte(storedMagic)) {
		var s stored
		if err := json.Unmarshal(b, &s); err != nil {
			return stored{}, fmt.Errorf("stored response in JSON: %w", err)
		}
		if s.Status < 200 || s.Status > 999 {
			return stored{}, fmt.Errorf("stored response in JSON: status %d: %w", s.Status, errCorrupt)
		}
		return s, nil
	}
	r := &reader{b: b[len(storedMagic):]}
	s := stored{Status: int(r.uvarint())}
	if s.Status < 200 || s.Status > 999 {
		// Not a response net/http can send (it panicked, at every replay of the key).
		r.fail()
	}
	if n := r.count(); n > 0 {
		s.Header = make(http.Header, n)
		for range n {
			name := r.string()
			values := make([]string, r.count())
			for i := range values {
				values[i] = r.string()
			}
			s.Header[name] = values
		}
	}
	if r.err != nil {
		return stored{}, fmt.Errorf("stored response: %w", r.err)
	}
	s.Body = r.b
	return s, nil
}

// reader reads the fields of a stored response; after the first error it reads zeros.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail() { r.err, r.b = errCorrupt, nil }

func (r *reader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a count or a length, which cannot exceed what is left to read: a corrupt one
// cannot make the decoder allocate more than the response holds.
func (r *reader) count() int {
	v := r.uvarint()
	if v > uint64(len(r.b)) {
		r.fail()
		return 0
	}
	return int(v)
}

func (r *reader) string() string {
	n := r.count()
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

// checkStoredRoom refuses a MaxResponseBytes that leaves a stored response no room for its status
// and headers within the Outbox's MaxPayloadBytes: a response under the bound would then fail
// when it is stored.
func (c Config) checkStoredRoom() error {
	if c.Outbox == nil {
		return nil
	}
	limit := c.MaxResponseBytes
	if limit == 0 {
		limit = defaultMaxResponseBytes
	}
	if payload := c.Outbox.Config().MaxPayloadBytes; limit > payload-storedHeaderRoom {
		return fmt.Errorf("MaxResponseBytes (%d) must leave %d bytes for the stored status and headers within the Outbox's MaxPayloadBytes (%d): at most %d",
			limit, storedHeaderRoom, payload, payload-storedHeaderRoom)
	}
	return nil
}
