package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/mail"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/tenant"
)

// api is the HTTP API: POST /orders places an order, GET /orders/{id} shows it, GET /metrics
// serves the metrics in the Prometheus text format, GET /healthz answers readiness probes.
type api struct {
	db      *sql.DB
	ob      *outbox.Outbox
	metrics http.Handler // nil: no /metrics
	health  http.Handler // nil: no /healthz
	console http.Handler // nil: no /outbox/

	// set, with -tenants, runs the units of work on its member named member (whose Outbox is
	// ob, and whose database db); nil: on ob.
	set    *tenant.Set
	member string
}

func (a *api) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", a.placeOrder)
	mux.HandleFunc("GET /orders/{id}", a.getOrder)
	if a.metrics != nil {
		mux.Handle("GET /metrics", a.metrics)
	}
	if a.health != nil {
		mux.Handle("GET /healthz", a.health)
	}
	if a.console != nil {
		mux.Handle("/outbox/", http.StripPrefix("/outbox", a.console))
	}
	return mux
}

// Order is an order as the API shows it.
type Order struct {
	ID          string         `json:"id"`
	Customer    string         `json:"customer"`
	SKU         string         `json:"sku"`
	Quantity    int            `json:"quantity"`
	AmountCents int64          `json:"amount_cents"`
	Status      string         `json:"status"` // pending, reserved, paid or rejected
	Reason      string         `json:"reason,omitempty"`
	CreatedAt   time.Time      `json:"created_at"`
	UpdatedAt   time.Time      `json:"updated_at"`
	History     []HistoryEntry `json:"history"`
}

type HistoryEntry struct {
	Event string    `json:"event"`
	At    time.Time `json:"at"`
}

type placeOrderRequest struct {
	Customer string `json:"customer"` // e-mail address: the receipt goes there
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

func (r placeOrderRequest) validate() error {
	if _, err := mail.ParseAddress(r.Customer); err != nil || len(r.Customer) > 200 {
		return errors.New("customer must be an e-mail address")
	}
	if r.SKU == "" || len(r.SKU) > 100 {
		return errors.New("sku is required")
	}
	if r.Quantity < 1 || r.Quantity > 100 {
		return errors.New("quantity must be between 1 and 100")
	}
	return nil
}

var errUnknownSKU = errors.New("unknown sku")

// placeOrder stores the order and its OrderPlaced event in one transaction (ob.InTx): either both
// exist or neither does. The event is published right after the commit; if that fails, or the
// process dies first, the outbox relay publishes it later. The client gets 201 only once both
// are durable.
//
// A request with an Idempotency-Key header is a keyed unit of work: the key is claimed in the
// same transaction, with the response, so a client that retries (its connection dropped before
// the 201 arrived) gets the first response back, marked Idempotent-Replayed, and places no second
// order. A retry while the first request still runs gets 409; the key sent with another body, 422.
func (a *api) placeOrder(w http.ResponseWriter, r *http.Request) {
	var req placeOrderRequest
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid request body: %v", err))
		return
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid request body: %v", err))
		return
	}
	if err := req.validate(); err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	ctx, key := r.Context(), r.Header.Get("Idempotency-Key")
	if _, sent := r.Header["Idempotency-Key"]; sent {
		if key == "" || len(key) > 255 {
			writeError(w, http.StatusBadRequest, "Idempotency-Key must have 1 to 255 characters")
			return
		}
		// A key belongs to its caller, so that two clients who pick the same key never get each
		// other's orders. This example authenticates no one, and the customer stands for the
		// caller; a real service scopes by its authenticated principal (the account, the API
		// client), never by something the request merely claims. The fingerprint is the body:
		// the key sent again with another order is refused.
		fp := sha256.Sum256(body)
		scope := outbox.CallerScope(req.Customer, "orders")
		ctx = outbox.WithIdempotencyKey(ctx, scope, key, outbox.Fingerprint(fp[:]))
	}
	now := time.Now().UTC()
	order := Order{
		Customer: req.Customer, SKU: req.SKU, Quantity: req.Quantity,
		Status: "pending", CreatedAt: now, UpdatedAt: now, History: []HistoryEntry{},
	}
	err = a.inUnit(ctx, func(ctx context.Context, tx unitTx) error {
		// Derived from the key (random without one), as the event UUIDs are: a retry of a
		// request whose commit was lost creates the order its OrderPlaced event names.
		order.ID = outbox.NewUUID(ctx)
		var price int64
		err := tx.QueryRowContext(ctx, `SELECT price_cents FROM products WHERE sku = $1`, req.SKU).Scan(&price)
		if errors.Is(err, sql.ErrNoRows) {
			return errUnknownSKU
		} else if err != nil {
			return err
		}
		order.AmountCents = price * int64(req.Quantity)
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id, customer, sku, quantity, amount_cents, status, created_at, updated_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
			order.ID, order.Customer, order.SKU, order.Quantity, order.AmountCents, order.Status, now, now); err != nil {
			return err
		}
		// The order ID is the ordering key of every event about the order, and the correlation ID
		// that the framework copies onto every message caused by this one, all the way down.
		ctx = outbox.WithOrderingKey(ctx, order.ID)
		ctx = outbox.WithMetadata(ctx, outbox.MetadataCorrelationID, order.ID)
		if err := publishEvent(ctx, topicOrderPlaced, OrderPlaced{
			OrderID: order.ID, Customer: order.Customer, SKU: order.SKU, Quantity: order.Quantity, AmountCents: order.AmountCents,
		}); err != nil || key == "" {
			return err
		}
		resp, err := json.Marshal(order)
		if err != nil {
			return err
		}
		return outbox.SetResult(ctx, resp) // the response a retry with the key gets
	})
	switch {
	case errors.Is(err, errUnknownSKU):
		writeError(w, http.StatusUnprocessableEntity, "unknown sku "+req.SKU)
		return
	case errors.Is(err, outbox.ErrIdempotencyInFlight):
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusConflict, "a request with this Idempotency-Key is still being processed")
		return
	case errors.Is(err, outbox.ErrIdempotencyUnsupported):
		// The database's outbox driver keeps no keys: placing the order without its key would
		// break the promise the client relies on when it retries.
		writeError(w, http.StatusNotImplemented, "Idempotency-Key is not supported on this service's database; send the order without it")
		return
	case errors.Is(err, outbox.ErrIdempotencyMismatch):
		writeError(w, http.StatusUnprocessableEntity, "this Idempotency-Key was used for another request")
		return
	case err != nil:
		slog.Error("place order", "error", err)
		writeError(w, http.StatusInternalServerError, "could not place the order, try again")
		return
	}
	if stored, replayed := outbox.IdempotencyResult(ctx); replayed {
		// The order placed by the first request with the key, as it was answered then.
		if err := json.Unmarshal(stored, &order); err != nil {
			slog.Error("place order: the stored response is unreadable", "error", err)
			writeError(w, http.StatusInternalServerError, "could not read the order placed with this Idempotency-Key")
			return
		}
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.Header().Set("Location", "/orders/"+order.ID)
	writeJSON(w, http.StatusCreated, order)
}

