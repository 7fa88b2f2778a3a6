package store

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// inlineVersion is the first byte of the inline effects encoding.
const inlineVersion = 1

// EncodeEffects encodes effects for the inline effects column of a claim: a version byte, the
// count, then per effect its seq and the length-prefixed kind, topic, UUID, payload, metadata
// (EncodeMetadata) and ordering key. Any bytes round-trip.
func EncodeEffects(effects []outboxdriver.Effect) []byte {
	size := 1 + binary.MaxVarintLen64
	mds := make([][]byte, len(effects))
	for i, e := range effects {
		mds[i] = EncodeMetadata(e.Metadata)
		size += 7*binary.MaxVarintLen64 + len(e.Kind) + len(e.Topic) + len(e.UUID) + len(e.Payload) + len(mds[i]) + len(e.OrderingKey)
	}
	b := make([]byte, 0, size)
	b = append(b, inlineVersion)
	b = binary.AppendUvarint(b, uint64(len(effects)))
	str := func(s []byte) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	for i, e := range effects {
		b = binary.AppendUvarint(b, uint64(e.Seq))
		str([]byte(e.Kind))
		str([]byte(e.Topic))
		str([]byte(e.UUID))
		str(e.Payload)
		str(mds[i])
		str([]byte(e.OrderingKey))
	}
	return b
}

var errCorruptEffects = errors.New("corrupt inline effects encoding")

// DecodeEffects reverses EncodeEffects; Source is set to src on each effect.
func DecodeEffects(b []byte, src outboxdriver.Source) ([]outboxdriver.Effect, error) {
	if len(b) == 0 || b[0] != inlineVersion {
		return nil, fmt.Errorf("%w: unknown version", errCorruptEffects)
	}
	b = b[1:]
	uv := func() (uint64, error) {
		v, w := binary.Uvarint(b)
		if w <= 0 {
			return 0, errCorruptEffects
		}
		b = b[w:]
		return v, nil
	}
	bytes := func() ([]byte, error) {
		l, err := uv()
		if err != nil || l > uint64(len(b)) {
			return nil, errCorruptEffects
		}
		s := b[:l:l]
		b = b[l:]
		return s, nil
	}
	n, err := uv()
	if err != nil || n > uint64(len(b)) {
		return nil, errCorruptEffects
	}
	out := make([]outboxdriver.Effect, 0, n)
	for i := uint64(0); i < n; i++ {
		seq, err := uv()
		if err != nil {
			return nil, fmt.Errorf("effect %d: %w", i, err)
		}
		var f [6][]byte
		for j := range f {
			if f[j], err = bytes(); err != nil {
				return nil, fmt.Errorf("effect %d field %d: %w", i, j, err)
			}
		}
		md, err := DecodeMetadata(f[4])
		if err != nil {
			return nil, fmt.Errorf("effect %d: %w", i, err)
		}
		out = append(out, outboxdriver.Effect{Seq: int(seq), Kind: string(f[0]), Topic: string(f[1]), UUID: string(f[2]),
			Payload: append([]byte{}, f[3]...), Metadata: md, OrderingKey: string(f[5]), Source: src})
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes", errCorruptEffects, len(b))
	}
	return out, nil
}
