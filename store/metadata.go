package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
)

// EncodeMetadata encodes metadata losslessly (any bytes, NUL and invalid UTF-8 included) as a
// sequence of length-prefixed strings: count, then key and value of each entry in key order.
func EncodeMetadata(md map[string]string) []byte {
	keys := make([]string, 0, len(md))
	size := binary.MaxVarintLen64
	for k, v := range md {
		keys = append(keys, k)
		size += 2*binary.MaxVarintLen64 + len(k) + len(v)
	}
	sort.Strings(keys)
	b := make([]byte, 0, size)
	b = binary.AppendUvarint(b, uint64(len(keys)))
	for _, k := range keys {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(md[k])))
		b = append(b, md[k]...)
	}
	return b
}

var errCorruptMetadata = errors.New("corrupt metadata encoding")

// DecodeMetadata reverses EncodeMetadata.
func DecodeMetadata(b []byte) (map[string]string, error) {
	if len(b) == 0 {
		return map[string]string{}, nil
	}
	n, w := binary.Uvarint(b)
	if w <= 0 || n > uint64(len(b)) {
		return nil, errCorruptMetadata
	}
	b = b[w:]
	md := make(map[string]string, n)
	next := func() (string, error) {
		l, w := binary.Uvarint(b)
		if w <= 0 || l > uint64(len(b)-w) {
			return "", errCorruptMetadata
		}
		s := string(b[w : w+int(l)])
		b = b[w+int(l):]
		return s, nil
	}
	for i := uint64(0); i < n; i++ {
		k, err := next()
		if err != nil {
			return nil, fmt.Errorf("entry %d key: %w", i, err)
		}
		v, err := next()
		if err != nil {
			return nil, fmt.Errorf("entry %d value: %w", i, err)
		}
		md[k] = v
	}
	if len(b) != 0 {
		return nil, errCorruptMetadata
	}
	return md, nil
}