// inUnit runs fn in a unit of work at the boundary: on the tenant's member of the Set (which
// Set.Remove waits for, and which marks its messages with the tenant, so that the consumers' Set
// resolves them); without tenants, on ob.
func (a *api) inUnit(ctx context.Context, fn func(ctx context.Context, tx unitTx) error) error {
	if a.set == nil {
		return inUnit(ctx, a.ob, fn)
	}
	return a.set.Do(ctx, a.member, func(ctx context.Context, ob *outbox.Outbox) error { return inUnit(ctx, ob, fn) })
}

func (a *api) getOrder(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	o := Order{ID: r.PathValue("id"), History: []HistoryEntry{}}
	err := a.db.QueryRowContext(ctx, `SELECT customer, sku, quantity, amount_cents, status, reason, created_at, updated_at
		FROM orders WHERE id = $1`, o.ID).
		Scan(&o.Customer, &o.SKU, &o.Quantity, &o.AmountCents, &o.Status, &o.Reason, &o.CreatedAt, &o.UpdatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		writeError(w, http.StatusNotFound, "no order "+o.ID)
		return
	} else if err != nil {
		slog.Error("get order", "error", err)
		writeError(w, http.StatusInternalServerError, "could not read the order")
		return
	}
	rows, err := a.db.QueryContext(ctx, `SELECT event, at FROM order_history WHERE order_id = $1 ORDER BY at`, o.ID)
	if err == nil {
		for rows.Next() {
			var h HistoryEntry
			if err = rows.Scan(&h.Event, &h.At); err != nil {
				break
			}
			o.History = append(o.History, h)
		}
		_ = rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	if err != nil {
		slog.Error("get order history", "error", err)
		writeError(w, http.StatusInternalServerError, "could not read the order")
		return
	}
	writeJSON(w, http.StatusOK, o)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]string{"error": msg})
}

// mountConsole sets up the outbox's web console (package console) at /outbox/ when the service
// runs on PostgreSQL or MySQL (package ops has their statements, not SQLite's). It asks for HTTP Basic
// authentication as user "operator" with cfg.consolePassword, or with a random password when none
// is set, and lets the operator retry, discard and replay. It returns what to tell the user, with
// ADDR standing for the listen address.
func (a *api) mountConsole(cfg config) (string, error) {
	opt, note, err := consoleOptions(cfg)
	if err != nil {
		return "", err
	}
	if note == "" {
		return "(needs PostgreSQL or MySQL: start with -postgres DSN or -mysql DSN)", nil
	}
	o, err := ops.ForOutbox(a.ob)
	if err != nil {
		return "", err
	}
	if a.console, err = console.New(o, opt); err != nil {
		return "", err
	}
	return note, nil
}

// consoleOptions returns the console's options (HTTP Basic as user "operator", who may retry,
// discard and replay) and the address to tell the user, or no address when the console needs a
// database this service does not run on.
func consoleOptions(cfg config) (console.Options, string, error) {
	if cfg.postgres == "" && cfg.mysql == "" {
		return console.Options{}, "", nil
	}
	password := cfg.consolePassword
	// The operator's own password is never printed (the banner may end up in a log); a
	// generated one must be, or nobody could sign in.
	note := "http://operator@ADDR/outbox/ (the password given by -console-password)"
	if password == "" {
		b := make([]byte, 12)
		if _, err := rand.Read(b); err != nil {
			return console.Options{}, "", err
		}
		password = hex.EncodeToString(b)
		note = "http://operator:" + password + "@ADDR/outbox/"
	}
	return console.Options{
		// The console answers a request without the credentials with a challenge: the browser asks.
		BasicAuth: func(user, pass string) bool {
			return user == "operator" && subtle.ConstantTimeCompare([]byte(pass), []byte(password)) == 1
		},
		Authorize: func(_ *http.Request, user string, _ console.Action) bool { return user == "operator" },
	}, note, nil
}
