module github.com/watermill-outbox/outbox/drivers/mysql

go 1.25.0

require (
	github.com/go-sql-driver/mysql v1.10.0
	github.com/watermill-outbox/outbox v0.1.0
	go.uber.org/goleak v1.3.0
)

require filippo.io/edwards25519 v1.2.0 // indirect
