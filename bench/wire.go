package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/binary"
	"net"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lib/pq"
)

// wireCounters count, for every connection of one contender's *sql.DB, what its driver puts on the
// wire. They are read from the PostgreSQL frontend protocol itself, below lib/pq, so they count
// whatever a contender's code (or its library: River, watermill-sql, the framework) does.
type wireCounters struct {
	roundTrips atomic.Int64 // client writes that follow a read: one synchronous wait for the server each
	syncRT     atomic.Int64 // the round trips made from a consumer goroutine (see consumerGoroutines), not from background work
	simple     atomic.Int64 // 'Q' messages: simple-protocol statements (BEGIN, COMMIT, queries without parameters)
	execute    atomic.Int64 // 'E' messages: extended-protocol statement executions
	parse      atomic.Int64 // 'P' messages: statements parsed (prepared or unnamed)
	bytesOut   atomic.Int64
	bytesIn    atomic.Int64
}

type wireSnapshot struct {
	RoundTrips, SyncRoundTrips, Statements, Parses, BytesOut, BytesIn int64
}

func (c *wireCounters) snapshot() wireSnapshot {
	return wireSnapshot{
		RoundTrips:     c.roundTrips.Load(),
		SyncRoundTrips: c.syncRT.Load(),
		Statements:     c.simple.Load() + c.execute.Load(),
		Parses:         c.parse.Load(),
		BytesOut:       c.bytesOut.Load(),
		BytesIn:        c.bytesIn.Load(),
	}
}

func (a wireSnapshot) sub(b wireSnapshot) wireSnapshot {
	return wireSnapshot{a.RoundTrips - b.RoundTrips, a.SyncRoundTrips - b.SyncRoundTrips, a.Statements - b.Statements,
		a.Parses - b.Parses, a.BytesOut - b.BytesOut, a.BytesIn - b.BytesIn}
}

func (a wireSnapshot) add(b wireSnapshot) wireSnapshot {
	return wireSnapshot{a.RoundTrips + b.RoundTrips, a.SyncRoundTrips + b.SyncRoundTrips, a.Statements + b.Statements,
		a.Parses + b.Parses, a.BytesOut + b.BytesOut, a.BytesIn + b.BytesIn}
}

// consumerGoroutines holds the IDs of the harness's consumer goroutines. database/sql runs a
// query's driver calls, and so lib/pq's writes, in the goroutine that called it: a round trip
// written from a consumer goroutine is one the message waits for; any other (a relay, River's
// workers, a mark written in the background) is background work.
//
// Finding the calling goroutine costs a runtime.Stack call per round trip, far more CPU than the
// round trip itself on the client side, so it is done only while classifyRoundTrips is set: in
// short untimed passes (see main), never in the timed runs, whose numbers it would distort in
// proportion to each contender's round trips.
var (
	consumerGoroutines sync.Map
	classifyRoundTrips atomic.Bool
)

func goroutineID() int64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	if i := bytes.IndexByte(b, ' '); i > 0 {
		b = b[:i]
	}
	id, _ := strconv.ParseInt(string(b), 10, 64)
	return id
}

// openCounted opens a lib/pq *sql.DB whose connections are counted in c.
func openCounted(dsn string, c *wireCounters, maxConns int) (*sql.DB, error) {
	conn, err := pq.NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	conn.Dialer(countingDialer{c: c})
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	return db, nil
}

type countingDialer struct{ c *wireCounters }

func (d countingDialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

func (d countingDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.DialContext(ctx, network, address)
}

func (d countingDialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	var nd net.Dialer
	c, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	cc := &countingConn{startup: true}
	cc.roundTripConn = roundTripConn{Conn: c, c: d.c, parse: cc.parse}
	return cc, nil
}

// roundTripConn counts the round trips and bytes of a connection: a write after a read starts a
// round trip. parse reads the protocol's messages out of each write (under mu).
type roundTripConn struct {
	net.Conn
	c *wireCounters

	mu        sync.Mutex
	lastWrite bool // the last I/O was a write: further writes belong to the same round trip
	parse     func(p []byte)
}

func (cc *roundTripConn) Read(p []byte) (int, error) {
	n, err := cc.Conn.Read(p)
	cc.c.bytesIn.Add(int64(n))
	if n > 0 {
		cc.mu.Lock()
		cc.lastWrite = false
		cc.mu.Unlock()
	}
	return n, err
}

func (cc *roundTripConn) Write(p []byte) (int, error) {
	cc.mu.Lock()
	if !cc.lastWrite {
		cc.c.roundTrips.Add(1)
		cc.lastWrite = true
		if classifyRoundTrips.Load() {
			if _, ok := consumerGoroutines.Load(goroutineID()); ok {
				cc.c.syncRT.Add(1)
			}
		}
	}
	cc.parse(p)
	cc.mu.Unlock()
	n, err := cc.Conn.Write(p)
	cc.c.bytesOut.Add(int64(n))
	return n, err
}

// countingConn parses the frontend message stream: after the untyped startup packet, every
// message is a type byte and a big-endian int32 length that includes itself.
type countingConn struct {
	roundTripConn
	startup bool
	hdr     []byte // partial header
	skip    int    // body bytes of the current message still to skip
}

func (cc *countingConn) parse(p []byte) {
	for len(p) > 0 {
		if cc.skip > 0 {
			k := min(cc.skip, len(p))
			cc.skip -= k
			p = p[k:]
			continue
		}
		hdrLen := 5
		if cc.startup {
			hdrLen = 4
		}
		k := min(hdrLen-len(cc.hdr), len(p))
		cc.hdr = append(cc.hdr, p[:k]...)
		p = p[k:]
		if len(cc.hdr) < hdrLen {
			return
		}
		if cc.startup {
			cc.startup = false
			cc.skip = int(binary.BigEndian.Uint32(cc.hdr)) - 4
		} else {
			switch cc.hdr[0] {
			case 'Q':
				cc.c.simple.Add(1)
			case 'E':
				cc.c.execute.Add(1)
			case 'P':
				cc.c.parse.Add(1)
			}
			cc.skip = int(binary.BigEndian.Uint32(cc.hdr[1:])) - 4
		}
		cc.hdr = cc.hdr[:0]
	}
}
